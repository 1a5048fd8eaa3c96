"""The logit lens of one prompt: each layer's residual stream decoded through the final norm
and the unembedding, at every position. Prints the top token and its probability per layer at
the last position (or every position with --all-positions); --png draws the whole grid."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from ._cli_common import add_model_arguments, load, png_path

__all__ = ["Lens", "add_arguments", "lens", "print_lens", "run"]


@dataclass(frozen=True)
class Lens:
    """The lens of one prompt: row 0 is the embeddings (resid_pre.0), row i+1 is resid_post.i."""

    rows: tuple[str, ...]
    inputs: tuple[str, ...]
    top_ids: torch.Tensor  # [row, pos]
    top_probs: torch.Tensor  # [row, pos]
    top_tokens: tuple[tuple[str, ...], ...]
    logprobs: torch.Tensor  # [row, pos, d_vocab]


def lens(model, prompt: str) -> Lens:
    from ._api import run_with_cache

    tokens = model.to_tokens(prompt)
    points = ["resid_pre.0"] + [f"resid_post.{layer}" for layer in range(model.n_layers)]
    cache = run_with_cache(model, tokens, points)
    logprobs = model.decode_residuals(cache, points=points)[:, 0]  # [row, pos, d_vocab]
    values, ids = logprobs.max(dim=-1)
    words = tuple(tuple(model.tok.to_str_tokens(row.tolist())) for row in ids)
    rows = ("embed",) + tuple(f"layer {layer}" for layer in range(model.n_layers))
    return Lens(rows, tuple(model.to_str_tokens(tokens)), ids, values.exp(), words, logprobs)


def print_lens(result: Lens, all_positions: bool = False, indent: str = "   ") -> None:
    columns = range(len(result.inputs)) if all_positions else [len(result.inputs) - 1]
    for c in columns:
        print(f"{indent}position {c} (input {result.inputs[c]!r}):")
        for r, name in enumerate(result.rows):
            print(f"{indent}  {name:<8} top {result.top_tokens[r][c]!r:<14} p={float(result.top_probs[r, c]):.3f}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the text to read")
    parser.add_argument("--png", help="also draw the layers x positions heatmap into this .png file")
    parser.add_argument("--all-positions", action="store_true", help="print every position, not only the last")


def run(args: argparse.Namespace) -> int:
    out = png_path(args.png)
    model = load(args)
    result = lens(model, args.prompt)
    print_lens(result, args.all_positions, indent="")
    if out is not None:
        from ._plots import lens_png

        lens_png(out, result.top_probs, result.top_tokens, result.rows, result.inputs,
                 f"logit lens: {args.prompt!r}")
        print(f"wrote {out}")
    return 0
