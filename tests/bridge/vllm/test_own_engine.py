"""A user's own vLLM engine (here ``AsyncLLM``) carries the runtime through vLLM's public
surface alone: engine arguments, ``SamplingParams.extra_args`` and ``collective_rpc``. Numbers
are compared with the eager backend on the same weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from interp_engine import SteerSpec, capture_generation, generate_stream, steer
from interp_engine.testing import tiny_model

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from bridge.vllm.own import engine_kwargs, wire_request  # noqa: E402

ARCH = "qwen3"
N = 5


def test_engine_kwargs_add_the_runtime_and_refuse_what_contradicts_it():
    kwargs = engine_kwargs(dtype="float32", logits_processors=["my.module:Mine"])
    assert kwargs["worker_extension_cls"].endswith("InterpWorkerExtension")
    assert kwargs["logits_processors"][0] == "my.module:Mine" and len(kwargs["logits_processors"]) == 2
    assert kwargs["enforce_eager"] is True and kwargs["enable_prefix_caching"] is False
    with pytest.raises(ValueError, match="enforce_eager=False.*vllm-static"):
        engine_kwargs(enforce_eager=False)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        engine_kwargs(enable_prefix_caching=True)


def test_a_bad_plan_is_refused_before_any_engine(model_pool):
    eager = model_pool.get(ARCH)
    with pytest.raises(ValueError, match="resid_post.9"):
        wire_request(tiny_model(ARCH), points=["resid_post.9"])
    with pytest.raises(ValueError, match="d_model=128"):
        wire_request(eager, steer=SteerSpec.add("resid_post.1", torch.ones(64)))


def test_async_llm_steers_and_captures_concurrent_requests_like_eager(model_pool, monkeypatch):
    from vllm import SamplingParams, envs
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    eager = model_pool.get(ARCH)
    ids = eager.to_tokens("The capital of France is")[0].tolist()
    v = torch.randn(eager.d_model, generator=torch.Generator().manual_seed(3))
    spec = SteerSpec.add("resid_post.1", v / v.norm(), scale=3.0)
    steered = wire_request(tiny_model(ARCH), steer=spec)
    captured = wire_request(eager, points=["resid_post.1", "mlp_out.2"])

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU backend
    envs.disable_envs_cache()

    async def run():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(tiny_model(ARCH)), **engine_kwargs(dtype="float32", max_model_len=256, seed=0)))
        try:
            async def one(request):
                params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=1,
                                        extra_args=request.extra_args)
                last = None
                async for out in engine.generate({"prompt_token_ids": ids}, params, request_id=request.rid):
                    last = out
                return last

            outs = await asyncio.gather(one(steered), one(captured))
            answers = await engine.collective_rpc("interp_collect", args=captured.collect_args)
            return outs, captured.captures(answers)
        finally:
            engine.shutdown()

    (steered_out, captured_out), values = asyncio.run(run())

    with steer(eager, spec):
        want = list(generate_stream(eager, torch.tensor([ids]), max_tokens=N, temperature=0.0,
                                    stop_at_eos=False, n_logprobs=1))
    got = steered_out.outputs[0]
    assert list(got.token_ids) == [s.token_id for s in want]
    torch.testing.assert_close(torch.tensor([got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]),
                               torch.tensor([s.logprob for s in want]), rtol=1e-5, atol=1e-5)

    completion, cache = capture_generation(eager, torch.tensor([ids]), ["resid_post.1", "mlp_out.2"], max_tokens=N,
                                           temperature=0.0, stop_at_eos=False)
    plain = list(completion.token_ids)
    assert plain != list(got.token_ids), "the vector must change greedy tokens for this test to mean anything"
    assert list(captured_out.outputs[0].token_ids) == plain  # the steering stayed with its own request
    for address, value in values.items():
        torch.testing.assert_close(value, cache[address], rtol=1e-5, atol=1e-5)
