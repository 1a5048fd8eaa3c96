"""experts= writes inside vLLM's workers: the runtime scales the routing weights vLLM's router
hands its fused experts. The MoE block's output under the write must equal the Hugging Face
reference (tests/bridge/test_eager_experts.py: the clean block output minus, or plus a multiple
of, the expert's share recomputed on HF's experts module), at prompt and generated positions,
with concurrent requests that write differently. vllm-static refuses experts= before any forward."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from interp_engine import CapabilityUnsupported, SteerSpec, capture_generation, run_with_cache, steer
from interp_engine.testing import assert_close_scaled
from tests._reference import PROMPT
from tests.bridge.test_eager_experts import _block_io, _busy_expert, expert_case

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm not installed")]


@pytest.fixture(params=("qwen3_moe", "gpt_oss"))
def pair(request, model_pool):
    return model_pool.get(request.param), model_pool.get(request.param, "vllm", enable_prompt_embeds=True)


def test_zero_and_scale_an_expert_equal_the_hf_reference(pair):
    eager, vllm = pair
    ids = eager.to_tokens(PROMPT)
    layer = eager.graph.moe_layers[-1]
    site = f"mlp_out.{layer}"
    _, clean, expert, share = expert_case(eager, ids, layer)

    got = run_with_cache(vllm, ids, [site], steer=SteerSpec.zero(site, experts=[expert]))[site]
    assert_close_scaled(got, clean - share)
    positions = [1, 3]
    got = run_with_cache(vllm, ids, [site], steer=SteerSpec.scale(site, 2.5, positions=positions,
                                                                  experts=[expert]))[site]
    want = clean.clone()
    want[:, positions] += 1.5 * share[:, positions]
    assert_close_scaled(got, want)


def test_generated_positions_and_concurrent_requests_equal_eager(model_pool):
    """Two requests in one batch, each zeroing other experts (one at generated positions only),
    and one with no write: each one's tokens, logprobs and captured mlp_out equal eager's."""
    eager = model_pool.get("qwen3_moe")
    vllm = model_pool.get("qwen3_moe", "vllm", enable_prompt_embeds=True)
    layer = eager.graph.moe_layers[0]
    site = f"mlp_out.{layer}"
    prompts = [eager.to_tokens(p) for p in (PROMPT, "The capital of France is", "Hello")]
    specs = [SteerSpec.zero(site, experts=[0, 2, 5]), SteerSpec.scale(site, 3.0, positions="generated", experts=[1]),
             None]

    def one(model, ids, spec):
        def go():
            return capture_generation(model, ids, [site], max_tokens=5, temperature=0.0, n_logprobs=1)
        if spec is None:
            return go()
        with steer(model, spec):
            return go()

    async def together():
        return await asyncio.gather(*(asyncio.to_thread(one, vllm, ids, spec) for ids, spec in zip(prompts, specs)))
    got = asyncio.run(together())
    for (ids, spec), (completion, cache) in zip(zip(prompts, specs), got):
        ref_completion, ref_cache = one(eager, ids, spec)
        assert completion.token_ids == ref_completion.token_ids, spec
        for mine, theirs in zip(completion.logprobs, ref_completion.logprobs):
            assert mine[0]["logprob"] == pytest.approx(theirs[0]["logprob"], abs=1e-4)
        assert_close_scaled(cache[site], ref_cache[site], msg=str(spec))
    plain = one(eager, prompts[0], None)[1][site]
    assert not torch.allclose(got[0][1][site], plain)  # the write was seen


def test_vllm_static_refuses_expert_writes_before_any_forward(model_pool):
    from tests.bridge.vllm.test_static import _declared

    eager = model_pool.get("qwen3_moe")
    static = model_pool.get("qwen3_moe", "vllm-static", **_declared())
    ids = eager.to_tokens(PROMPT)
    spec = SteerSpec.zero(f"mlp_out.{eager.graph.moe_layers[0]}", experts=[1])
    with pytest.raises(CapabilityUnsupported, match="expert_writes.*vllm-static"):
        run_with_cache(static, ids, [], steer=spec)


def test_an_expert_write_past_the_client_fails_its_request_in_a_static_worker(model_pool, monkeypatch):
    """A plan that reaches a vllm-static worker without the client's refusal (another client, a
    server) fails its own request there; a compiled row-wide site never takes it as a whole-row
    zero."""
    from tests.bridge.vllm.test_static import _declared

    eager = model_pool.get("qwen3_moe")
    static = model_pool.get("qwen3_moe", "vllm-static", **_declared())
    ids = eager.to_tokens(PROMPT)
    site = f"mlp_out.{eager.graph.moe_layers[0]}"
    monkeypatch.setattr(static.backend, "refusal", lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="not compiled into vllm-static"):
        run_with_cache(static, ids, [site], steer=SteerSpec.zero(site, experts=[1]))
    monkeypatch.undo()
    assert run_with_cache(static, ids, [site])[site].abs().max() > 0  # the engine serves on


def test_expert_writes_under_tensor_parallelism_equal_the_tp1_run_and_eager(model_pool):
    """Each rank holds a slice of every expert; both scale the same routing weights, so the
    all-reduced block output is the written one. Greedy steps written at generated positions
    only agree too."""
    eager = model_pool.get("qwen3_moe")
    two = model_pool.get("qwen3_moe", "vllm", tensor_parallel_size=2)
    ids = eager.to_tokens(PROMPT)
    layer = eager.graph.moe_layers[-1]
    site, last = f"mlp_out.{layer}", f"resid_post.{eager.n_layers - 1}"
    x, _ = _block_io(eager, ids, layer)
    busy = _busy_expert(eager, ids, x, layer)
    spec = SteerSpec.zero(site, experts=sorted({busy, (busy + 3) % eager.graph.n_experts}))
    want = run_with_cache(eager, ids, [site, last], steer=spec)
    got = run_with_cache(two, ids, [site, last], steer=spec)
    assert not torch.allclose(want[site], run_with_cache(eager, ids, [site])[site])
    for point in (site, last):
        assert_close_scaled(got[point], want[point], msg=point)
    later = SteerSpec.zero(f"mlp_out.{eager.graph.moe_layers[0]}", positions="generated", experts=[2, 5])
    with steer(eager, later):
        ref = capture_generation(eager, ids, [site], max_tokens=5, temperature=0.0, n_logprobs=1)
    with steer(two, later):
        mine = capture_generation(two, ids, [site], max_tokens=5, temperature=0.0, n_logprobs=1)
    assert mine[0].token_ids == ref[0].token_ids
    assert_close_scaled(mine[1][site], ref[1][site])
