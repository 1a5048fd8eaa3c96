"""Harvest throughput, in one run, as ratios against plain engines on the same windows.

The same prompt set is cut into ``--context`` windows; every layer's resid_post is harvested:

- vLLM (multiprocess, vLLM's default shape): ``harvest`` on the hook-based backend against
  plain eager vLLM prefilling the same windows (``LLM.generate``, one token each), and
  ``harvest`` on vllm-static (every resid_post declared) against plain compiled vLLM;
- eager: ``harvest`` against batched ``run_with_cache`` of the same windows (no disk).

Targets (issue 16): hook-based vLLM >= 0.7x plain eager vLLM prefill throughput; vllm-static
>= 0.8x plain compiled vLLM. Ratios here are throughput ratios (higher is better).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_harvest.py [--arch qwen3] [--variant tiny]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch

from _timing import interleaved_medians
from bench_vllm import _plain_engine  # the same plain engines as the runtime benchmark

TARGETS = {"harvest, vLLM (hooks)": ("plain eager vLLM prefill", 0.7),
           "harvest, vllm-static": ("plain compiled vLLM prefill", 0.8)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from interp_engine import harvest, load_model, run_with_cache
    from interp_engine._harvest import _Prompts, _Windows, _tokenizer
    from interp_engine.testing import tiny_model

    path = tiny_model(args.arch, args.variant)
    prompts = [f"Record {i}: the capital of France is Paris, the opposite of hot is cold, and "
               f"after {i} comes {i + 1}." for i in range(args.prompts)]
    eager = load_model(path)
    points = [f"resid_post.{layer}" for layer in range(eager.n_layers)]
    windows = list(_Windows(_tokenizer(eager.tok.hf), _Prompts(prompts), args.context))
    tokens = len(windows) * args.context

    def harvesting(model):
        def run():
            out = tempfile.mkdtemp(prefix="bench-harvest-")
            try:
                harvest(model, prompts, points, out, context_size=args.context, batch_size=16,
                        max_in_flight=128, progress=False)
            finally:
                shutil.rmtree(out)
        return run

    def eager_cache():
        ids = torch.tensor(windows)
        for start in range(0, len(windows), 16):
            run_with_cache(eager, ids[start:start + 16], points)

    fns = {"eager batched run_with_cache": eager_cache, "harvest, eager": harvesting(eager)}
    closers = []
    if not args.skip_vllm:
        from vllm import SamplingParams

        vmodel = load_model(path, backend="vllm")
        smodel = load_model(path, backend="vllm-static", static_points=points)
        vmodel.warmup(), smodel.warmup()
        plain_eager = _plain_engine(path, vmodel.max_model_len, compiled=False)
        plain_compiled = _plain_engine(path, vmodel.max_model_len, compiled=True)
        one = SamplingParams(max_tokens=1, temperature=0.0)
        requests = [{"prompt_token_ids": w} for w in windows]

        def plain(llm):
            return lambda: llm.generate(requests, one, use_tqdm=False)

        fns.update({"plain eager vLLM prefill": plain(plain_eager),
                    "harvest, vLLM (hooks)": harvesting(vmodel),
                    "plain compiled vLLM prefill": plain(plain_compiled),
                    "harvest, vllm-static": harvesting(smodel)})
        closers = [vmodel.close, smodel.close]
    medians = interleaved_medians(fns, repeats=args.repeats, warmup=1)
    for close in closers:
        close()

    print(f"\nharvest throughput, {args.arch} {args.variant}: {len(windows)} windows x {args.context} "
          f"positions, every layer's resid_post ({len(points)} points); medians of {args.repeats} rounds")
    baselines = {"harvest, eager": "eager batched run_with_cache"} | {k: v[0] for k, v in TARGETS.items()}
    for name, seconds in medians.items():
        line = f"  {name:<32} {seconds:8.2f} s {tokens / seconds:10.0f} tokens/s"
        if name in baselines and baselines[name] in medians:
            ratio = medians[baselines[name]] / seconds
            target = f" (target >= {TARGETS[name][1]:.2f})" if name in TARGETS else ""
            line += f"   {ratio:5.2f}x of {baselines[name]}{target}"
        print(line)


if __name__ == "__main__":
    main()
