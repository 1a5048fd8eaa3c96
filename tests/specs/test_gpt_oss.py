"""GPT-OSS: attention sinks, a biased top-k-then-softmax router, clamped-SwiGLU experts with
biases. Every point is checked against the HF modules in tests/bridge/test_eager_capture.py (the
router recomputed from its input in tests/_reference.py) and eager == vLLM in
tests/bridge/vllm/test_backend.py; here: the sinks and the experts by hand (routing on vLLM:
tests/bridge/vllm/test_routing.py)."""

from __future__ import annotations

import torch

from interp_engine import run_with_cache
from tests._reference import PROMPT

TOL = dict(rtol=1e-5, atol=1e-5)


def test_pattern_is_what_attention_applies_and_the_sink_takes_a_share(eager_models):
    """z = pattern @ v per head (so pattern is the weights really applied), and every row sums
    to less than 1: the sink's share is dropped."""
    model = eager_models["gpt_oss"]
    g = model.graph
    ids = model.to_tokens(PROMPT)
    cache = run_with_cache(model, ids, [f"{n}.{L}" for n in ("pattern", "v", "z") for L in range(g.n_layers)])
    group = g.n_heads // g.n_kv_heads
    for L in range(g.n_layers):
        pattern, v, z = cache.get("pattern", L)[0], cache.get("v", L)[0], cache.get("z", L)[0]
        sums = pattern.sum(-1)
        assert torch.all(sums < 1) and torch.all(sums > 0) and float((1 - sums).mean()) > 0.01
        for h in range(g.n_heads):
            torch.testing.assert_close(z[:, h], pattern[h] @ v[:, h // group], **TOL)


def test_mlp_out_is_the_selected_clamped_swiglu_experts(eager_models):
    model = eager_models["gpt_oss"]
    ids = model.to_tokens(PROMPT)
    names = ("resid_mid", "mlp_out", "expert_indices", "expert_weights")
    cache = run_with_cache(model, ids, [f"{n}.{L}" for n in names for L in range(model.n_layers)])
    limit, alpha = model.hf.config.swiglu_limit, model.hf.config.swiglu_alpha
    for L in range(model.n_layers):
        layer = model.hf.model.layers[L]
        ex = layer.mlp.experts
        with torch.no_grad():
            x = layer.post_attention_layernorm(cache.get("resid_mid", L))[0]
            idx, w = cache.get("expert_indices", L)[0], cache.get("expert_weights", L)[0]
            want = torch.zeros_like(x)
            for pos in range(x.shape[0]):
                for k in range(idx.shape[-1]):
                    e = int(idx[pos, k])
                    gate_up = x[pos] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
                    gate = gate_up[0::2].clamp(max=limit)  # gate and up are interleaved
                    up = gate_up[1::2].clamp(-limit, limit)
                    hidden = (up + 1) * gate * torch.sigmoid(alpha * gate)
                    want[pos] += w[pos, k] * (hidden @ ex.down_proj[e] + ex.down_proj_bias[e])
        torch.testing.assert_close(cache.get("mlp_out", L)[0], want, **TOL)
