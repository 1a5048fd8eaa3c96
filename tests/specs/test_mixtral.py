"""Mixtral: a routed MoE block in every layer (softmax over all experts, top-2, renormalised).
Every point is checked against the HF modules in tests/bridge/test_eager_capture.py (the router
recomputed from its input in tests/_reference.py) and eager == vLLM in
tests/bridge/vllm/test_backend.py; here: that the selection we report is the one the experts
apply (routing on vLLM: tests/bridge/vllm/test_routing.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from interp_engine import run_with_cache
from tests._reference import PROMPT

TOL = dict(rtol=1e-5, atol=1e-5)


def test_mlp_out_is_the_selected_experts_weighted_sum(eager_models):
    """mlp_out recomputed by hand from the HF expert weights, using only the reported
    expert_indices / expert_weights: a wrong selection or weight would not add up."""
    model = eager_models["mixtral"]
    ids = model.to_tokens(PROMPT)
    names = ("resid_mid", "mlp_out", "expert_indices", "expert_weights")
    cache = run_with_cache(model, ids, [f"{n}.{L}" for n in names for L in range(model.n_layers)])
    for L in range(model.n_layers):
        layer = model.hf.model.layers[L]
        experts = layer.mlp.experts
        with torch.no_grad():
            x = layer.post_attention_layernorm(cache.get("resid_mid", L))[0]  # [pos, d_model]
        idx, w = cache.get("expert_indices", L)[0], cache.get("expert_weights", L)[0]
        assert idx.shape[-1] == 2 and len(set(idx[0].tolist())) == 2
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[0]), **TOL)
        want = torch.zeros_like(x)
        for pos in range(x.shape[0]):
            for k in range(idx.shape[-1]):
                e = int(idx[pos, k])
                gate, up = F.linear(x[pos], experts.gate_up_proj[e]).chunk(2, dim=-1)
                want[pos] += w[pos, k] * F.linear(F.silu(gate) * up, experts.down_proj[e])
        torch.testing.assert_close(cache.get("mlp_out", L)[0], want.detach(), **TOL)
