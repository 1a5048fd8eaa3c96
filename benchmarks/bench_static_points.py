"""What a vllm-static capture costs per declared point it reads: one engine loaded with
``static_points="auto"`` (resid_post, attn_out and mlp_out at every layer), one prompt captured
at 1, a quarter, half and all of those points (``capture_generation``, prefill only), against
the same engine driven by plain ``llm.generate`` and by interp_engine with no plan, in one run,
interleaved. It ends with the cost of one more point (the least-squares slope of the medians
over the number of points), in microseconds a request.

The issue-11 targets are judged in ``bench_static.py`` (resid_post at every layer); this one
shows how the cost grows with the declared set. It should grow linearly: a check per address
that scanned the declared tuple made it quadratic (on 108 points, the client's two checks per
request took 1.3 ms in a tight loop).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_static_points.py [--variant bench|tiny]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from _timing import LAST_REPEATS, interleaved_samples, medians, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--variant", default="bench",
                        help="the arch's recipe: bench (8 layers, d_model 512: 24 points) or tiny (3 layers: 9)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=20.0, help="seconds of rounds, at least (up to 200)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(1)

    from vllm import SamplingParams

    from interp_engine import capture_generation, generate_stream, load_model
    from interp_engine.testing import tiny_model

    model = load_model(tiny_model(args.arch, args.variant), backend="vllm-static", static_points="auto")
    model.warmup()
    points = list(model.static_points)
    llm = model.backend._llm
    ids = model.to_tokens("The capital of France is a city where")[0].tolist()
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    counts = sorted({1, max(1, len(points) // 4), max(1, len(points) // 2), len(points)})
    own, none = "vllm-static engine, llm.generate", "vllm-static, no plan (interp_engine)"
    fns = {
        own: lambda: llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False),
        none: lambda: list(generate_stream(model, ids, max_tokens=1, temperature=0.0, stop_at_eos=False)),
    }
    for n in counts:
        fns[f"capture {n} of {len(points)} points"] = (
            lambda p: lambda: capture_generation(model, ids, p, max_tokens=1, temperature=0.0,
                                                 stop_at_eos=False))(points[:n])
    samples = interleaved_samples(fns, repeats=args.repeats, warmup=3, min_seconds=args.min_seconds)
    mid = medians(samples)
    report(f"{args.arch} {args.variant}: {model.n_layers} layers, d_model {model.d_model}, {len(ids)}-token prompt, "
           f"prefill only, one request; medians of {LAST_REPEATS[0]} rounds", mid, own, samples=samples)
    xs = counts
    ys = [mid[f"capture {n} of {len(points)} points"] for n in counts]
    slope = statistics.linear_regression(xs, ys).slope if len(xs) > 1 else float("nan")
    print(f"  one more point read: {slope * 1e6:+.0f} us a request "
          f"(slope over {len(xs)} sizes); the capture of one point: "
          f"{(ys[0] - mid[none]) * 1e6:+.0f} us over no plan")
    model.close()


if __name__ == "__main__":
    main()
