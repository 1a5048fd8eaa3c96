"""The user documentation in shared/spec/, example by example, with the tiny models standing
in for the hub names (Qwen/Qwen3-8B -> qwen3, google/gemma-2-2b-it -> gemma2,
Qwen/Qwen3-30B-A3B -> qwen3_moe) and layer numbers scaled to their three layers.

The examples a page calls portable (capture, capture while generating, generation, steering,
the portable lens) run on both backends, each from the session's shared model_pool, and their
numbers are compared with references computed here against the Hugging Face modules of the same
tiny weights (tests/_reference.py and the hand-written hooks below), never against
interp_engine itself. Eager-only examples are compared with the same references.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util

import pytest
import torch

import interp_engine._model as model_module
from interp_engine.testing import assert_close_scaled, tiny_model
from tests._reference import reference_points

HUB = {"Qwen/Qwen3-8B": "qwen3", "google/gemma-2-2b-it": "gemma2", "Qwen/Qwen3-30B-A3B": "qwen3_moe"}
has_vllm = importlib.util.find_spec("vllm") is not None
TOL = 2e-5  # relative to the reference's scale (assert_close_scaled): fp32 across engines
LOGPROB_TOL = 2e-4


@pytest.fixture(autouse=True)
def hub_names_are_tiny(monkeypatch):
    real = model_module.resolve_model_path

    def resolve(name):
        return tiny_model(HUB[name]) if name in HUB else real(name)
    monkeypatch.setattr(model_module, "resolve_model_path", resolve)


@pytest.fixture(params=["eager", pytest.param("vllm", marks=[
    pytest.mark.vllm, pytest.mark.skipif(not has_vllm, reason="vllm not installed")])])
def backend(request) -> str:
    return request.param


@pytest.fixture
def qwen(model_pool, backend):
    """``load_model("Qwen/Qwen3-8B", backend=...)`` as the pages write it, from the shared pool
    (one vLLM engine for the session)."""
    if backend == "eager":
        return model_pool.get("qwen3")
    return model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)


@pytest.fixture
def ref_model(model_pool):
    """The eager tiny Qwen3, whose HF modules the references run (same weights as the vLLM
    engine's). Never asked for output_hidden_states: that leaves recording hooks on it."""
    return model_pool.get("qwen3")


@pytest.fixture
def hf(ref_model):
    return ref_model.hf


# ---- references against the HF modules ---------------------------------------------------

def _ids(tokens) -> torch.Tensor:
    return torch.as_tensor(tokens).reshape(1, -1)


@contextlib.contextmanager
def _layer_edits(hf, edits):
    """Hand-written steering: ``edits`` is ``[(layer, fn)]``, each ``fn(out) -> out`` on that
    decoder layer's output (its resid_post), for the whole sequence of one forward."""
    handles = [hf.model.layers[layer].register_forward_hook(lambda mod, args, out, fn=fn: fn(out))
               for layer, fn in edits]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def reference_greedy(hf, prompt: list[int], n: int, k: int, edits=(), eos=()) -> list[tuple[int, list]]:
    """Greedy generation by full forwards (no KV cache), each step's token and top-k
    ``(token_id, logprob)``, with ``edits`` applied at every position of every forward."""
    ids, out = list(prompt), []
    with _layer_edits(hf, edits):
        for _ in range(n):
            logprobs = torch.log_softmax(hf(input_ids=_ids(ids)).logits[0, -1].float(), -1)
            top = torch.topk(logprobs, k)
            token = int(top.indices[0])
            out.append((token, list(zip(top.indices.tolist(), top.values.tolist()))))
            ids.append(token)
            if token in eos:
                break
    return out


def assert_greedy_matches(steps, reference, what: str) -> None:
    """Same tokens and top-k logprobs as the reference, step by step; the tokens may part only
    where the reference has a true near-tie, and the comparison stops there."""
    assert steps, what
    for i, (step, (token, top)) in enumerate(zip(steps, reference)):
        if step.token_id != token:
            assert abs(top[0][1] - top[1][1]) < 1e-4, f"{what}: step {i} took {step.token_id}, reference {token}"
            return
        if step.logprobs is not None:
            got = {e["token_id"]: e["logprob"] for e in step.logprobs}
            for tid, lp in top[:len(got)]:
                assert got.get(tid) == pytest.approx(lp, abs=LOGPROB_TOL), f"{what}: step {i} token {tid}"
    assert len(steps) == len(reference), what


def _eos(model_pool) -> tuple[int, ...]:
    return tuple(model_pool.get("qwen3").backend.eos_ids)


def _unit(seed: int, d: int) -> torch.Tensor:
    v = torch.randn(d, generator=torch.Generator().manual_seed(seed))
    return v / v.norm()


# ---- capture.md -----------------------------------------------------------------------------

def test_capture_page(qwen, ref_model):
    from interp_engine import Address, format_address, parse_address, run_with_cache, to_address

    model = qwen
    point = Address("resid_post", 1)
    tokens = model.to_tokens("The capital of France is")
    cache = run_with_cache(model, tokens, [point])
    ref = reference_points(ref_model, _ids(tokens))
    assert_close_scaled(cache[point], ref[("resid_post", 1)], TOL, "resid_post.1")

    cache = run_with_cache(model, tokens, ["resid_post.1", "mlp_out.1", "attn_out.1"])
    assert torch.equal(cache.get("mlp_out", 1), cache["mlp_out.1"])
    for name in ("resid_post", "mlp_out", "attn_out"):
        assert_close_scaled(cache.get(name, 1), ref[(name, 1)], TOL, f"{name}.1")

    hello = model.to_tokens("Hello")
    points = [Address("resid_post", layer) for layer in range(model.n_layers)]
    cache = run_with_cache(model, hello, points)
    ref = reference_points(ref_model, _ids(hello))
    assert len(cache) == model.n_layers
    for p in points:
        assert_close_scaled(cache[p], ref[("resid_post", p.layer)], TOL, str(p))

    assert parse_address("resid_post.10") == Address("resid_post", 10)
    assert to_address(("mlp_out", 3)) == Address("mlp_out", 3)
    assert Address("resid_streams", 5, 2).stream == 2
    assert format_address(Address("z", 7)) == "z.7"
    assert format_address(Address("resid_streams", 5, 2)) == "resid_streams.5.2"


def test_capture_while_generating(qwen, ref_model):
    from interp_engine import capture_generation

    model = qwen
    tokens = model.to_tokens("The capital of France is")
    completion, cache = capture_generation(model, tokens, ["resid_post.1"], max_tokens=8)
    assert completion.text == model.to_string(list(completion.token_ids))
    fed = tokens.flatten().tolist() + list(completion.token_ids[:-1])
    rows = cache.get("resid_post", 1)
    assert rows.shape[1] == tokens.shape[1] + len(completion.token_ids) - 1  # the page's count
    ref = reference_points(ref_model, _ids(fed))
    assert_close_scaled(rows, ref[("resid_post", 1)], TOL, "resid_post.1 while generating")


def test_batch_moe_heads_and_gradients_on_eager(model_pool):
    from interp_engine import expert_assignment, head_contributions, load_model, run_with_cache

    model = load_model("google/gemma-2-2b-it", backend="eager")
    tokens = model.tok.to_tokens(["Paris is in", "Berlin is in"])
    cache = run_with_cache(model, tokens, ["resid_post.1"])
    batched = cache.get("resid_post", 1)
    assert batched.shape[0] == 2
    for row, text in enumerate(["Paris is in", "Berlin is in"]):
        alone = run_with_cache(model, model.to_tokens(text), ["resid_post.1"]).get("resid_post", 1)[0]
        mask = tokens.attention_mask[row].bool()
        assert_close_scaled(batched[row][mask], alone, TOL, f"batch row {row}")

    moe = load_model("Qwen/Qwen3-30B-A3B", backend="eager")
    hello = moe.to_tokens("Hello")
    cache = run_with_cache(moe, hello, ["router_logits.1", "expert_weights.1", "expert_indices.1"])
    dense = expert_assignment(cache, 1, n_experts=moe.graph.n_experts)
    ref = reference_points(moe, _ids(hello))
    expected = torch.zeros_like(dense).scatter(-1, ref[("expert_indices", 1)], ref[("expert_weights", 1)])
    torch.testing.assert_close(dense, expected, atol=1e-6, rtol=1e-5)

    hello = model.to_tokens("Hello")
    cache = run_with_cache(model, hello, ["z.1"])
    heads = head_contributions(model, cache, 1)
    assert heads.shape[2:] == (model.graph.n_heads, model.d_model)
    ref = reference_points(model, _ids(hello))
    assert_close_scaled(heads.sum(2), ref[("o_proj_out", 1)], TOL, "heads sum to o_proj's output")

    model = load_model("google/gemma-2-2b-it", backend="eager", requires_grad=True)
    cache = run_with_cache(model, hello, ["resid_post.1"], detach=False)
    cache.get("resid_post", 1).sum().backward()
    grad = model.hf.model.embed_tokens.weight.grad
    assert grad is not None and bool(grad[hello.flatten()].abs().sum() > 0)


# ---- capabilities.md --------------------------------------------------------------------

def test_capabilities_page(model_pool):
    from interp_engine import CAPABILITIES, CapabilityUnsupported, load_model, run_with_cache

    model = load_model("Qwen/Qwen3-8B")
    assert [s.name for s in model.points()][:3] == ["resid_pre", "resid_mid", "resid_post"]
    assert all(isinstance(s.vllm, bool) for s in model.points())
    basis = model.residual_basis
    assert (basis.n_streams, basis.additive, basis.lens_valid) == (1, True, True) and basis.describe()
    grads = load_model("google/gemma-2-2b-it", backend="eager", requires_grad=True).grad_support
    assert grads.through_forward and grads.describe()
    for name, capability in CAPABILITIES.items():
        assert capability.why and capability.instead, name
    if has_vllm:
        smodel = load_model("Qwen/Qwen3-8B", backend="vllm-static", static_points="auto")  # no engine yet
        assert smodel.hooks_available and not smodel.graph_replay
        assert smodel.static_points and smodel.static_writes
        with pytest.raises(CapabilityUnsupported) as info:
            run_with_cache(smodel, smodel.to_tokens("Hi"), ["resid_pre.1"])
        assert "static_points" in str(info.value) and smodel.backend._llm is None
        vmodel = model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)
        assert vmodel.hooks_available and not vmodel.graph_replay and vmodel.static_points == ()
        with pytest.raises(CapabilityUnsupported) as info:
            run_with_cache(vmodel, vmodel.to_tokens("Hi"), ["resid_post.1"], return_logits=True)
        assert "logits_in_stream" in str(info.value) and info.value.instead


