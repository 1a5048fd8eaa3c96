"""Harvest activations over a prompt file into a dataset SAELens trains from.

Every prompt is tokenized, the token streams are concatenated and cut into --context-size
windows; each window is one forward and one row of the dataset (one column per point, plus
token_ids). Rerunning the same command resumes an interrupted harvest; other arguments on an
existing directory are refused. Read it back with interp_engine.harvest.load(DIR), or train
from it with SAELens (cached_activations_path=DIR)."""

from __future__ import annotations

import argparse
import pathlib

from ._cli_common import UsageError, add_model_arguments, load

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--points", nargs="+", required=True, metavar="POINT",
                        help="addresses or patterns to harvest, e.g. resid_post.1 mlp_out.2 or 'resid_post.*' (quoted: "
                             "each address a pattern names becomes a column)")
    parser.add_argument("--prompts", required=True, metavar="FILE",
                        help="a text file (one prompt per line) or .jsonl file (a \"text\" field per line)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the dataset directory (new, or one to resume)")
    parser.add_argument("--context-size", type=int, default=128, help="positions per row (default 128)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="0: prompt windows only (default); N: each row ends with N greedy generated tokens")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per eager forward (default 8)")
    parser.add_argument("--max-in-flight", type=int, default=64, help="concurrent vLLM requests (default 64)")
    parser.add_argument("--shard-mb", type=float, default=256.0, help="the most one shard holds, in MiB (default 256)")


def run(args: argparse.Namespace) -> int:
    from ._harvest import harvest

    prompts = pathlib.Path(args.prompts)
    if not prompts.is_file():
        raise UsageError(f"--prompts {args.prompts}: no such file (one prompt per line, or .jsonl with \"text\")")
    if args.shard_mb <= 0:
        raise UsageError(f"--shard-mb must be positive, got {args.shard_mb}")
    points = [p for item in args.points for p in item.split(",") if p]
    model = load(args)
    try:
        report = harvest(model, prompts, points, args.out, context_size=args.context_size,
                         max_tokens=args.max_tokens, batch_size=args.batch_size,
                         max_in_flight=args.max_in_flight, shard_bytes=int(args.shard_mb * 2**20))
    finally:
        model.close()
    resumed = f", {report.rows_resumed} resumed" if report.rows_resumed else ""
    harvested = report.points
    print(f"{report.out}: {report.rows} rows x {args.context_size} positions of {', '.join(harvested)} "
          f"in {report.shards} shards ({report.rows_this_run} this run{resumed}, "
          f"{report.tokens_per_second:.0f} tokens/s); {report.tokens_left_out} tokens after the last "
          "full window left out")
    return 0
