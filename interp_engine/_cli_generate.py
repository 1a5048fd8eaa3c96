"""Generate text from a prompt, optionally steered.

Steering: --steer-from POS NEG builds a vector as the mean residual stream (at --at, last
position) of the POS prompts minus that of the NEG prompts (each a '|'-separated list), and
adds --scale times it at every position. --save-steer FILE keeps that vector; --steer FILE
applies a saved one (a torch file holding {"address": str, "vector": tensor [d_model]}, or a
bare [d_model] tensor placed at --at)."""

from __future__ import annotations

import argparse
import math
import pathlib

import torch

from ._cli_common import UsageError, add_model_arguments, load, parse_prompts

__all__ = ["add_arguments", "mean_difference", "run"]


def mean_difference(model, positive: list[str], negative: list[str], address: str) -> torch.Tensor:
    """Mean of ``address`` at the last position over ``positive`` minus the same over ``negative``."""
    from ._address import to_address
    from ._api import run_with_cache

    point = to_address(address)

    def mean(prompts: list[str]) -> torch.Tensor:
        rows = [run_with_cache(model, model.to_tokens(p), [point])[point][0, -1] for p in prompts]
        return torch.stack(rows).mean(dim=0)

    return mean(positive) - mean(negative)


def _load_vector(path: str, at: str) -> tuple[str, torch.Tensor]:
    file = pathlib.Path(path)
    if not file.is_file():
        raise UsageError(f"--steer {path}: no such file (write one with --steer-from ... --save-steer FILE)")
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # a file torch cannot read is the user's to fix
        raise UsageError(f"--steer {path}: not a torch file ({type(exc).__name__}: {exc})") from None
    if isinstance(data, torch.Tensor):
        return at, data
    if isinstance(data, dict) and isinstance(data.get("vector"), torch.Tensor) and isinstance(data.get("address"), str):
        return data["address"], data["vector"]
    raise UsageError(f"--steer {path}: expected a tensor [d_model] or a dict with 'address' and 'vector'")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-tokens", type=int, default=16, help="how many tokens at most (default 16)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    parser.add_argument("--seed", type=int, help="makes sampling reproducible")
    parser.add_argument("--n-logprobs", type=int, help="print the top N log-probabilities of each step")
    steer = parser.add_mutually_exclusive_group()
    steer.add_argument("--steer", metavar="FILE", help="apply a saved steering vector")
    steer.add_argument("--steer-from", nargs=2, metavar=("POS", "NEG"),
                       help="build a steering vector: mean of POS prompts minus mean of NEG prompts")
    parser.add_argument("--at", help="where the vector is read and added (default resid_post of the middle layer)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the steering vector (default 1)")
    parser.add_argument("--save-steer", metavar="FILE", help="write the vector built by --steer-from here")


def run(args: argparse.Namespace) -> int:
    from ._api import generate_stream, steer
    from ._plan import SteerSpec

    if args.save_steer and not args.steer_from:
        raise UsageError("--save-steer keeps the vector built by --steer-from; pass --steer-from POS NEG too")
    if not math.isfinite(args.scale):
        raise UsageError(f"--scale must be a finite number, got {args.scale}")
    if args.steer_from:
        positive = parse_prompts(args.steer_from[0], "--steer-from POS")
        negative = parse_prompts(args.steer_from[1], "--steer-from NEG")
    model = load(args)
    at = args.at or f"resid_post.{model.n_layers // 2}"
    spec = SteerSpec()
    if args.steer:
        at, vector = _load_vector(args.steer, at)
        spec = SteerSpec.add(at, vector, scale=args.scale)
    elif args.steer_from:
        vector = mean_difference(model, positive, negative, at)
        spec = SteerSpec.add(at, vector, scale=args.scale)
        print(f"steering vector at {at}: mean of {len(positive)} minus mean of {len(negative)} prompts, "
              f"norm {float(vector.norm()):.2f}, scale {args.scale:g}")
        if args.save_steer:
            torch.save({"address": at, "vector": vector}, args.save_steer)
            print(f"wrote {args.save_steer}")
    tokens = model.to_tokens(args.prompt)
    with steer(model, spec):
        steps = generate_stream(model, tokens, max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed, n_logprobs=args.n_logprobs)
        print(args.prompt, end="", flush=True)
        rows = []
        for step in steps:
            print(step.token_str, end="", flush=True)
            rows.append(step)
    print()
    if args.n_logprobs:
        for i, step in enumerate(rows):
            alternatives = "  ".join(f"{model.to_string([d['token_id']])!r} {d['logprob']:.3f}" for d in step.logprobs)
            print(f"  step {i}: {step.token_str!r:<12} {alternatives}")
    return 0