# ---- generation.md ----------------------------------------------------------------------

def test_generation_page(qwen, hf, backend, model_pool):
    from interp_engine import generate_stream, top_logprobs

    model = qwen
    tokens = model.to_tokens("The capital of France is")
    prompt = tokens.flatten().tolist()
    steps = list(generate_stream(model, tokens, max_tokens=32, temperature=0.0, n_logprobs=5))
    assert all(len(s.logprobs) == 5 for s in steps)
    assert all((s.logits is not None) == (backend == "eager") for s in steps)  # the page says so
    reference = reference_greedy(hf, prompt, 32, 5, eos=_eos(model_pool))
    assert_greedy_matches(steps, reference, "greedy with n_logprobs=5")

    steps = list(generate_stream(model, tokens, max_tokens=32, temperature=0.8, top_p=0.95, seed=0))
    text = "".join(step.token_str for step in steps)
    assert text == model.to_string([s.token_id for s in steps])
    if backend == "eager":
        top = top_logprobs(steps[0].logits, 5)
        assert set(top[0]) == {"token_id", "logprob"}
        expected = torch.topk(torch.log_softmax(steps[0].logits.float(), -1), 5)
        assert [t["token_id"] for t in top] == expected.indices.tolist()

    async def generate(model, token_ids):
        text = await model.generate_text(token_ids, max_tokens=64, temperature=0.0)
        deltas = [d async for d in model.generate_stream(token_ids, max_tokens=64, temperature=0.0)]
        assert "".join(deltas) == text
        out = await model.generate_full(token_ids, max_tokens=32, logprobs=3)
        return text, out.text, out.token_ids, out.finish_reason

    text, full_text, ids, reason = asyncio.run(generate(model, tokens))
    assert reason in ("stop", "length") and full_text == model.to_string(ids)
    assert_text_matches(text, reference_greedy(hf, prompt, 64, 2, eos=_eos(model_pool)), model, _eos(model_pool))


