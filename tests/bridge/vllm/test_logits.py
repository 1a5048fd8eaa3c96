"""The final position's logits on vLLM (``return_logits="last"``): vLLM's own final norm and
head in the worker on its last residual, equal to eager's logits (the HF forward) to 1e-5
relative; every other position is refused by capability before any forward."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from interp_engine import Address, CapabilityUnsupported, SteerSpec, run_with_cache
from interp_engine.testing import VLLM_ARCHS, assert_close_scaled

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm not installed")]


@pytest.mark.parametrize("arch", VLLM_ARCHS)
def test_final_position_logits_equal_eager(model_pool, arch):
    eager = model_pool.get(arch)
    vllm = model_pool.get(arch, "vllm", enable_prompt_embeds=True)
    ids = eager.to_tokens("Once upon a time, in a land far away")
    full, _ = run_with_cache(eager, ids, [], return_logits=True)
    last_v, cache = run_with_cache(vllm, ids, ["resid_post.0"], return_logits="last")
    last_e, _ = run_with_cache(eager, ids, [], return_logits="last")
    assert last_v.shape == last_e.shape == (1, eager.d_vocab)
    assert Address("resid_post", eager.n_layers - 1) not in cache  # only what was asked is kept
    assert_close_scaled(last_e, full[:, -1], 1e-5, msg="eager last vs full")
    assert_close_scaled(last_v, full[:, -1], 1e-5, msg=f"{arch} vLLM final logits")
    # steering reaches them: a write at the last layer moves the logits as on eager
    L = eager.n_layers - 1
    spec = SteerSpec.add(f"resid_post.{L}", torch.randn(eager.d_model, generator=torch.Generator().manual_seed(0)),
                         scale=4.0)
    steered_e, _ = run_with_cache(eager, ids, [], return_logits="last", steer=spec)
    steered_v, _ = run_with_cache(vllm, ids, [], return_logits="last", steer=spec)
    assert float((steered_e - last_e).abs().max()) > 1e-2
    assert_close_scaled(steered_v, steered_e, 1e-5, msg=f"{arch} steered final logits")


def test_other_positions_are_refused_before_any_forward(model_pool):
    vllm = model_pool.get(VLLM_ARCHS[-1], "vllm", enable_prompt_embeds=True)
    before = vllm.backend.worker_stats()[0]["forwards"]
    with pytest.raises(CapabilityUnsupported, match="every position") as info:
        run_with_cache(vllm, [3, 4, 5], ["resid_post.0"], return_logits=True)
    assert info.value.capability == "logits_in_stream" and "'last'" in info.value.instead
    assert vllm.backend.worker_stats()[0]["forwards"] == before
    with pytest.raises(TypeError, match="'last'"):
        run_with_cache(vllm, [3, 4, 5], [], return_logits="first")


def test_stop_at_layer_on_vllm_gives_the_same_captures(model_pool):
    """vLLM always runs every layer; the captures before the stop are the same, and what the
    stopped forward cannot give is refused by the core before any forward."""
    vllm = model_pool.get(VLLM_ARCHS[-1], "vllm", enable_prompt_embeds=True)
    eager = model_pool.get(VLLM_ARCHS[-1])
    ids = [3, 4, 5, 6]
    points = ["resid_post.0", "resid_pre.1"]
    stopped = run_with_cache(vllm, ids, points, stop_at_layer=1)
    full = run_with_cache(eager, ids, points)
    for p in points:
        assert_close_scaled(stopped[p], full[p], 1e-5, msg=p)
    before = vllm.backend.worker_stats()[0]["forwards"]
    with pytest.raises(ValueError, match="no logits"):
        run_with_cache(vllm, ids, ["resid_post.0"], stop_at_layer=1, return_logits="last")
    with pytest.raises(ValueError, match="resid_post.1"):
        run_with_cache(vllm, ids, ["resid_post.1"], stop_at_layer=1)
    assert vllm.backend.worker_stats()[0]["forwards"] == before
