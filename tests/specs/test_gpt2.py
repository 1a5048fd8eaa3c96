"""GPT-2: LayerNorm with bias, learned positions, Conv1D weights, fused c_attn, tied
embeddings. Every point is checked against a hand-recomputed block in tests/_reference.py
(through tests/bridge/test_eager_capture.py), eager == vLLM in tests/bridge/vllm/test_backend.py;
here: what differs in kind from the Llama layout."""

from __future__ import annotations

import torch

from interp_engine import Address, head_contributions, run_with_cache
from tests._reference import PROMPT, assert_resid_mid_add_is_a_hand_add

TOL = dict(rtol=1e-5, atol=1e-5)


def test_head_contributions_read_conv1d_weights_as_in_by_out(eager_models):
    model = eager_models["gpt2"]
    g = model.graph
    ids = model.to_tokens(PROMPT)
    cache = run_with_cache(model, ids, [Address(n, L) for n in ("z", "attn_out") for L in range(g.n_layers)])
    for L in range(g.n_layers):
        c_proj = model.hf.transformer.h[L].attn.c_proj
        heads = head_contributions(model, cache, L)
        torch.testing.assert_close(heads.sum(2) + c_proj.bias, cache.get("attn_out", L), **TOL)
        h = 2
        w = c_proj.weight[h * g.d_head:(h + 1) * g.d_head]  # Conv1D rows are inputs
        torch.testing.assert_close(heads[:, :, h], cache.get("z", L)[:, :, h] @ w, **TOL)


def test_resid_pre_0_holds_the_learned_positions(eager_models):
    model = eager_models["gpt2"]
    ids = model.to_tokens(PROMPT)
    hf = model.hf
    with torch.no_grad():
        want = hf.transformer.wte(ids) + hf.transformer.wpe(torch.arange(ids.shape[1]))[None]
    torch.testing.assert_close(run_with_cache(model, ids, ["resid_pre.0"])["resid_pre.0"], want, **TOL)


def test_resid_mid_steering_equals_a_hand_written_hook(eager_models):
    """Adding v at resid_mid.1 == adding it to attention's output by hand (the block sums them)."""
    model = eager_models["gpt2"]
    assert_resid_mid_add_is_a_hand_add(model, model.hf.transformer.h[1].attn, index=0)
