"""The attention patterns of one layer for one prompt, one panel per head (query position by
key position). Served by eager and by the hook-based vLLM backend (rebuilt in the worker from
the queries and keys its attention kernels receive)."""

from __future__ import annotations

import argparse

import torch

from ._cli_common import UsageError, add_model_arguments, load, png_path

__all__ = ["add_arguments", "pattern", "run"]


def pattern(model, prompt: str, layer: int) -> tuple[torch.Tensor, list[str]]:
    """``[n_heads, query_pos, key_pos]`` attention probabilities at ``layer``, and the tokens."""
    from ._api import run_with_cache

    if not 0 <= layer < model.n_layers:
        raise UsageError(f"--layer {layer}: this model has layers 0..{model.n_layers - 1}")
    tokens = model.to_tokens(prompt)
    cache = run_with_cache(model, tokens, [f"pattern.{layer}"])
    return cache.get("pattern", layer)[0], model.to_str_tokens(tokens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the text to read")
    parser.add_argument("--layer", type=int, default=0, help="which layer (default 0)")
    parser.add_argument("--png", required=True, help="the .png file to write")


def run(args: argparse.Namespace) -> int:
    out = png_path(args.png)
    model = load(args)
    probs, labels = pattern(model, args.prompt, args.layer)
    from ._plots import attention_png

    attention_png(out, probs, labels, f"attention at layer {args.layer}: {args.prompt!r}")
    strongest = probs[:, -1].argmax(dim=-1).tolist()
    print("last position attends most to: " + ", ".join(
        f"head {h} -> {labels[k]!r} ({float(probs[h, -1, k]):.2f})" for h, k in enumerate(strongest)))
    print(f"wrote {out}")
    return 0
