"""The user documentation in shared/spec/, example by example, with the tiny models standing
in for the hub names (Qwen/Qwen3-8B -> qwen3, google/gemma-2-2b-it -> gemma2,
Qwen/Qwen3-30B-A3B -> qwen3_moe) and layer numbers scaled to their three layers."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

import interp_engine._model as model_module
from interp_engine.testing import tiny_model

HUB = {"Qwen/Qwen3-8B": "qwen3", "google/gemma-2-2b-it": "gemma2", "Qwen/Qwen3-30B-A3B": "qwen3_moe"}
has_vllm = importlib.util.find_spec("vllm") is not None


@pytest.fixture(autouse=True)
def hub_names_are_tiny(monkeypatch):
    real = model_module.resolve_model_path

    def resolve(name):
        return tiny_model(HUB[name]) if name in HUB else real(name)
    monkeypatch.setattr(model_module, "resolve_model_path", resolve)


def test_capture_page():
    from interp_engine import Address, format_address, load_model, parse_address, run_with_cache, to_address

    model = load_model("Qwen/Qwen3-8B")
    point = Address("resid_post", 1)
    cache = run_with_cache(model, model.to_tokens("The capital of France is"), [point])
    assert cache[point].shape[0] == 1 and cache[point].shape[2] == model.d_model  # [batch, pos, d_model]

    tokens = model.to_tokens("The capital of France is")
    cache = run_with_cache(model, tokens, ["resid_post.1", "mlp_out.1", "attn_out.1"])
    assert torch.equal(cache.get("mlp_out", 1), cache["mlp_out.1"])

    points = [Address("resid_post", layer) for layer in range(model.n_layers)]
    cache = run_with_cache(model, model.to_tokens("Hello"), points)
    assert len(cache) == model.n_layers

    assert parse_address("resid_post.10") == Address("resid_post", 10)
    assert to_address(("mlp_out", 3)) == Address("mlp_out", 3)
    assert Address("resid_streams", 5, 2).stream == 2
    assert format_address(Address("z", 7)) == "z.7"


def test_capture_while_generating_and_batches_and_moe_and_heads_and_grads():
    from interp_engine import (capture_generation, expert_assignment, head_contributions, load_model,
                               run_with_cache)

    model = load_model("Qwen/Qwen3-8B")
    tokens = model.to_tokens("The capital of France is")
    completion, cache = capture_generation(model, tokens, ["resid_post.1"], max_tokens=8)
    assert isinstance(completion.text, str) and len(completion.token_ids) >= 1
    assert cache.get("resid_post", 1).shape[1] == tokens.shape[1] + len(completion.token_ids) - 1

    model = load_model("google/gemma-2-2b-it", backend="eager")
    tokens = model.tok.to_tokens(["Paris is in", "Berlin is in"])
    cache = run_with_cache(model, tokens, ["resid_post.1"])
    assert cache.get("resid_post", 1).shape[0] == 2

    moe = load_model("Qwen/Qwen3-30B-A3B", backend="eager")
    cache = run_with_cache(moe, moe.to_tokens("Hello"),
                           ["router_logits.1", "expert_weights.1", "expert_indices.1"])
    dense = expert_assignment(cache, 1, n_experts=moe.graph.n_experts)
    assert dense.shape[-1] == moe.graph.n_experts

    cache = run_with_cache(model, model.to_tokens("Hello"), ["z.1"])
    assert head_contributions(model, cache, 1).shape[2:] == (model.graph.n_heads, model.d_model)

    model = load_model("google/gemma-2-2b-it", backend="eager", requires_grad=True)
    cache = run_with_cache(model, model.to_tokens("Hello"), ["resid_post.1"], detach=False)
    cache.get("resid_post", 1).sum().backward()
    assert model.hf.model.embed_tokens.weight.grad is not None


def test_capabilities_page():
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
        vmodel = load_model("Qwen/Qwen3-8B", backend="vllm")
        assert vmodel.hooks_available and not vmodel.graph_replay and vmodel.static_points == ()
        with pytest.raises(CapabilityUnsupported) as info:
            run_with_cache(vmodel, vmodel.to_tokens("Hi"), ["mlp_act.1"])
        assert "mlp_act" in str(info.value) and info.value.instead


def test_generation_page():
    from interp_engine import generate_stream, load_model, top_logprobs

    model = load_model("Qwen/Qwen3-8B")
    tokens = model.to_tokens("The capital of France is")
    steps = list(generate_stream(model, tokens, max_tokens=32, temperature=0.0, n_logprobs=5))
    assert all(len(s.logprobs) == 5 and s.logits is not None for s in steps)
    steps = list(generate_stream(model, tokens, max_tokens=32, temperature=0.8, top_p=0.95, seed=0))
    text = "".join(step.token_str for step in steps)
    assert text == model.to_string([s.token_id for s in steps])
    top = top_logprobs(steps[0].logits, 5)
    assert set(top[0]) == {"token_id", "logprob"}

    async def generate(model, token_ids):
        text = await model.generate_text(token_ids, max_tokens=64, temperature=0.0)
        deltas = [d async for d in model.generate_stream(token_ids, max_tokens=64, temperature=0.0)]
        assert "".join(deltas) == text
        out = await model.generate_full(token_ids, max_tokens=32, logprobs=3)
        return out.text, out.token_ids, out.finish_reason

    text, ids, reason = asyncio.run(generate(model, tokens))
    assert reason in ("stop", "length") and text == model.to_string(ids)


def test_steering_and_lens_pages():
    from interp_engine import (Address, CapabilityUnsupported, SteerSpec, decode_residuals,
                               generate_stream, load_model, run_with_cache, steer)

    model = load_model("Qwen/Qwen3-8B")
    tokens = model.to_tokens("I think that")
    direction = torch.randn(model.d_model, generator=torch.Generator().manual_seed(0))
    v = direction / direction.norm()
    u = torch.randn(model.d_model, generator=torch.Generator().manual_seed(1))
    spec = SteerSpec.add("resid_post.1", v, scale=4.0)
    with steer(model, spec):
        steered = list(generate_stream(model, tokens, max_tokens=32, temperature=0.0))
    assert steered
    SteerSpec.add("resid_post.1", v, scale=1.0, positions="all")
    SteerSpec.ablate("resid_post.1", v, positions="all")
    SteerSpec.set("resid_post.1", v, positions=[2])
    spec = SteerSpec.add("resid_post.1", v, scale=4.0) | SteerSpec.ablate("resid_post.2", u)
    assert len(spec.ops) == 2

    async def steered_request(model, token_ids, spec):
        return await model.generate_text(token_ids, max_tokens=32, temperature=0.0, steer=spec)
    assert isinstance(asyncio.run(steered_request(model, tokens, spec)), str)
    with pytest.raises(ValueError, match="d_model"):
        with steer(model, SteerSpec.add("resid_post.1", torch.zeros(model.d_model + 1))):
            pass

    points = [Address("resid_post", layer) for layer in range(model.n_layers)]
    cache = run_with_cache(model, model.to_tokens("The capital of France is"), points)
    logprobs = model.decode_residuals(cache)
    assert logprobs.shape[:2] == (model.n_layers, 1) and logprobs.shape[-1] == model.d_vocab
    ids, values = model.decode_residuals(cache, top_k=5)
    assert ids.shape[-1] == 5 == values.shape[-1]
    logits = decode_residuals(model, cache.get("resid_post", 1))
    assert logits.shape[-1] == model.d_vocab
    other = load_model(tiny_model("deepseek_v4"))
    c2 = run_with_cache(other, other.to_tokens("Hi"), ["resid_post.0"])
    with pytest.raises(CapabilityUnsupported):
        other.decode_residuals(c2)
    with pytest.raises(CapabilityUnsupported):
        decode_residuals(other, c2["resid_post.0"][:, :, 0])


@pytest.mark.skipif(not has_vllm, reason="vllm not installed")
@pytest.mark.vllm
def test_from_embeddings_page(model_pool):
    from vllm import SamplingParams

    model = model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)
    embeds = model.embed(model.to_tokens("Hello there"))

    async def from_embeds(model, embeds):
        out = await model.generate_from_embeds(embeds, SamplingParams(max_tokens=32))
        return out.outputs[0].text
    assert isinstance(asyncio.run(from_embeds(model, embeds)), str)
