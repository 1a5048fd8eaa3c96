"""What the subcommands share: choosing and loading a model, reading prompts, output paths."""

from __future__ import annotations

import argparse
import pathlib

__all__ = ["UsageError", "add_model_arguments", "load", "parse_prompts", "png_path", "resolve_model"]

TINY_PREFIX = "tiny:"


class UsageError(Exception):
    """A mistake in how a subcommand was called; the CLI prints it as one line."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="demo",
        help="'demo' (the built-in trained tiny Qwen3, the default), 'tiny:ARCH' (a random-weight "
             f"test model: {', '.join(_tiny_archs())}), a model directory, or a "
             "hub name already in the local Hugging Face cache")
    parser.add_argument("--backend", default="eager", choices=("eager", "vllm", "vllm-static"),
                        help="where the model runs (default: eager)")


def _tiny_archs() -> tuple[str, ...]:
    from .testing import TINY_ARCHS  # derived from the spec registry

    return TINY_ARCHS


def resolve_model(name: str):
    """The model directory (or hub name) that ``--model NAME`` stands for."""
    if name == "demo":
        from ._demo_model import demo_model

        return demo_model()
    if name.startswith(TINY_PREFIX):
        from .testing import TINY_ARCHS, tiny_model

        arch = name[len(TINY_PREFIX):]
        if arch not in TINY_ARCHS:
            raise UsageError(f"--model {name}: unknown tiny architecture {arch!r}; "
                             f"choose one of {', '.join(TINY_ARCHS)}")
        return tiny_model(arch)
    return name


def load(args: argparse.Namespace):
    """The model ``--model`` and ``--backend`` ask for."""
    from ._model import load_model

    return load_model(resolve_model(args.model), backend=args.backend)


def parse_prompts(text: str, option: str) -> list[str]:
    """``"a | b | c"`` -> ``["a", "b", "c"]``; empty entries are a mistake."""
    prompts = [p.strip() for p in text.split("|")]
    if not text.strip() or any(not p for p in prompts):
        raise UsageError(f"{option} takes prompts separated by '|', like \"The capital of Germany is | "
                         f"I flew to Germany\"; got {text!r}")
    return prompts


def png_path(value: str | None, option: str = "--png") -> pathlib.Path | None:
    if value is None:
        return None
    path = pathlib.Path(value)
    if path.suffix.lower() != ".png":
        raise UsageError(f"{option} {value}: the file name must end in .png")
    if path.parent and not path.parent.is_dir():
        raise UsageError(f"{option} {value}: the folder {str(path.parent)!r} does not exist")
    return path
