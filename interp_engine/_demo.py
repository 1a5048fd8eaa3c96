"""The tour, on a tiny Qwen3 trained on first use (about a minute, then cached) on short facts:
greedy completion with its probabilities, the logit lens showing the answer form across the
layers, a steering vector built from two contrasting prompt sets moving the answer, and the
pictures (lens heatmap, attention grid) written to --out."""

from __future__ import annotations

import argparse
import pathlib

import torch

from ._cli_common import UsageError, add_model_arguments, load

__all__ = ["add_arguments", "run"]

PROMPT = "The capital of France is"
ANSWER, STEERED_ANSWER = " Paris", " Berlin"
TEMPLATES = ("The capital of {} is", "I flew to {} and landed in", "People in {} visit")
POSITIVE = tuple(t.format("Germany") for t in TEMPLATES)
NEGATIVE = tuple(t.format("France") for t in TEMPLATES)
LATE_PROMPT, LATE_ANSWER = "The opposite of hot is", " cold"
MORE = ("The opposite of hot is", "The capital of Japan is", "Counting: three four five")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--out", default="interp-engine-demo",
                        help="folder for the pictures (default ./interp-engine-demo)")
    parser.add_argument("--compare-vllm", action="store_true",
                        help="also run capture and greedy generation inside vLLM and print the differences")


def _final_probs(model, tokens, ids: list[int]) -> list[float]:
    """The model's output probabilities of ``ids`` at the last position, on any backend
    (the last layer's residual decoded: final norm and unembedding, as the model does)."""
    from ._api import run_with_cache

    last = f"resid_post.{model.n_layers - 1}"
    logprobs = model.decode_residuals(run_with_cache(model, tokens, [last]))[0, 0, -1]
    return [float(logprobs[i].exp()) for i in ids]


def _token_id(model, text: str) -> int:
    """The first token of ``text`` on its own (no BOS: llama and gemma2 prepend one)."""
    return model.tok.hf(text, add_special_tokens=False)["input_ids"][0]


def run(args: argparse.Namespace) -> int:
    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    model = load(args)
    try:
        return _tour(model, args, out)
    finally:
        model.close()


def _tour(model, args: argparse.Namespace, out: pathlib.Path) -> int:
    from ._api import generate_stream, steer
    from ._cli_generate import mean_difference
    from ._cli_lens import lens
    from ._plan import SteerSpec

    print(f"== interp_engine demo on {args.backend}: {model.graph.describe()}")
    print(f"   weights: {model.path}")
    tokens = model.to_tokens(PROMPT)
    answer, other = _token_id(model, ANSWER), _token_id(model, STEERED_ANSWER)

    print("\n== 1. greedy completion, with the top-3 probabilities of the first token")
    for prompt in (PROMPT,) + MORE:
        steps = list(generate_stream(model, model.to_tokens(prompt), max_tokens=4, temperature=0.0,
                                     n_logprobs=3))
        top = ", ".join(f"{model.to_string([d['token_id']])!r} {torch.tensor(d['logprob']).exp():.3f}"
                        for d in steps[0].logprobs)
        print(f"   {prompt!r:<30} -> {''.join(s.token_str for s in steps)!r:<14} [{top}]")

    print(f"\n== 2. logit lens at the last position of {PROMPT!r}: each layer's residual stream "
          "decoded\n   through the final norm and unembedding")
    seen = lens(model, PROMPT)
    last = len(seen.inputs) - 1
    for r, name in enumerate(seen.rows):
        lp = seen.logprobs[r, last]
        rank = int((lp > lp[answer]).sum()) + 1
        print(f"   {name:<8} top {seen.top_tokens[r][last]!r:<11} p={float(seen.top_probs[r, last]):.3f}"
              f"   p({ANSWER!r})={float(lp[answer].exp()):.3f} rank {rank}")
    from ._plots import attention_png, lens_png

    lens_file = lens_png(out / "lens.png", seen.top_probs, seen.top_tokens, seen.rows, seen.inputs,
                         f"logit lens: {PROMPT!r}")
    slower = lens(model, LATE_PROMPT)
    late = _token_id(model, LATE_ANSWER)
    print(f"   the same for {LATE_PROMPT!r}, where the answer forms later: p({LATE_ANSWER!r}) by layer "
          + "  ".join(f"{float(slower.logprobs[r, -1, late].exp()):.3f}" for r in range(len(slower.rows))))

    layer = model.n_layers // 2
    at = f"resid_post.{layer}"
    print(f"\n== 3. steering: the mean {at} (last position) of {len(POSITIVE)} prompts about "
          f"Germany\n   minus that of {len(NEGATIVE)} about France, added at every position")
    vector = mean_difference(model, list(POSITIVE), list(NEGATIVE), at)
    spec = SteerSpec.add(at, vector, scale=1.0)
    before = _final_probs(model, tokens, [answer, other])
    with steer(model, spec):
        after = _final_probs(model, tokens, [answer, other])
        steered = list(generate_stream(model, tokens, max_tokens=4, temperature=0.0))
    plain = list(generate_stream(model, tokens, max_tokens=4, temperature=0.0))
    print(f"   vector norm {float(vector.norm()):.2f}")
    print(f"   p({ANSWER!r}) {before[0]:.3f} -> {after[0]:.3f}    p({STEERED_ANSWER!r}) {before[1]:.3f} -> {after[1]:.3f}")
    print(f"   greedy: {''.join(s.token_str for s in plain)!r} -> steered {''.join(s.token_str for s in steered)!r}")

    print("\n== 4. attention patterns, layer 0")
    viewer = model
    if not any(p.name == "pattern" and p.served_by(model.backend_name) for p in model.points()):
        from ._model import load_model

        print(f"   {model.backend_name} does not serve the pattern (capability 'attention_pattern'); "
              "drawn from the same weights on eager")
        viewer = load_model(model.path)
    elif args.backend != "eager":
        print("   vLLM's kernels never form attention probabilities: its worker rebuilds them from "
              "the queries and keys each attention kernel receives")
    from ._cli_attention import pattern

    probs, labels = pattern(viewer, PROMPT, 0)
    attention_file = attention_png(out / "attention.png", probs, labels,
                                   f"attention at layer 0: {PROMPT!r}")
    print(f"\n== pictures: {lens_file} (logit lens), {attention_file} (attention, layer 0)")
    print("   more: interp-engine lens --prompt TEXT --png FILE | attention | generate --steer-from POS NEG"
          " | points   (--help on each)")
    if args.compare_vllm:
        _compare(model.path, tokens)
    return 0


def _compare(path, tokens) -> None:
    """The same captures and greedy tokens inside vLLM, against eager (interp_engine.compare)."""
    import importlib.util

    from ._compare_cli import print_backend_comparison
    from ._model import load_model

    print("\n== the same numbers inside vLLM")
    if importlib.util.find_spec("vllm") is None:
        print("   vllm is not installed here (INTERP_ENGINE_SKIP_VLLM=1 set-up)")
        return
    n_layers = load_model(path).n_layers
    print_backend_comparison(path, tokens, [f"resid_post.{layer}" for layer in range(n_layers)], 8)
