"""Seeded sampling agrees across backends: with the same seed, temperature, top_k, top_p and min_p,
eager and a vLLM engine (CPU) draw the same tokens, on every vLLM-served tiny architecture.

Eager repeats vLLM's CPU sampler (interp_engine/_sampler.py). Exact agreement cannot hold
where the two engines' logits differ by rounding and that difference decides the draw: the
Gumbel race between the two tokens is closer than the logit difference can move it. A
divergence is therefore accepted only at such a near-tie, measured on eager's own logits
(``_LOGIT_ROUNDING``, below), and nothing after it is compared (the two prefixes differ from there).

Temperatures are those vLLM serves, [0, 2]; vLLM raises one in (0, 0.01) to 0.01, and so
does eager.
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given, strategies as st

from interp_engine import generate_stream
from interp_engine._sampler import MIN_TEMPERATURE, draw_seed, filter_logits, gumbel_scores, new_generator
from interp_engine.testing import VLLM_ARCHS  # every vLLM-served architecture in the registry
from strategies import token_ids

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")

# fp32 logits of the tiny models agree across engines to ~1e-5 absolute (greedy law in
# test_laws.py: logprobs to 2e-5); after dividing by the temperature a race margin below
# 1e-4 / temperature is inside that rounding, so either token is a correct draw.
_LOGIT_ROUNDING = 1e-4


def sampling_params():
    return st.fixed_dictionaries({
        "temperature": st.sampled_from([0.0, 1e-6, 0.3, 0.7, 1.0, 1.6, 2.0]),
        "top_k": st.sampled_from([0, 1, 3, 20, 100]),
        "top_p": st.sampled_from([1.0, 0.95, 0.7, 0.2]),
        "min_p": st.sampled_from([0.0, 0.0, 0.05, 0.3]),
        "seed": st.integers(0, 2**63),
    })


@pytest.fixture(params=[pytest.param(a, marks=[needs_vllm, pytest.mark.vllm]) for a in VLLM_ARCHS])
def pair(request, model_pool):
    return model_pool.get(request.param), model_pool.get(request.param, "vllm", enable_prompt_embeds=True)


def assert_same_draws(eager, vllm, ids, params, max_tokens=8) -> None:
    e = list(generate_stream(eager, ids, max_tokens=max_tokens, stop_at_eos=False, **params))
    v = list(generate_stream(vllm, ids, max_tokens=max_tokens, stop_at_eos=False, **params))
    generator = new_generator(params["seed"])
    for step, (a, b) in enumerate(zip(e, v)):
        key = None if params["temperature"] == 0 else draw_seed(generator)
        if a.token_id == b.token_id:
            continue
        if key is None:  # greedy: the race is the logits themselves
            temperature, race = 1.0, a.logits.double()
        else:
            temperature = max(params["temperature"], MIN_TEMPERATURE)
            race = gumbel_scores(filter_logits(a.logits, temperature, params["top_k"], params["top_p"],
                                                 params.get("min_p", 0.0)), key)
        # each engine's token must win the race run on eager's logits, up to the rounding
        behind = {t: float(race.max() - race[t]) for t in (a.token_id, b.token_id)}
        assert max(behind.values()) < _LOGIT_ROUNDING / temperature, (
            f"step {step}: eager drew {a.token_id}, vLLM drew {b.token_id} with {params}; behind the "
            f"race winner by {behind}: no near-tie")
        return
    assert len(e) == len(v) == max_tokens


def test_seeded_sampling_agrees_across_backends(pair):
    eager, vllm = pair

    @given(ids=token_ids(eager, max_size=10), params=sampling_params())
    def law(ids, params):
        assert_same_draws(eager, vllm, ids, params)
    law()


@needs_vllm
@pytest.mark.vllm
def test_a_seed_ignored_on_eager_breaks_the_law(model_pool, monkeypatch):
    """The planted bug: eager's request generator no longer seeded."""
    import bridge.eager

    eager, vllm = model_pool.get("qwen3"), model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)
    real = bridge.eager.new_generator
    monkeypatch.setattr(bridge.eager, "new_generator", lambda seed: real(None))
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_same_draws(eager, vllm, [1, 2, 3], dict(temperature=1.0, top_k=0, top_p=1.0, seed=5))
    monkeypatch.undo()
    assert_same_draws(eager, vllm, [1, 2, 3], dict(temperature=1.0, top_k=0, top_p=1.0, seed=5))


@needs_vllm
@pytest.mark.vllm
def test_min_p_ignored_on_eager_breaks_the_law(model_pool, monkeypatch):
    """The planted bug: eager's sampler drops min_p (vLLM applies it): the draws part."""
    import bridge.eager

    eager, vllm = model_pool.get("qwen3"), model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)
    params = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3, seed=5)
    real = bridge.eager.sample_token
    monkeypatch.setattr(bridge.eager, "sample_token",
                        lambda logits, t, g, k, p, min_p=0.0: real(logits, t, g, k, p))
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_same_draws(eager, vllm, [1, 2, 3], params)
    monkeypatch.undo()
    assert_same_draws(eager, vllm, [1, 2, 3], params)