def assert_text_matches(text: str, reference, model, eos) -> None:
    """Greedy text equals the reference's (its end-of-sequence token not shown), unless the
    reference has a true near-tie where an engine may take the other token."""
    expected = model.to_string([t for t, _ in reference if t not in eos])
    if text != expected:
        ties = [i for i, (_, top) in enumerate(reference) if abs(top[0][1] - top[1][1]) < 1e-4]
        assert ties, f"greedy text differs from the reference with no near-tie: {text!r} vs {expected!r}"


@pytest.mark.skipif(not has_vllm, reason="vllm not installed")
@pytest.mark.vllm
def test_from_embeddings_page(model_pool, hf):
    from vllm import SamplingParams

    model = model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)
    tokens = model.to_tokens("Hello there")
    embeds = model.embed(tokens)
    torch.testing.assert_close(embeds, hf.model.embed_tokens(tokens.flatten()).detach())

    async def from_embeds(model, embeds):
        out = await model.generate_from_embeds(embeds, SamplingParams(max_tokens=8, temperature=0.0))
        return out.outputs[0].token_ids
    got = list(asyncio.run(from_embeds(model, embeds)))
    greedy = [t for t, _ in reference_greedy(hf, tokens.flatten().tolist(), 8, 2, eos=_eos(model_pool))]
    assert got == greedy[:len(got)] and got


