"""``interp-engine compare``: one model on several backends, captures and greedy tokens
compared, the report printed (and a per-layer PNG on request). Exit status 0 when every output
agrees within the tolerance, 1 otherwise.

A row of cli.COMMANDS (``add_arguments`` and ``run``); the demo's ``--compare-vllm`` is
``print_backend_comparison(path, tokens, points, max_tokens)``.
"""

from __future__ import annotations

import argparse

from ._cli_common import UsageError

__all__ = ["add_arguments", "print_backend_comparison", "run"]

_DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="model name or directory (a tiny test architecture as tiny:qwen3)")
    p.add_argument("--backends", default="eager,vllm", help="comma-separated, the first is the reference "
                                                          "(default eager,vllm)")
    p.add_argument("--points", default="resid_post",
                   help="comma-separated addresses (resid_post.3) or point names for every layer "
                        "(default resid_post)")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--dtype", default=None, choices=_DTYPES, help="load dtype (default: the model's)")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens to compare (0: none)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="scale-relative tolerance (default: from the dtype and depth)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the per-layer relative difference here")


def _points(model, spec: str) -> list:
    from . import Address

    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if "." in item:
            out.append(item)
        else:
            out.extend(Address(item, layer) for layer in model.graph.layers_of(item))
    if not out:
        raise SystemExit("--points named nothing: give addresses (resid_post.3) or point names (resid_post)")
    return out


def _path(name: str):
    if name.startswith("tiny:"):
        from .testing import tiny_model

        return tiny_model(name[len("tiny:"):])
    return name


def _unique(name: str, taken) -> str:
    out, i = name, 2
    while out in taken:
        out, i = f"{name}#{i}", i + 1
    return out


def _pipeline(tokens, points, max_tokens: int):
    from . import generate_stream, run_with_cache

    def pipeline(model):
        out = {"cache": run_with_cache(model, tokens, points)}
        if max_tokens:
            out["greedy"] = list(generate_stream(model, tokens, max_tokens=max_tokens, temperature=0.0,
                                                 n_logprobs=2, stop_at_eos=False))
        return out
    return pipeline


def print_backend_comparison(path, tokens, points, max_tokens: int = 8, backends=("eager", "vllm")) -> bool:
    """Load ``path`` on each backend, compare captures of ``points`` and greedy tokens, print
    the report; True when it passed."""
    from . import compare, load_model

    models = {}
    try:
        for backend in backends:
            models[_unique(backend, models)] = load_model(path, backend=backend)
        report = compare(_pipeline(tokens, points, max_tokens), models)
        print(report.table())
        return report.passed
    finally:
        for model in models.values():
            model.close()


def run(args: argparse.Namespace) -> int:
    from . import compare, load_model

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if len(backends) < 2:
        raise UsageError(f"--backends needs two or more, got {args.backends!r} (e.g. eager,vllm)")
    if args.max_tokens < 0:
        raise UsageError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    path = _path(args.model)
    models = {}
    try:
        for backend in backends:
            models[_unique(backend, models)] = load_model(path, backend=backend, dtype=args.dtype)
        first = next(iter(models.values()))
        points = _points(first, args.points)
        tokens = first.to_tokens(args.prompt)
        report = compare(_pipeline(tokens, points, args.max_tokens), models, tolerance=args.tolerance)
        print(f"model {args.model}, prompt {args.prompt!r} ({tokens.shape[1]} tokens)")
        print(report.table())
        if args.plot:
            print(f"per-layer plot: {report.plot(args.plot)}")
        return 0 if report.passed else 1
    finally:
        for model in models.values():
            model.close()
