"""``interp-engine``: the command line. ``interp-engine demo`` runs the tour on a tiny model."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import torch

    from . import (CAPABILITIES, Address, CapabilityUnsupported, SteerSpec, generate_stream,
                   load_model, run_with_cache, steer)
    from .testing import tiny_model

    path = tiny_model(args.arch)
    print(f"== interp_engine demo: tiny {args.arch} ({path})")
    model = load_model(path, backend=args.backend)
    print(f"   {model}")
    prompt = "The capital of France is"
    tokens = model.to_tokens(prompt)
    print(f"   prompt {prompt!r} -> {tokens.shape[1]} tokens")

    print("\n== capture: resid_post at every layer")
    points = [Address("resid_post", layer) for layer in range(model.n_layers)]
    cache = run_with_cache(model, tokens, points)
    for address in points:
        t = cache[address]
        norms = t.norm(dim=-1)[0]
        print(f"   {str(address):<14} shape {tuple(t.shape)}  norm mean {norms.mean():8.3f}  "
              f"last {norms[-1]:8.3f}")

    print("\n== capabilities (answered before any forward)")
    print(f"   hooks_available={model.hooks_available} graph_replay={model.graph_replay} "
          f"n_layers={model.n_layers} d_model={model.d_model}")
    print(f"   static_points={model.static_points} static_writes={model.static_writes}")
    print(f"   residual_basis: {model.residual_basis.describe()}")
    print(f"   grad_support: {model.grad_support.describe()}")
    print("   points on this model: " + ", ".join(
        f"{p.name}{'' if p.vllm else '*'}" for p in model.points()) + "   (* eager-only)")
    for name, capability in CAPABILITIES.items():
        print(f"   {name:<26} served by {sorted(capability.backends) or 'none'}")

    print("\n== greedy generation with logprobs")
    steps = list(generate_stream(model, tokens, max_tokens=8, temperature=0.0, n_logprobs=3))
    print(f"   tokens {[s.token_id for s in steps]}")
    print(f"   text   {''.join(s.token_str for s in steps)!r}")
    print(f"   first step top-3 {[(d['token_id'], round(d['logprob'], 3)) for d in steps[0].logprobs]}")

    layer = model.n_layers // 2
    direction = cache.get("resid_post", layer)[0, -1]
    spec = SteerSpec.add(f"resid_post.{layer}", direction / direction.norm(), scale=8.0)
    with steer(model, spec):
        steered = list(generate_stream(model, tokens, max_tokens=8, temperature=0.0))
    print(f"\n== steered (+8 * unit resid_post.{layer} direction)")
    print(f"   tokens {[s.token_id for s in steered]}")
    same = sum(a.token_id == b.token_id for a, b in zip(steps, steered))
    print(f"   {same} of {min(len(steps), len(steered))} aligned tokens unchanged")

    print("\n== logit lens: top token at the last position, per layer")
    try:
        ids, logprobs = model.decode_residuals(cache, top_k=1)
        for address, tid, lp in zip(points, ids[:, 0, -1, 0], logprobs[:, 0, -1, 0]):
            print(f"   {str(address):<14} {int(tid):>5} {model.to_string([int(tid)])!r:<12} logprob {float(lp):.3f}")
    except CapabilityUnsupported as exc:
        print(f"   refused: {exc}")

    print("\n== a refusal, by name: the logit lens on DeepSeek-V4's four residual streams")
    other = load_model(tiny_model("deepseek_v4"))
    other_cache = run_with_cache(other, other.to_tokens(prompt), ["resid_post.0"])
    try:
        other.decode_residuals(other_cache)
    except CapabilityUnsupported as exc:
        print(f"   CapabilityUnsupported: {exc}")
    if args.compare_vllm:
        _compare(path, tokens, points, steps)
    del torch
    return 0


def _compare(path, tokens, points, eager_steps) -> None:
    """The same pipeline inside vLLM: captured values and greedy tokens against eager."""
    import importlib.util

    from . import generate_stream, load_model, run_with_cache

    print("\n== the same numbers inside vLLM")
    if importlib.util.find_spec("vllm") is None:
        print("   vllm is not installed here (INTERP_ENGINE_SKIP_VLLM=1 set-up)")
        return
    eager = load_model(path)
    vllm = load_model(path, backend="vllm")
    ce, cv = run_with_cache(eager, tokens, points), run_with_cache(vllm, tokens, points)
    for address in points:
        diff = float((ce[address] - cv[address]).abs().max())
        print(f"   {str(address):<14} max |eager - vllm| {diff:.2e}   (scale {float(ce[address].abs().max()):.1f})")
    vsteps = list(generate_stream(vllm, tokens, max_tokens=len(eager_steps), temperature=0.0, n_logprobs=3))
    same = [s.token_id for s in vsteps] == [s.token_id for s in eager_steps]
    worst = max(abs(a.logprobs[0]["logprob"] - b.logprobs[0]["logprob"]) for a, b in zip(eager_steps, vsteps))
    print(f"   greedy tokens equal: {same}; worst top-1 logprob difference {worst:.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="interp-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="capture, capabilities, generation, steering and lens on a tiny model")
    demo.add_argument("--arch", default="qwen3", help="tiny architecture (qwen3, llama, gemma2, qwen3_moe, deepseek_v4)")
    demo.add_argument("--backend", default="eager", choices=("eager", "vllm"))
    demo.add_argument("--compare-vllm", action="store_true",
                      help="also run capture and greedy generation inside vLLM and print the differences")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the demo's own output, not vLLM's start-up log
    if args.command == "demo":
        return _demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
