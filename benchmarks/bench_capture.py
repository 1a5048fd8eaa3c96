"""Capture overhead on eager: HF's default forward (its fast SDPA attention) against
run_with_cache of every layer's resid_post, in one run, as ratios. Targets: <= 1.10 at 1x16 on
the tiny model, <= 1.05 at 4x128 and 1x1024 on the ~25M-parameter one. The last line of each
block shows what reading ``pattern`` costs (it needs the eager attention kernel).

``--size full`` runs the realistic sizes instead: GPT-2 small (GPT2Config() defaults, 124M)
and Pythia-160M's shape, random weights built locally (the specs' ``full`` recipes), at 1x128
and 4x128 tokens; target <= 1.05.

    .venv/bin/python benchmarks/bench_capture.py [--size tiny|full] [--repeats N]
"""

from __future__ import annotations

import argparse

import torch

from _timing import interleaved_medians, report
from interp_engine import Address, load_model, run_with_cache
from interp_engine.testing import tiny_model


def bench(arch: str, variant: str, batch: int, pos: int, repeats: int, target: str) -> None:
    model = load_model(tiny_model(arch, variant))
    hf = model.hf
    n_params = sum(p.numel() for p in hf.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.d_vocab, (batch, pos), generator=g)
    points = [Address("resid_post", layer) for layer in range(model.n_layers)]

    def plain():
        with torch.no_grad():
            hf(input_ids=ids, use_cache=False)

    def plain_hidden():
        with torch.no_grad():
            hf(input_ids=ids, use_cache=False, logits_to_keep=1)

    def bare_hooks():
        store = []
        layer_tap = model.backend.spec.eager["resid_post"]  # the decoder layers, by the spec
        layers = [hf.get_submodule(layer_tap.module_path(L)) for L in range(model.n_layers)]
        handles = [layer.register_forward_hook(lambda mod, args, out: store.append(out))
                   for layer in layers]
        try:
            plain_hidden()
        finally:
            for handle in handles:
                handle.remove()

    pattern = [Address("pattern", model.n_layers - 1)]
    assert hf.config._attn_implementation == "sdpa", hf.config._attn_implementation
    medians = interleaved_medians({
        "HF forward (default: sdpa, all logits)": plain,
        "run_with_cache resid_post x all (default)": lambda: run_with_cache(model, ids, points),
        "run_with_cache resid_post x all, +logits": lambda: run_with_cache(model, ids, points, return_logits=True),
        "HF forward (last logits only)": plain_hidden,
        "bare forward hooks (the floor)": bare_hooks,
        "run_with_cache one pattern (eager kernel)": lambda: run_with_cache(model, ids, pattern),
    }, repeats=repeats)
    report(f"{arch} {variant}: {n_params / 1e6:.1f}M params, {model.n_layers} layers, {batch}x{pos} tokens",
           medians, "HF forward (default: sdpa, all logits)",
           {"run_with_cache resid_post x all (default)": target})
    same = medians["run_with_cache resid_post x all (default)"] / medians["HF forward (last logits only)"]
    floor = medians["bare forward hooks (the floor)"] / medians["HF forward (last logits only)"]
    print(f"  capture overhead at equal work (default vs last-logits forward): ratio {same:.3f}   target {target}")
    print(f"  bare forward hooks keeping the same tensors, same work:          ratio {floor:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny",
                        help="tiny: the tiny and ~25M Qwen3; full: GPT-2 small and Pythia-160M shapes")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.size == "full":
        for arch in ("gpt2", "gpt_neox"):
            bench(arch, "full", 1, 128, max(6, args.repeats // 20), "<= 1.05")
            bench(arch, "full", 4, 128, max(4, args.repeats // 40), "<= 1.05")
        return
    bench("qwen3", "tiny", 1, 16, args.repeats, "<= 1.10")
    bench("qwen3", "bench", 4, 128, max(10, args.repeats // 10), "<= 1.05")
    bench("qwen3", "bench", 1, 1024, max(6, args.repeats // 20), "<= 1.05")


if __name__ == "__main__":
    main()
