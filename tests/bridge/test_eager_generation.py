"""Generation on the eager bridge: greedy decoding and logprobs against Hugging Face
``generate``, sampling controls, the KV cache, capture while generating, the async methods
(text deltas, the vLLM-shaped result, concurrent steered requests) and input checks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from interp_engine import (ShapeError, SteerSpec, capture_generation, decode_residuals, generate_stream,
                           run_with_cache, steer, top_logprobs)
from tests._reference import PROMPT, all_addresses, count_forwards, hook_count

TOL = dict(rtol=1e-5, atol=1e-5)


# Long enough that prompt + generation passes the sliding windows of the tiny Gemma 2 (32)
# and DeepSeek-V4 (16), so cached decoding through those layers is exercised too.
LONG_PROMPT = "The model reads a sequence of tokens and predicts the next one. Paris is the capital of"
N_NEW = 24


def _eos(model) -> set[int]:
    return set(model.backend.eos_ids)


def _hf_generate(model, ids, n, **kwargs):
    with torch.no_grad():
        return model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, **kwargs)


def _upto_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@pytest.fixture(scope="module")
def hf_greedy(eager_models):
    """arch -> (prompt ids, HF greedy new tokens up to and including EOS, HF raw logits)."""
    out = {}

    def get(arch):
        if arch not in out:
            model = eager_models[arch]
            ids = model.to_tokens(LONG_PROMPT)
            res = _hf_generate(model, ids, N_NEW, output_logits=True, return_dict_in_generate=True)
            new = _upto_eos(res.sequences[0, ids.shape[1]:].tolist(), _eos(model))
            logits = torch.stack([lg[0] for lg in res.logits[: len(new)]]).float()
            out[arch] = (ids, new, logits)
        return out[arch]

    return get


def test_greedy_equals_hf_generate(eager_model, arch, hf_greedy):
    ids, hf_new, _ = hf_greedy(arch)
    assert ids.shape[1] + N_NEW > 32  # past every sliding window
    steps = list(generate_stream(eager_model, ids, max_tokens=N_NEW, temperature=0.0))
    assert [s.token_id for s in steps] == hf_new
    assert len(set(hf_new)) > 1  # not a degenerate repeat (the comparison would be weak)


def test_logprobs_and_logits_equal_hf(eager_model, arch, hf_greedy):
    ids, hf_new, hf_logits = hf_greedy(arch)
    steps = list(generate_stream(eager_model, ids, max_tokens=N_NEW, temperature=0.0, n_logprobs=5))
    assert [s.token_id for s in steps] == hf_new
    ref = torch.log_softmax(hf_logits, dim=-1)
    for i, step in enumerate(steps):
        torch.testing.assert_close(step.logits, hf_logits[i], **TOL)
        assert len(step.logprobs) == 5
        values = torch.tensor([e["logprob"] for e in step.logprobs])
        top = torch.topk(ref[i], 5)
        assert [e["token_id"] for e in step.logprobs] == top.indices.tolist()
        torch.testing.assert_close(values, top.values, **TOL)
        assert step.logprobs[0]["token_id"] == step.token_id  # greedy picks the best
        torch.testing.assert_close(torch.tensor(step.logprob), ref[i, step.token_id], **TOL)
    plain = list(generate_stream(eager_model, ids, max_tokens=3, temperature=0.0))
    assert all(s.logprobs is None and s.logprob is None for s in plain)


def test_logprobs_match_a_manual_forward(eager_models):
    """Logprobs of sampled tokens equal a single full forward over prompt + generated."""
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    steps = list(generate_stream(model, ids, max_tokens=8, temperature=1.0, seed=3, n_logprobs=2))
    full = torch.tensor([ids[0].tolist() + [s.token_id for s in steps]])
    with torch.no_grad():
        logits = model.hf(full).logits[0, ids.shape[1] - 1: -1].float()
    lp = torch.log_softmax(logits, dim=-1)
    for i, s in enumerate(steps):
        torch.testing.assert_close(torch.tensor(s.logprob), lp[i, s.token_id], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(torch.tensor([e["logprob"] for e in s.logprobs]),
                                   torch.topk(lp[i], 2).values, rtol=1e-5, atol=1e-4)


def test_top_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(50)
    out = top_logprobs(logits, 4)
    ref = torch.topk(torch.log_softmax(logits, -1), 4)
    assert [e["token_id"] for e in out] == ref.indices.tolist()
    torch.testing.assert_close(torch.tensor([e["logprob"] for e in out]), ref.values)
    assert top_logprobs(logits, 0) == []
    assert len(top_logprobs(logits, 50)) == 50
    for bad in (-1, 51):
        with pytest.raises(ValueError, match=r"k must be an int in \[0, 50\]"):
            top_logprobs(logits, bad)
    # Wrong types and shapes: the library's own errors, naming the parameter and the shape.
    with pytest.raises(ValueError, match="k must be an int"):
        top_logprobs(logits, 1.5)
    with pytest.raises(ShapeError, match=r"logits is a tensor of shape \[5, 10\].*\[d_vocab\]"):
        top_logprobs(logits.reshape(5, 10), 2)


# ---- sampling controls -------------------------------------------------------------------

def _ids(model, **kwargs):
    return [s.token_id for s in generate_stream(model, model.to_tokens(PROMPT), **kwargs)]


def test_seeded_sampling_repeats_and_seeds_differ(eager_models):
    model = eager_models["llama"]
    a = _ids(model, max_tokens=16, temperature=1.0, seed=1, stop_at_eos=False)
    b = _ids(model, max_tokens=16, temperature=1.0, seed=1, stop_at_eos=False)
    c = _ids(model, max_tokens=16, temperature=1.0, seed=2, stop_at_eos=False)
    assert a == b and a != c
    greedy = _ids(model, max_tokens=16, temperature=0.0, stop_at_eos=False)
    assert a != greedy  # temperature 1 really samples
    assert _ids(model, max_tokens=16, temperature=0.7, top_p=0.9, seed=5, stop_at_eos=False) == \
        _ids(model, max_tokens=16, temperature=0.7, top_p=0.9, seed=5, stop_at_eos=False)


def test_top_k_1_and_tiny_top_p_are_greedy(eager_models):
    model = eager_models["qwen3"]
    greedy = _ids(model, max_tokens=12, temperature=0.0)
    assert _ids(model, max_tokens=12, temperature=1.5, top_k=1, seed=0) == greedy
    assert _ids(model, max_tokens=12, temperature=1.5, top_k=1, seed=9) == greedy
    assert _ids(model, max_tokens=12, temperature=1.0, top_p=1e-6, seed=4) == greedy


def test_top_k_restricts_to_the_top_tokens(eager_models):
    model = eager_models["gemma2"]
    steps = list(generate_stream(model, model.to_tokens(PROMPT), max_tokens=12, temperature=2.0,
                                 top_k=3, seed=0, n_logprobs=3))
    for s in steps:
        assert s.token_id in [e["token_id"] for e in s.logprobs]


def test_unseeded_sampling_leaves_the_global_rng_alone(eager_models):
    model = eager_models["qwen3"]
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    _ids(model, max_tokens=3, temperature=1.0)
    assert torch.equal(torch.rand(4), expected)


def test_eos_stops_and_is_reported(eager_models):
    """Force the third token to be EOS (a per-position ``set`` of the last residual to the
    EOS unembedding row): generation stops there, EOS is the last id, the text omits it."""
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    eos = model.tok.eos_id
    last = model.n_layers - 1
    row = _forcing_rows(model, [eos])
    spec = SteerSpec.set(f"resid_post.{last}", row, positions=[ids.shape[1] + 1])
    with steer(model, spec):
        steps = list(generate_stream(model, ids, max_tokens=10, temperature=0.0))
        comp, cache = capture_generation(model, ids, [f"resid_post.{last}"], max_tokens=10,
                                         temperature=0.0)
        longer = list(generate_stream(model, ids, max_tokens=10, temperature=0.0, stop_at_eos=False))
    assert [s.token_id for s in steps][-1] == eos and len(steps) == 3
    assert comp.finish_reason == "stop" and comp.token_ids == tuple(s.token_id for s in steps)
    assert cache[f"resid_post.{last}"].shape[1] == ids.shape[1] + 2
    assert comp.text == model.to_string(comp.token_ids[:-1])
    assert len(longer) == 10 and longer[2].token_id == eos
    plain = capture_generation(model, ids, ["resid_post.0"], max_tokens=4, temperature=0.0)[0]
    assert plain.finish_reason == "length" and len(plain.token_ids) == 4


# ---- KV cache ----------------------------------------------------------------------------

def test_decode_steps_feed_one_token(eager_model):
    model = eager_model
    ids = model.to_tokens(PROMPT)
    with count_forwards(model.hf) as calls:
        steps = list(generate_stream(model, ids, max_tokens=6, temperature=0.0, stop_at_eos=False))
    assert len(steps) == 6
    assert calls == [ids.shape[1]] + [1] * 5


# ---- capture while generating --------------------------------------------------------------

def test_capture_generation_equals_run_with_cache(eager_model):
    model = eager_model
    ids = model.to_tokens(LONG_PROMPT)
    points = all_addresses(model)
    comp, cache = capture_generation(model, ids, points, max_tokens=10, temperature=0.0,
                                     stop_at_eos=False)
    assert len(comp.token_ids) == 10 and comp.finish_reason == "length"
    greedy = [s.token_id for s in generate_stream(model, ids, max_tokens=10, temperature=0.0,
                                                  stop_at_eos=False)]
    assert list(comp.token_ids) == greedy
    assert comp.text == "".join(s.token_str for s in generate_stream(
        model, ids, max_tokens=10, temperature=0.0, stop_at_eos=False))
    rows = ids.shape[1] + len(comp.token_ids) - 1
    full = torch.tensor([ids[0].tolist() + list(comp.token_ids[:-1])])
    ref = run_with_cache(model, full, points)
    assert set(cache) == set(ref)
    for a in points:
        got = cache[a]
        dim = 2 if a.name == "pattern" else 1
        assert got.shape[dim] == rows, a
        torch.testing.assert_close(got, ref[a], rtol=1e-5, atol=1e-4,
                                   msg=lambda m, a=a: f"{a}: {m}")
    assert cache.lengths == [rows]


def test_capture_generation_logprobs(eager_models):
    model = eager_models["llama"]
    comp, _ = capture_generation(model, model.to_tokens(PROMPT), ["z.0"], max_tokens=4,
                                 temperature=0.0, n_logprobs=2)
    assert len(comp.logprobs) == 4 and all(len(e) == 2 for e in comp.logprobs)
    assert [e[0]["token_id"] for e in comp.logprobs] == list(comp.token_ids)


# ---- async methods -----------------------------------------------------------------------

def _stream_text(model, ids, **kwargs) -> str:
    async def go():
        return [d async for d in model.generate_stream(ids, **kwargs)]
    return asyncio.run(go())


def test_async_text_and_deltas(eager_model):
    model = eager_model
    ids = model.to_tokens(PROMPT)
    steps = list(generate_stream(model, ids, max_tokens=12, temperature=0.0))
    joined = "".join(s.token_str for s in steps)
    assert joined == model.to_string([s.token_id for s in steps])
    text = asyncio.run(model.generate_text(ids, max_tokens=12, temperature=0.0))
    assert text == joined
    deltas = _stream_text(model, ids, max_tokens=12, temperature=0.0)
    assert "".join(deltas) == text and all(deltas)
    sampled = asyncio.run(model.generate_text(ids, max_tokens=12, temperature=1.0, seed=7))
    assert "".join(_stream_text(model, ids, max_tokens=12, temperature=1.0, seed=7)) == sampled


def _forcing_rows(model, targets: list[int]) -> torch.Tensor:
    """Residuals whose lens argmax is each target: its unembedding row, scaled up."""
    rows = model.hf.lm_head.weight[targets].detach()
    for scale in (30.0, 100.0, 300.0):
        if decode_residuals(model, rows * scale).argmax(-1).tolist() == list(targets):
            return rows * scale
    raise AssertionError(f"cannot force tokens {targets} through the head of {model}")


def _forced_generation_spec(model, prompt_len: int, targets: list[int]) -> SteerSpec:
    """A per-position ``set`` of the last resid_post to residuals that decode to each target,
    at the positions whose logits pick the generated tokens: greedy decoding then emits
    ``targets``."""
    rows = _forcing_rows(model, targets)
    positions = list(range(prompt_len - 1, prompt_len - 1 + len(targets)))
    return SteerSpec.set(f"resid_post.{model.n_layers - 1}", rows, positions=positions)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_multibyte_characters_split_over_tokens(eager_models, arch):
    model = eager_models[arch]
    target_text = "日本 café"
    targets = model.tok.hf(target_text, add_special_tokens=False)["input_ids"]
    pieces = [model.to_string([t]) for t in targets]
    assert any("\ufffd" in p for p in pieces)  # some character really spans tokens
    ids = model.to_tokens(PROMPT)
    spec = _forced_generation_spec(model, ids.shape[1], targets)
    with steer(model, spec):
        steps = list(generate_stream(model, ids, max_tokens=len(targets), temperature=0.0))
    assert [s.token_id for s in steps] == targets
    assert "".join(s.token_str for s in steps) == target_text
    assert not any("\ufffd" in s.token_str for s in steps)
    assert any(s.token_str == "" for s in steps)  # an incomplete character was held back
    text = asyncio.run(model.generate_text(ids, max_tokens=len(targets), temperature=0.0, steer=spec))
    deltas = _stream_text(model, ids, max_tokens=len(targets), temperature=0.0, steer=spec)
    assert text == target_text and "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_deltas_with_non_ascii_prompt(eager_models):
    model = eager_models["gemma2"]
    ids = model.to_tokens("日本語のテキスト: café, naïve, Ångström ∑ 🙂")
    for seed in range(3):
        steps = list(generate_stream(model, ids, max_tokens=16, temperature=1.0, seed=seed))
        assert "".join(s.token_str for s in steps) == model.to_string([s.token_id for s in steps])
        deltas = _stream_text(model, ids, max_tokens=16, temperature=1.0, seed=seed)
        assert "".join(deltas) == asyncio.run(
            model.generate_text(ids, max_tokens=16, temperature=1.0, seed=seed))


def test_generate_full(eager_models):
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    steps = list(generate_stream(model, ids, max_tokens=6, temperature=0.0, n_logprobs=3))
    out = asyncio.run(model.generate_full(ids, max_tokens=6, temperature=0.0, logprobs=3))
    assert out.text == "".join(s.token_str for s in steps)
    assert list(out.token_ids) == [s.token_id for s in steps]
    assert out.finish_reason == "length"
    assert len(out.logprobs) == 6
    for entry, step in zip(out.logprobs, steps):
        assert list(entry) == [e["token_id"] for e in step.logprobs]
        for e in step.logprobs:
            assert entry[e["token_id"]].logprob == pytest.approx(e["logprob"])
    assert out.outputs[0].text == out.text and list(out.prompt_token_ids) == ids[0].tolist()
    try:
        from vllm.outputs import RequestOutput
    except Exception:  # vLLM missing or not importable on this machine
        RequestOutput = None
    if RequestOutput is not None:
        assert isinstance(out, RequestOutput)
    no_lp = asyncio.run(model.generate_full(ids, max_tokens=2, temperature=0.0))
    assert no_lp.logprobs is None and len(no_lp.token_ids) == 2


def test_concurrent_steered_requests_equal_sequential(eager_models):
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    g = torch.Generator().manual_seed(0)
    d = model.d_model
    specs = [
        None,
        SteerSpec.add("resid_post.0", torch.randn(d, generator=g), 8.0),
        SteerSpec.ablate("resid_post.1", torch.randn(d, generator=g)) |
        SteerSpec.add("mlp_out.1", torch.randn(d, generator=g), 6.0, positions="generated"),
        SteerSpec.set("attn_out.2", torch.randn(d, generator=g) * 4, positions="prompt"),
    ]
    kwargs = dict(max_tokens=10, temperature=0.0)
    sequential = [asyncio.run(model.generate_text(ids, steer=s, **kwargs)) for s in specs]
    assert len(set(sequential)) == len(specs)  # every spec changes the output

    async def together():
        return await asyncio.gather(*[model.generate_text(ids, steer=s, **kwargs) for s in specs])

    assert asyncio.run(together()) == sequential
    for spec, text in zip(specs, sequential):
        if spec is None:
            continue
        with steer(model, spec):
            assert "".join(s.token_str for s in generate_stream(model, ids, **kwargs)) == text
            assert asyncio.run(model.generate_text(ids, **kwargs)) == text  # context steering
    assert asyncio.run(model.generate_text(ids, **kwargs)) == sequential[0]


# ---- hooks and early exit ------------------------------------------------------------------

def test_breaking_out_of_generate_stream(eager_models):
    model = eager_models["gemma2"]
    ids = model.to_tokens(PROMPT)
    before = hook_count(model.hf)
    spec = SteerSpec.add("resid_post.1", torch.randn(model.d_model), 2.0)
    with steer(model, spec):
        stream = generate_stream(model, ids, max_tokens=20, temperature=0.0)
        for i, _ in enumerate(stream):
            assert hook_count(model.hf) == before  # hooks live only inside each forward
            if i == 2:
                break
        stream.close()
        assert hook_count(model.hf) == before
        abandoned = generate_stream(model, ids, max_tokens=20, temperature=0.0)
        next(abandoned)
        assert hook_count(model.hf) == before

    async def partial():
        agen = model.generate_stream(ids, max_tokens=20, temperature=0.0, steer=spec)
        async for _ in agen:
            break
        await agen.aclose()

    asyncio.run(partial())
    assert hook_count(model.hf) == before
    logits, _ = run_with_cache(model, ids, ["resid_post.0"], return_logits=True)
    with torch.no_grad():
        torch.testing.assert_close(logits, model.hf(ids).logits, rtol=0, atol=0)


def test_generation_failure_removes_hooks(eager_models, monkeypatch):
    model = eager_models["qwen3_moe"]
    ids = model.to_tokens(PROMPT)
    before = hook_count(model.hf)
    mlp = model.hf.model.layers[2].mlp
    original = mlp.forward
    calls = {"n": 0}

    def fail_on_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected decode failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(mlp, "forward", fail_on_third)
    with pytest.raises(RuntimeError, match="injected decode failure"):
        capture_generation(model, ids, all_addresses(model), max_tokens=6, temperature=0.0)
    assert hook_count(model.hf) == before
    monkeypatch.undo()
    with torch.no_grad():
        expected = model.hf(ids).logits
    logits, _ = run_with_cache(model, ids, ["resid_post.0"], return_logits=True)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


# ---- bad input: a clear error before any forward ----------------------------------------

BAD_SAMPLING = [
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=-3), ValueError, "max_tokens"),
    (dict(max_tokens=2.5), ValueError, "max_tokens"),
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=-0.2), ValueError, "top_p"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=513), ValueError, "top_k"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(stop_at_eos="yes"), TypeError, "stop_at_eos"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_SAMPLING, ids=[str(k) for k, _, _ in BAD_SAMPLING])
def test_bad_sampling_raises_before_any_forward(eager_models, kwargs, error, match):
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    base = dict(max_tokens=4, temperature=1.0)
    with count_forwards(model.hf) as calls:
        with pytest.raises(error, match=match):
            list(generate_stream(model, ids, **{**base, **kwargs}))
        with pytest.raises(error, match=match):
            capture_generation(model, ids, ["resid_post.0"], **{**base, **kwargs})
        with pytest.raises(error, match=match):
            asyncio.run(model.generate_text(ids, **{**base, **kwargs}))
        with pytest.raises(error, match=match):
            asyncio.run(model.generate_full(ids, **{**base, **kwargs}))
    assert calls == []


def test_bad_logprobs_raise_before_any_forward(eager_models):
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    with count_forwards(model.hf) as calls:
        with pytest.raises(ValueError, match=r"n_logprobs=513.*vocabulary size 512"):
            list(generate_stream(model, ids, max_tokens=2, n_logprobs=513))
        with pytest.raises(ValueError, match="n_logprobs"):
            list(generate_stream(model, ids, max_tokens=2, n_logprobs=-1))
        with pytest.raises(ValueError, match="vocabulary size"):
            asyncio.run(model.generate_full(ids, max_tokens=2, logprobs=10_000))
    assert calls == []


BAD_PROMPTS = [
    ([], ValueError, "empty prompt"),
    (torch.empty((1, 0), dtype=torch.long), ValueError, "empty prompt"),
    ([5, 512], ValueError, r"outside the vocabulary \[0, 512\): \[512\]"),
    ([5, -1], ValueError, r"outside the vocabulary.*-1"),
    (torch.tensor([[3, 4, 9999]]), ValueError, "9999"),
    ([[1, 2], [3, 4]], ValueError, "one prompt"),
    ("Hello", TypeError, "to_tokens"),
    (torch.tensor([[1.0, 2.0]]), TypeError, r"(tokens|token_ids) is a tensor of shape \[1, 2\] and dtype torch.float32, expected int"),
    (torch.zeros((1, 2, 3), dtype=torch.long), ValueError, r"(tokens|token_ids) is a tensor of shape \[1, 2, 3\]"),
    ([1, "a"], TypeError, "mixed"),
]


@pytest.mark.parametrize("tokens, error, match", BAD_PROMPTS, ids=[m for _, _, m in BAD_PROMPTS])
def test_bad_prompts_raise_before_any_forward(eager_models, tokens, error, match):
    model = eager_models["llama"]
    with count_forwards(model.hf) as calls:
        with pytest.raises(error, match=match):
            list(generate_stream(model, tokens, max_tokens=2))
        with pytest.raises(error, match=match):
            asyncio.run(model.generate_text(tokens, max_tokens=2))
        with pytest.raises(error, match=match):
            capture_generation(model, tokens, ["resid_post.0"], max_tokens=2)
        if match != "one prompt":
            with pytest.raises(error, match=match):
                run_with_cache(model, tokens, ["resid_post.0"])
    assert calls == []


def test_empty_text_prompt(eager_models):
    model = eager_models["qwen3"]  # adds no BOS, so "" tokenizes to nothing
    with pytest.raises(ValueError, match="empty prompt"):
        model.to_tokens("")
    with pytest.raises(TypeError, match="str"):
        model.to_tokens([])


def test_bad_addresses_and_steering_raise_before_any_forward(eager_models):
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    d = model.d_model
    with count_forwards(model.hf) as calls:
        with pytest.raises(ValueError, match=r"resid_post\.99.*3 layers"):
            capture_generation(model, ids, ["resid_post.99"], max_tokens=2)
        with pytest.raises(ValueError, match="'resid_streams'"):
            capture_generation(model, ids, ["resid_streams.0"], max_tokens=2)
        with pytest.raises(ValueError, match=r"width 64.*d_model=128"):
            asyncio.run(model.generate_text(ids, max_tokens=2, steer=SteerSpec.add("resid_post.0",
                                                                                 torch.randn(64))))
        with pytest.raises(TypeError, match=r"float64"):
            asyncio.run(model.generate_text(ids, max_tokens=2, steer=SteerSpec.add(
                "resid_post.0", torch.randn(d, dtype=torch.float64))))
        with pytest.raises(TypeError, match="SteerSpec"):
            asyncio.run(model.generate_text(ids, max_tokens=2, steer="resid_post.0"))
        with pytest.raises(ValueError, match=r"resid_post\.7"):
            asyncio.run(model.generate_full(ids, max_tokens=2, steer=SteerSpec.add(
                "resid_post.7", torch.randn(d))))
    assert calls == []
    moe = eager_models["qwen3_moe"]
    with count_forwards(moe.hf) as calls:
        with pytest.raises(ValueError, match=r"'mlp_act'.*qwen3_moe"):
            capture_generation(moe, moe.to_tokens(PROMPT), ["mlp_act.0"], max_tokens=2)
    assert calls == []


# ---- prompt embeddings --------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "qwen3_moe"])
def test_generate_from_embeds_equals_token_ids(eager_models, arch):
    model = eager_models[arch]
    ids = model.to_tokens(PROMPT)
    embeds = model.embed(ids)
    assert embeds.shape == (ids.shape[1], model.d_model) and embeds.dtype == model.dtype
    out = asyncio.run(model.generate_from_embeds(embeds, dict(max_tokens=6, temperature=0.0)))
    assert list(out.outputs[0].token_ids) == _ids(model, max_tokens=6, temperature=0.0)


def test_generate_from_embeds_refusals_before_any_forward(eager_models):
    ds = eager_models["deepseek_v4"]
    embeds = ds.embed(ds.to_tokens(PROMPT))
    with count_forwards(ds.hf) as calls:
        with pytest.raises(ValueError, match="hash-MoE.*token ids"):
            asyncio.run(ds.generate_from_embeds(embeds, dict(max_tokens=2)))
    assert calls == []
    model = eager_models["qwen3"]
    embeds = model.embed(model.to_tokens(PROMPT))
    with count_forwards(model.hf) as calls:
        with pytest.raises(ShapeError, match=r"embeds is a tensor of shape \[\d+, 64\].*d_model=128 on this qwen3"):
            asyncio.run(model.generate_from_embeds(embeds[:, :64], dict(max_tokens=2)))
        with pytest.raises(TypeError, match="float64"):
            asyncio.run(model.generate_from_embeds(embeds.double(), dict(max_tokens=2)))
        with pytest.raises(ValueError, match="max_tokens"):
            asyncio.run(model.generate_from_embeds(embeds, dict(max_tokens=0)))
    assert calls == []


# ---- stop tokens, min_tokens, the end of the context --------------------------------------

def test_stop_token_ids_and_min_tokens(eager_models):
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    free = [s.token_id for s in generate_stream(model, ids, max_tokens=12, temperature=0.0, stop_at_eos=False)]
    stop = free[4]
    first = free.index(stop)
    embeds = model.embed(ids)
    base = dict(max_tokens=12, temperature=0.0, stop_at_eos=False)
    out = asyncio.run(model.generate_from_embeds(embeds, dict(base, stop_token_ids=(stop,))))
    assert list(out.token_ids) == free[: first + 1] and out.finish_reason == "stop"
    # min_tokens: a stop token cannot be drawn before min_tokens tokens (greedy takes the next best)
    out = asyncio.run(model.generate_from_embeds(embeds, dict(base, stop_token_ids=(free[0],), min_tokens=1)))
    assert out.token_ids[0] != free[0]
    assert out.token_ids[0] == int(torch.topk(model.hf(ids).logits[0, -1], 2).indices[1])


def test_samplingparams_fields_are_honoured_or_refused_on_eager(eager_models):
    vllm = pytest.importorskip("vllm")
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    free = [s.token_id for s in generate_stream(model, ids, max_tokens=12, temperature=0.0, stop_at_eos=False)]
    embeds = model.embed(ids)
    out = asyncio.run(model.generate_from_embeds(embeds, vllm.SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[free[3]])))
    assert list(out.token_ids) == free[: free.index(free[3]) + 1] and out.finish_reason == "stop"
    with count_forwards(model.hf) as calls:
        with pytest.raises(ValueError, match=r"SamplingParams\.n=3 is not honoured"):
            asyncio.run(model.generate_from_embeds(embeds, vllm.SamplingParams(n=3)))
        with pytest.raises(ValueError, match=r"SamplingParams\.repetition_penalty=1.3"):
            asyncio.run(model.generate_from_embeds(embeds, vllm.SamplingParams(repetition_penalty=1.3)))
        with pytest.raises(TypeError, match="must be a vllm.SamplingParams"):
            asyncio.run(model.generate_from_embeds(embeds, "max_tokens=3"))
    assert calls == []


def test_generation_stops_at_the_end_of_the_context(model_pool, tiny_dirs):
    from interp_engine import load_model

    model = load_model(tiny_dirs["qwen3"], max_model_len=24)
    assert model.max_model_len == 24
    ids = list(range(5, 25))  # 20 tokens: room for 4
    steps = list(generate_stream(model, ids, max_tokens=50, temperature=0.0, stop_at_eos=False))
    assert len(steps) == 4
    completion, cache = capture_generation(model, ids, ["resid_post.0"], max_tokens=50, temperature=0.0,
                                           stop_at_eos=False)
    assert completion.finish_reason == "length" and cache["resid_post.0"].shape[1] == 23
    with pytest.raises(ValueError, match=r"prompt has 24 tokens and this model's context holds 24"):
        list(generate_stream(model, list(range(5, 29)), max_tokens=1))
    with pytest.raises(ValueError, match=r"input has 25 positions, more than this model's context"):
        run_with_cache(model, list(range(5, 30)), ["resid_post.0"])
    with pytest.raises(ValueError, match=r"max_model_len=600 is above this model's context"):
        load_model(tiny_dirs["qwen3"], max_model_len=600)
    # the model's own context when not given: the tiny models' max_position_embeddings
    assert model_pool.get("qwen3").max_model_len == 512
