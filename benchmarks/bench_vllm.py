"""vLLM backend costs, in one run, as ratios against plain vLLM on the same engine:
capture_generation of every layer's resid_post (32 greedy tokens) against a plain
``llm.generate`` of the same request, and steered against unsteered generation for a batch of
16 concurrent requests (both through interp_engine, plus plain vLLM for reference).

    .venv/bin/python benchmarks/bench_vllm.py [--arch qwen3] [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import os

import torch

from _timing import interleaved_medians


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from vllm import SamplingParams

    from interp_engine import Address, SteerSpec, capture_generation, load_model
    from interp_engine.testing import tiny_model

    model = load_model(tiny_model(args.arch, args.variant), backend="vllm")
    model.warmup()
    llm = model.backend._llm
    ids = model.to_tokens("The capital of France is a city where")[0].tolist()
    n = args.tokens
    points = [Address("resid_post", layer) for layer in range(model.n_layers)]
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    def plain_one():
        out = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == n

    def capture_one():
        completion, cache = capture_generation(model, ids, points, max_tokens=n, temperature=0.0,
                                               stop_at_eos=False)
        assert cache[points[0]].shape[1] == len(ids) + n - 1

    medians = interleaved_medians({"plain": plain_one, "capture": capture_one}, repeats=args.repeats)
    print(f"\nvLLM {args.arch} {args.variant}: {model.n_layers} layers, prompt {len(ids)} tokens, {n} greedy tokens")
    print(f"  plain llm.generate                      {medians['plain'] * 1e3:9.1f} ms")
    print(f"  capture_generation resid_post x all     {medians['capture'] * 1e3:9.1f} ms   "
          f"ratio {medians['capture'] / medians['plain']:.3f}")

    v = torch.randn(model.d_model, generator=torch.Generator().manual_seed(0))
    spec = SteerSpec.add(f"resid_post.{model.n_layers // 2}", v / v.norm(), scale=2.0)
    prompts = [ids[: 4 + (i % 6)] for i in range(args.batch)]

    def batch(steer_spec):
        async def go():
            return await asyncio.gather(*[model.generate_text(p, max_tokens=n, temperature=0.0,
                                                              stop_at_eos=False, steer=steer_spec)
                                          for p in prompts])
        return lambda: asyncio.run(go())

    def plain_batch():
        llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)

    medians = interleaved_medians({"plain": plain_batch, "unsteered": batch(None), "steered": batch(spec)},
                                  repeats=args.repeats)
    print(f"\n  batch of {args.batch} concurrent requests, {n} greedy tokens each")
    print(f"  plain llm.generate (reference)          {medians['plain'] * 1e3:9.1f} ms")
    print(f"  interp_engine, unsteered                {medians['unsteered'] * 1e3:9.1f} ms   "
          f"ratio vs plain {medians['unsteered'] / medians['plain']:.3f}")
    print(f"  interp_engine, steered                  {medians['steered'] * 1e3:9.1f} ms   "
          f"ratio vs unsteered {medians['steered'] / medians['unsteered']:.3f}")


if __name__ == "__main__":
    main()
