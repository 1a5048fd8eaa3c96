"""The peers' side, run with benchmarks/peers/.venv/bin/python (TransformerLens and nnsight live
there, never in the project's environment): the same workloads as ours.py on the same model
directories. Usage: peers.py '{"tiny": PATH, "bench": PATH}' REPEATS. Each peer is timed interleaved with
plain HF in this process (its floor). Prints one JSON line of [workload, tool, median seconds]
rows; a peer that fails gets no row and a note on stderr."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import CAPTURE_SHAPES, GEN_TOKENS, PROMPT, STEER_LAYER, STEER_SCALE, medians  # noqa: E402


def _ids(d_vocab: int, batch: int, pos: int) -> torch.Tensor:
    return torch.randint(2, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(0))


def _vector(d_model: int) -> torch.Tensor:
    v = torch.randn(d_model, generator=torch.Generator().manual_seed(1))
    return v / v.norm()


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _plain_forward(hf, ids):
    def run():
        with torch.no_grad():
            hf(input_ids=ids, use_cache=False)
    return run


def _plain_generate(hf, tokens):
    def run():
        with torch.no_grad():
            hf.generate(tokens, max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS, do_sample=False)
    return run


def _plain_steered(hf, tokens, vector):
    def add(module, args, out):
        if isinstance(out, tuple):
            return (out[0] + STEER_SCALE * vector,) + out[1:]
        return out + STEER_SCALE * vector

    def run():
        handle = hf.model.layers[STEER_LAYER].register_forward_hook(add)
        try:
            _plain_generate(hf, tokens)()
        finally:
            handle.remove()
    return run


PLAIN = "plain HF (peers' venv)"


def transformer_lens(paths: dict, repeats: int) -> list:
    from transformer_lens.model_bridge import TransformerBridge

    rows = []
    for variant, batch, pos in CAPTURE_SHAPES:
        bridge = TransformerBridge.boot_transformers(paths[variant], device="cpu")
        n = bridge.cfg.n_layers
        ids = _ids(bridge.cfg.d_vocab, batch, pos)
        keep = lambda name: name.endswith("hook_resid_post")  # noqa: E731

        def capture():
            with torch.no_grad():
                bridge.run_with_cache(ids, names_filter=keep)

        m = medians({PLAIN: _plain_forward(_hf(paths[variant]), ids),
                     "TransformerLens run_with_cache": capture}, repeats)
        rows += [(f"capture resid_post x{n}, {variant} {batch}x{pos}", k, v) for k, v in m.items()]
    bridge = TransformerBridge.boot_transformers(paths["tiny"], device="cpu")
    tokens = bridge.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    vector = _vector(bridge.cfg.d_model)

    def gen():
        with torch.no_grad():
            bridge.generate(tokens, max_new_tokens=GEN_TOKENS, do_sample=False, stop_at_eos=False, verbose=False)

    def steered():
        hook = (f"blocks.{STEER_LAYER}.hook_resid_post", lambda x, hook: x + STEER_SCALE * vector)
        with bridge.hooks(fwd_hooks=[hook]):
            gen()

    reps = max(3, repeats // 4)
    hf = _hf(paths["tiny"])
    rows += [(f"generate {GEN_TOKENS} tokens, tiny", k, v)
             for k, v in medians({PLAIN: _plain_generate(hf, tokens), "TransformerLens generate": gen}, reps).items()]
    rows += [(f"steered generate {GEN_TOKENS} tokens, tiny", k, v)
             for k, v in medians({PLAIN: _plain_steered(hf, tokens, vector),
                                  "TransformerLens hooks + generate": steered}, reps).items()]
    return rows


def nnsight_rows(paths: dict, repeats: int) -> list:
    import warnings

    import nnsight
    from nnsight import LanguageModel

    warnings.simplefilter("ignore")
    rows = []
    for variant, batch, pos in CAPTURE_SHAPES:
        model = LanguageModel(paths[variant], device_map="cpu", dispatch=True)
        layers = model.model.layers
        n = len(layers)
        ids = _ids(model.config.vocab_size, batch, pos)

        def capture():
            with model.trace(ids):
                saved = nnsight.save([layers[i].output for i in range(n)])
            return saved

        m = medians({PLAIN: _plain_forward(_hf(paths[variant]), ids), "nnsight trace + save": capture}, repeats)
        rows += [(f"capture resid_post x{n}, {variant} {batch}x{pos}", k, v) for k, v in m.items()]
    model = LanguageModel(paths["tiny"], device_map="cpu", dispatch=True)
    tokens = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    vector = _vector(model.config.hidden_size)
    kwargs = dict(max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS, do_sample=False)

    def gen():
        with model.generate(tokens, **kwargs) as tracer:
            out = tracer.result.save()
        return out

    def steered():
        with model.generate(tokens, **kwargs) as tracer:
            for _ in tracer.iter[:GEN_TOKENS]:
                model.model.layers[STEER_LAYER].output[:] += STEER_SCALE * vector
            out = tracer.result.save()
        return out

    reps = max(3, repeats // 4)
    hf = _hf(paths["tiny"])
    rows += [(f"generate {GEN_TOKENS} tokens, tiny", k, v)
             for k, v in medians({PLAIN: _plain_generate(hf, tokens), "nnsight generate": gen}, reps).items()]
    rows += [(f"steered generate {GEN_TOKENS} tokens, tiny", k, v)
             for k, v in medians({PLAIN: _plain_steered(hf, tokens, vector),
                                  "nnsight generate + iter edit": steered}, reps).items()]
    return rows


def main() -> None:
    paths, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    rows = []
    for peer in (transformer_lens, nnsight_rows):
        try:
            rows += peer(paths, repeats)
        except Exception:  # one peer failing (an API change) must not hide the other's numbers
            print(f"{peer.__name__} failed:\n{traceback.format_exc()}", file=sys.stderr)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
