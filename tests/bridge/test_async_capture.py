"""The async capture method (model.capture_generation): a plain dict keyed by Address, the
same rows as the sync capture_generation, and concurrent captures that keep to their request."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from interp_engine import Address, SteerSpec, capture_generation

BACKENDS = ["eager", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm not installed")])]
PROMPTS = ("The capital of France is", "Once upon a time", "A café in Paris sells bread, cheese and")


@pytest.fixture(params=BACKENDS)
def model(request, model_pool):
    if request.param == "eager":
        return model_pool.get("qwen3")
    return model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)


def test_async_capture_is_a_plain_dict_equal_to_the_sync_capture(model):
    tokens = model.to_tokens(PROMPTS[0])
    points = ["resid_post.0", Address("z", 1)]
    completion, values = asyncio.run(model.capture_generation(tokens, points, max_tokens=5, temperature=0.0))
    assert type(values) is dict and set(values) == {Address("resid_post", 0), Address("z", 1)}
    with pytest.raises(KeyError):
        values["resid_post.0"]
    sync_completion, cache = capture_generation(model, tokens, points, max_tokens=5, temperature=0.0)
    assert completion.token_ids == sync_completion.token_ids and completion.text == sync_completion.text
    for address, tensor in values.items():
        assert tensor.shape[1] == tokens.shape[1] + len(completion.token_ids) - 1
        torch.testing.assert_close(tensor, cache[address], atol=1e-5, rtol=1e-5)


def test_async_capture_takes_point_patterns_as_the_sync_capture_does(model):
    tokens = model.to_tokens(PROMPTS[1])
    completion, values = asyncio.run(model.capture_generation(tokens, ["resid_post.*", "z.1"], max_tokens=3,
                                                              temperature=0.0))
    expected = [Address("resid_post", layer) for layer in range(model.n_layers)] + [Address("z", 1)]
    assert list(values) == expected
    _, cache = capture_generation(model, tokens, ["resid_post.*", "z.1"], max_tokens=3, temperature=0.0)
    assert list(cache) == expected
    for address in expected:
        torch.testing.assert_close(values[address], cache[address], atol=1e-5, rtol=1e-5)


def test_concurrent_async_captures_keep_to_their_request(model):
    spec = SteerSpec.add("resid_post.1", torch.ones(model.d_model), scale=2.0)
    jobs = [(model.to_tokens(p), spec if i == 1 else None) for i, p in enumerate(PROMPTS)]

    async def together():
        return await asyncio.gather(*[model.capture_generation(t, ["resid_post.2"], max_tokens=4,
                                                               temperature=0.0, steer=s) for t, s in jobs])

    results = asyncio.run(together())
    for (tokens, s), (completion, values) in zip(jobs, results):
        alone_completion, alone = asyncio.run(model.capture_generation(
            tokens, ["resid_post.2"], max_tokens=4, temperature=0.0, steer=s))
        assert completion.token_ids == alone_completion.token_ids
        key = Address("resid_post", 2)
        torch.testing.assert_close(values[key], alone[key], atol=1e-5, rtol=1e-5)
