"""Eager decode speed, in one run, as ratios: interp_engine greedy generate_stream tokens/s
against HF ``generate()`` on the same model and prompt (target >= 0.9), and steered against
unsteered decode (target >= 0.95).

    .venv/bin/python benchmarks/bench_decode.py [--tokens N] [--repeats N]
"""

from __future__ import annotations

import argparse

import torch

from _timing import interleaved_medians
from interp_engine import SteerSpec, generate_stream, load_model, steer
from interp_engine.testing import tiny_model


def bench(variant: str, n_tokens: int, repeats: int) -> None:
    model = load_model(tiny_model("qwen3", variant))
    hf = model.hf
    ids = model.to_tokens("The capital of France is a city where")
    v = torch.randn(model.d_model, generator=torch.Generator().manual_seed(0))
    spec = SteerSpec.add(f"resid_post.{model.n_layers // 2}", v / v.norm(), scale=2.0)

    def hf_generate():
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False,
                              pad_token_id=model.tok.pad_id)
        assert out.shape[1] - ids.shape[1] == n_tokens

    def ours():
        steps = list(generate_stream(model, ids, max_tokens=n_tokens, temperature=0.0, stop_at_eos=False))
        assert len(steps) == n_tokens

    def ours_steered():
        with steer(model, spec):
            ours()

    medians = interleaved_medians({"hf": hf_generate, "ours": ours, "steered": ours_steered}, repeats=repeats)
    tps = {k: n_tokens / v for k, v in medians.items()}
    print(f"\nqwen3 {variant}: {sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M params, "
          f"prompt {ids.shape[1]} tokens, {n_tokens} greedy tokens")
    print(f"  HF generate()                 {tps['hf']:9.1f} tok/s")
    print(f"  generate_stream               {tps['ours']:9.1f} tok/s   ratio vs HF {tps['ours'] / tps['hf']:.3f}   target >= 0.9")
    print(f"  generate_stream, steered      {tps['steered']:9.1f} tok/s   ratio vs unsteered "
          f"{tps['steered'] / tps['ours']:.3f}   target >= 0.95")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    bench("tiny", args.tokens, args.repeats)
    bench("bench", args.tokens, max(3, args.repeats // 3))


if __name__ == "__main__":
    main()
