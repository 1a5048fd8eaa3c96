"""interp_engine against plain HF transformers and plain vLLM, and (through peers.py, run in
benchmarks/peers/.venv) against TransformerLens and nnsight, on the same tiny models, prompts
and workloads, in one sitting. Prints medians and each row's ratio to its floor (plain HF for
eager work, plain vLLM for vLLM work). Run through ./benchmarks/peers/run.sh."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workloads import CAPTURE_SHAPES, GEN_TOKENS, PROMPT, STEER_LAYER, STEER_SCALE, medians  # noqa: E402

from interp_engine import SteerSpec, generate_stream, load_model, run_with_cache, steer  # noqa: E402
from interp_engine.testing import tiny_model  # noqa: E402


def _ids(d_vocab: int, batch: int, pos: int) -> torch.Tensor:
    return torch.randint(2, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(0))


def _vector(d_model: int) -> torch.Tensor:
    v = torch.randn(d_model, generator=torch.Generator().manual_seed(1))
    return v / v.norm()


def eager(repeats: int) -> list[tuple[str, str, float]]:
    rows = []
    for variant, batch, pos in CAPTURE_SHAPES:
        model = load_model(tiny_model("qwen3", variant))
        hf, ids = model.hf, _ids(model.d_vocab, batch, pos)
        points = [f"resid_post.{layer}" for layer in range(model.n_layers)]

        def plain():
            with torch.no_grad():
                hf(input_ids=ids, use_cache=False)

        def hidden():
            with torch.no_grad():
                hf(input_ids=ids, use_cache=False, output_hidden_states=True)

        m = medians({"plain HF forward": plain, "HF output_hidden_states": hidden,
                     "interp_engine run_with_cache": lambda: run_with_cache(model, ids, points)}, repeats)
        rows += [(f"capture resid_post x{model.n_layers}, {variant} {batch}x{pos}", k, v) for k, v in m.items()]

    model = load_model(tiny_model("qwen3"))
    hf, tokens = model.hf, model.to_tokens(PROMPT)
    vector = _vector(model.d_model)
    spec = SteerSpec.add(f"resid_post.{STEER_LAYER}", vector, scale=STEER_SCALE)

    def hf_generate():
        with torch.no_grad():
            hf.generate(tokens, max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS, do_sample=False)

    def hf_steered():
        def add(module, args, out):
            if isinstance(out, tuple):
                return (out[0] + STEER_SCALE * vector,) + out[1:]
            return out + STEER_SCALE * vector
        handle = hf.model.layers[STEER_LAYER].register_forward_hook(add)
        try:
            hf_generate()
        finally:
            handle.remove()

    def ours():
        list(generate_stream(model, tokens, max_tokens=GEN_TOKENS, temperature=0.0, stop_at_eos=False))

    def ours_steered():
        with steer(model, spec):
            ours()

    m = medians({"plain HF generate": hf_generate, "interp_engine generate_stream": ours}, max(3, repeats // 4))
    rows += [(f"generate {GEN_TOKENS} tokens, tiny", k, v) for k, v in m.items()]
    m = medians({"plain HF generate + forward hook": hf_steered, "interp_engine steer + generate_stream": ours_steered},
                max(3, repeats // 4))
    rows += [(f"steered generate {GEN_TOKENS} tokens, tiny", k, v) for k, v in m.items()]
    return rows


def vllm_rows(repeats: int) -> list[tuple[str, str, float]]:
    from vllm import LLM, SamplingParams

    path = tiny_model("qwen3")
    ours = load_model(path, backend="vllm")
    tokens = ours.to_tokens(PROMPT)
    points = [f"resid_post.{layer}" for layer in range(ours.n_layers)]
    spec = SteerSpec.add(f"resid_post.{STEER_LAYER}", _vector(ours.d_model), scale=STEER_SCALE)
    ours.warmup()
    plain = LLM(model=str(path), dtype="float32", enforce_eager=True, enable_prefix_caching=False,
                max_model_len=512, kv_cache_memory_bytes=1 << 30)
    prompt = {"prompt_token_ids": tokens[0].tolist()}
    one = SamplingParams(max_tokens=1, temperature=0.0)
    full = SamplingParams(max_tokens=GEN_TOKENS, min_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)

    def gen():
        list(generate_stream(ours, tokens, max_tokens=GEN_TOKENS, temperature=0.0, stop_at_eos=False))

    def gen_steered():
        with steer(ours, spec):
            gen()

    m = medians({"plain vLLM prefill (1 token)": lambda: plain.generate(prompt, one, use_tqdm=False),
                 "interp_engine vLLM run_with_cache": lambda: run_with_cache(ours, tokens, points)}, repeats)
    rows = [(f"vLLM capture resid_post x{ours.n_layers}, tiny 1x{tokens.shape[1]}", k, v) for k, v in m.items()]
    m = medians({"plain vLLM generate": lambda: plain.generate(prompt, full, use_tqdm=False),
                 "interp_engine vLLM generate_stream": gen,
                 "interp_engine vLLM steered": gen_steered}, max(3, repeats // 4))
    rows += [(f"vLLM generate {GEN_TOKENS} tokens, tiny", k, v) for k, v in m.items()]
    ours.close()
    return rows


def peers(repeats: int) -> list[tuple[str, str, float]]:
    python = HERE / ".venv" / "bin" / "python"
    if not python.exists():
        print("(no benchmarks/peers/.venv: run ./benchmarks/peers/run.sh to set it up)")
        return []
    paths = {variant: str(tiny_model("qwen3", variant)) for variant in ("tiny", "bench")}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(python), str(HERE / "peers.py"), json.dumps(paths), str(repeats)],
                         env=env, check=True, capture_output=True, text=True)
    if " failed:" in out.stderr:  # a peer that broke says why, and gets no row
        sys.stderr.write(out.stderr[max(0, out.stderr.rfind("\n", 0, out.stderr.index(" failed:"))):])
    return [tuple(row) for row in json.loads(out.stdout.strip().splitlines()[-1])]


def table(rows: list[tuple[str, str, float]]) -> None:
    """One line per tool and workload; the ratio divides by the floor timed in the same
    process and the same interleaved rounds (the nearest 'plain' row above it)."""
    print("| workload | tool | median ms | ratio to plain |\n| --- | --- | ---: | ---: |")
    for work in dict.fromkeys(w for w, _, _ in rows):
        floor = None
        for w, name, value in rows:
            if w != work:
                continue
            if name.startswith("plain"):
                floor = value
            ratio = f"{value / floor:.2f}" if floor else "-"
            print(f"| {work} | {name} | {value * 1e3:.1f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-peers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    rows = eager(args.repeats)
    if not args.no_peers:
        rows += peers(args.repeats)
    if not args.no_vllm:
        rows += vllm_rows(args.repeats)
    table(rows)


if __name__ == "__main__":
    main()
