"""GPT-NeoX / Pythia: parallel blocks and a per-head fused query_key_value. Every point is
checked against a hand-recomputed parallel block in tests/_reference.py (through
tests/bridge/test_eager_capture.py), eager == vLLM (Transformers backend) in
tests/bridge/vllm/test_backend.py; here: what a parallel block changes."""

from __future__ import annotations

import pytest
import torch

from interp_engine import CapabilityUnsupported, SteerSpec, run_with_cache, steer
from tests._reference import PROMPT

TOL = dict(rtol=1e-5, atol=1e-5)


def test_resid_mid_is_refused_by_capability_and_described(eager_models):
    model = eager_models["gpt_neox"]
    assert "resid_mid" not in {p.name for p in model.points()}
    assert "resid_mid has no meaning" in model.residual_basis.describe()
    with pytest.raises(CapabilityUnsupported, match="sequential_block.*resid_mid") as info:
        run_with_cache(model, model.to_tokens(PROMPT), ["resid_mid.1"])
    assert "resid_pre, attn_out and mlp_out" in str(info.value)
    with pytest.raises(CapabilityUnsupported, match="sequential_block"):
        with steer(model, SteerSpec.add("resid_mid.0", torch.ones(model.d_model))):
            run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.0"])


def test_resid_post_is_the_sum_of_both_branches_on_resid_pre(eager_models):
    model = eager_models["gpt_neox"]
    names = ("resid_pre", "attn_out", "mlp_out", "resid_post")
    cache = run_with_cache(model, model.to_tokens(PROMPT), [f"{n}.{L}" for n in names for L in range(model.n_layers)])
    for L in range(model.n_layers):
        torch.testing.assert_close(cache.get("resid_post", L), cache.get("resid_pre", L)
                                   + cache.get("attn_out", L) + cache.get("mlp_out", L), **TOL)


def test_steering_attn_out_does_not_reach_the_mlp_of_the_same_layer(eager_models):
    """In a parallel block the MLP reads resid_pre, not resid_pre + attn_out."""
    model = eager_models["gpt_neox"]
    ids = model.to_tokens(PROMPT)
    v = torch.randn(model.d_model, generator=torch.Generator().manual_seed(1))
    plain = run_with_cache(model, ids, ["mlp_out.1", "mlp_out.2"])
    with steer(model, SteerSpec.add("attn_out.1", v, scale=3.0)):
        steered = run_with_cache(model, ids, ["mlp_out.1", "mlp_out.2"])
    torch.testing.assert_close(steered["mlp_out.1"], plain["mlp_out.1"], **TOL)
    assert not torch.allclose(steered["mlp_out.2"], plain["mlp_out.2"], atol=1e-3)


def test_lens_at_the_last_layer_is_the_logits(eager_models):
    model = eager_models["gpt_neox"]
    ids = model.to_tokens(PROMPT)
    last = f"resid_post.{model.n_layers - 1}"
    logits, cache = run_with_cache(model, ids, [last], return_logits=True)
    hf = model.hf
    with torch.no_grad():
        mine = hf.lm_head(hf.gpt_neox.final_layer_norm(cache[last]))
    torch.testing.assert_close(mine, logits, **TOL)
    torch.testing.assert_close(model.backend.decode(cache[last]), logits, **TOL)