# ---- steering.md --------------------------------------------------------------------------

def _add(v, scale):
    return lambda out: out + scale * v


def _ablate(d):
    return lambda out: out - (out @ d).unsqueeze(-1) * d


def _set(v, positions):
    def edit(out):
        out = out.clone()
        for p in positions:
            if p < out.shape[1]:
                out[:, p] = v
        return out
    return edit


def test_steering_page(qwen, hf, model_pool):
    from interp_engine import SteerSpec, generate_stream, steer

    model = qwen
    tokens = model.to_tokens("I think that")
    prompt = tokens.flatten().tolist()
    v = _unit(0, model.d_model)
    u = _unit(1, model.d_model)
    eos = _eos(model_pool)

    def steered_steps(spec, n=12):
        with steer(model, spec):
            return list(generate_stream(model, tokens, max_tokens=n, temperature=0.0, n_logprobs=3))

    def reference(edits, n=12):
        return reference_greedy(hf, prompt, n, 3, edits, eos)

    spec = SteerSpec.add("resid_post.1", v, scale=4.0)
    assert_greedy_matches(steered_steps(spec), reference([(1, _add(v, 4.0))]), "add 4v")
    plain = list(generate_stream(model, tokens, max_tokens=12, temperature=0.0, n_logprobs=3))
    assert [s.logprobs for s in steered_steps(spec)] != [s.logprobs for s in plain]

    cases = [
        (SteerSpec.add("resid_post.1", v, scale=1.0, positions="all"), [(1, _add(v, 1.0))]),
        (SteerSpec.ablate("resid_post.1", v, positions="all"), [(1, _ablate(v))]),
        (SteerSpec.set("resid_post.1", 8 * v, positions=[2]), [(1, _set(8 * v, [2]))]),
    ]
    for spec, edits in cases:
        assert_greedy_matches(steered_steps(spec), reference(edits), repr(spec.ops[0]))

    spec = SteerSpec.add("resid_post.1", v, scale=4.0) | SteerSpec.ablate("resid_post.2", u)
    assert len(spec.ops) == 2
    composed = [(1, _add(v, 4.0)), (2, _ablate(u))]
    assert_greedy_matches(steered_steps(spec), reference(composed), "composed")
    with steer(model, SteerSpec.add("resid_post.1", v, scale=4.0)):
        with steer(model, SteerSpec.ablate("resid_post.2", u)):
            nested = list(generate_stream(model, tokens, max_tokens=12, temperature=0.0, n_logprobs=3))
    assert_greedy_matches(nested, reference(composed), "nested")

    async def steered_request(model, token_ids, spec):
        return await model.generate_text(token_ids, max_tokens=12, temperature=0.0, steer=spec)
    text = asyncio.run(steered_request(model, tokens, spec))
    assert_text_matches(text, reference(composed), model, eos)

    with pytest.raises(ValueError, match="d_model"):
        with steer(model, SteerSpec.add("resid_post.1", torch.zeros(model.d_model + 1))):
            pass


