"""``interp-engine``: the command line.

Every subcommand is one row of ``COMMANDS``: its name, a one-line help, and the module holding
its ``add_arguments(parser)`` and ``run(args) -> int`` (imported only when that subcommand
runs, so ``--help`` stays fast). Adding a subcommand is adding a row (or calling ``register``).

A user mistake (a bad option value, a model that is not there, work the backend refuses)
prints one line, ``interp-engine CMD: error: ...``, and exits with status 2; set
``INTERP_ENGINE_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass

__all__ = ["COMMANDS", "Command", "build_parser", "main", "register"]


@dataclass(frozen=True)
class Command:
    """One subcommand: ``module`` defines ``add_arguments(parser)`` and ``run(args) -> int``."""

    name: str
    help: str
    module: str


COMMANDS: list[Command] = [
    Command("demo", "the tour: a trained tiny model, its logit lens, steering, pictures",
            "interp_engine._demo"),
    Command("lens", "logit lens of one prompt: top token per layer and position (--png heatmap)",
            "interp_engine._cli_lens"),
    Command("attention", "attention patterns of one layer as a grid of heads (--png)",
            "interp_engine._cli_attention"),
    Command("generate", "generate text, optionally steered (--steer FILE, --steer-from POS NEG)",
            "interp_engine._cli_generate"),
    Command("points", "the points a model has, and which this backend serves (and why not)",
            "interp_engine._cli_points"),
    Command("compare", "one model on several backends: captures and greedy tokens, the differences",
            "interp_engine._compare_cli"),
    Command("harvest", "activations over a prompt file to a dataset SAELens trains from (resumable)",
            "interp_engine._cli_harvest"),
    Command("serve", "vLLM's OpenAI-compatible server with steering and capture per request",
            "interp_engine._cli_serve"),
]


def register(name: str, help: str, module: str) -> None:
    """Add a subcommand (``module`` defines ``add_arguments`` and ``run``); a name is taken once."""
    if any(c.name == name for c in COMMANDS):
        raise ValueError(f"subcommand {name!r} is already registered")
    COMMANDS.append(Command(name, help, module))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="interp-engine",
        description="Mechanistic interpretability on eager transformers and inside vLLM.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        module = importlib.import_module(command.module)
        doc = (module.__doc__ or command.help).strip()
        child = sub.add_parser(command.name, help=command.help, description=doc,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(child)
        child.set_defaults(_run=module.run)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from ._capabilities import CapabilityUnsupported
    from ._cli_common import UsageError
    from ._model import ModelNotFound
    from ._shapes import ShapeError

    return (UsageError, CapabilityUnsupported, ModelNotFound, ShapeError, ValueError, KeyError,
            FileNotFoundError, FileExistsError, IsADirectoryError, PermissionError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:  # what follows goes to the engine as it is (serve: vLLM's server options)
        at = argv.index("--")
        argv, passthrough = argv[:at], argv[at + 1:]
    args = parser.parse_args(argv)
    if passthrough:
        if not hasattr(args, "passthrough"):
            parser.error(f"{args.command} takes no options after --")
        args.passthrough = passthrough
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # our output, not vLLM's start-up log
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' per-load "Loading weights" bars
    try:
        return int(args._run(args) or 0)
    except _user_errors() as exc:
        if os.environ.get("INTERP_ENGINE_DEBUG"):
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        print(f"interp-engine {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interp-engine {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
