"""Gemma 3: four norms per layer, q/k norms applied with heads before positions, sliding-window
layers (window 16 in the tiny recipe) alternating with a global one. Every point is checked
against the HF modules in tests/bridge/test_eager_capture.py and eager == vLLM in
tests/bridge/vllm/test_backend.py; here: what differs in kind from Gemma 2."""

from __future__ import annotations

import torch

from interp_engine import run_with_cache
from tests._reference import PROMPT, assert_resid_mid_add_is_a_hand_add

TOL = dict(rtol=1e-5, atol=1e-5)
LONG = "The cat sat on the mat while the dog slept by the door, and the train left at nine."


def test_sliding_layers_honour_the_window_and_the_global_one_does_not(eager_models):
    model = eager_models["gemma3"]
    window = model.hf.config.sliding_window
    kinds = model.hf.config.layer_types
    ids = model.to_tokens(LONG)
    assert ids.shape[1] > window + 4 and set(kinds) == {"sliding_attention", "full_attention"}
    cache = run_with_cache(model, ids, [f"pattern.{L}" for L in range(model.n_layers)])
    q = torch.arange(ids.shape[1])
    causal = q[:, None] >= q[None, :]
    outside = (q[:, None] - q[None, :]) >= window
    for L, kind in enumerate(kinds):
        pattern = cache.get("pattern", L)[0]
        if kind == "sliding_attention":
            assert torch.all(pattern[:, outside] == 0), L
            assert torch.all(pattern[:, causal & ~outside] > 0), L
        else:
            assert torch.all(pattern[:, causal] > 0), L


def test_q_and_k_are_normed_per_head_with_positions_before_heads(eager_models):
    """The q_norm output is [batch, heads, pos, d_head]; the point is [batch, pos, heads, d_head]
    and equals q_norm applied by hand to q_proj's output cut into heads."""
    model = eager_models["gemma3"]
    ids = model.to_tokens(PROMPT)
    g = model.graph
    cache = run_with_cache(model, ids, ["resid_pre.1", "q.1", "k.1"])
    attn = model.hf.model.layers[1].self_attn
    with torch.no_grad():
        x = model.hf.model.layers[1].input_layernorm(cache["resid_pre.1"])
        q = attn.q_norm(attn.q_proj(x).view(1, -1, g.n_heads, g.d_head))
        k = attn.k_norm(attn.k_proj(x).view(1, -1, g.n_kv_heads, g.d_head))
    torch.testing.assert_close(cache["q.1"], q, **TOL)
    torch.testing.assert_close(cache["k.1"], k, **TOL)


def test_resid_mid_steering_adds_after_the_post_attention_norm(eager_models):
    """Adding v at resid_mid.1 == adding it to post_attention_layernorm's output by hand."""
    model = eager_models["gemma3"]
    assert_resid_mid_add_is_a_hand_add(model, model.hf.model.layers[1].post_attention_layernorm)