# ---- logit-lens.md --------------------------------------------------------------------------

def test_logit_lens_page(qwen, ref_model, hf):
    from interp_engine import Address, run_with_cache

    model = qwen
    tokens = model.to_tokens("The capital of France is")
    points = [Address("resid_post", layer) for layer in range(model.n_layers)]
    cache = run_with_cache(model, tokens, points)
    logprobs = model.decode_residuals(cache)
    assert logprobs.shape[:2] == (model.n_layers, 1) and logprobs.shape[-1] == model.d_vocab
    ref = reference_points(ref_model, _ids(tokens))
    with torch.no_grad():
        expected = [torch.log_softmax(hf.lm_head(hf.model.norm(ref[("resid_post", L)])).float(), -1)
                    for L in range(model.n_layers - 1)]
        expected.append(torch.log_softmax(ref["logits"].float(), -1))  # the check that always holds
    for L in range(model.n_layers):
        assert_close_scaled(logprobs[L], expected[L], 1e-4, f"lens at layer {L}")
    ids, values = model.decode_residuals(cache, top_k=5)
    assert ids.shape[-1] == 5 == values.shape[-1]
    torch.testing.assert_close(values, torch.topk(logprobs, 5, -1).values)


def test_free_lens_and_where_it_does_not_apply(model_pool, ref_model, hf):
    from interp_engine import CapabilityUnsupported, decode_residuals, run_with_cache

    model = model_pool.get("qwen3")
    tokens = model.to_tokens("The capital of France is")
    cache = run_with_cache(model, tokens, ["resid_post.1"])
    logits = decode_residuals(model, cache.get("resid_post", 1))
    assert logits.shape[-1] == model.d_vocab
    h = reference_points(ref_model, _ids(tokens))[("resid_post", 1)]
    with torch.no_grad():
        assert_close_scaled(logits, hf.lm_head(hf.model.norm(h)), 1e-5, "free lens at layer 1")
    other = model_pool.get("deepseek_v4")
    c2 = run_with_cache(other, other.to_tokens("Hi"), ["resid_post.0"])
    with pytest.raises(CapabilityUnsupported):
        other.decode_residuals(c2)
    with pytest.raises(CapabilityUnsupported):
        decode_residuals(other, c2["resid_post.0"][:, :, 0])
