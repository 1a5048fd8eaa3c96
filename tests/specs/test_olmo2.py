"""OLMo 2: post-norm placement (no norm before a sublayer; each sublayer's output is normed
before it is added), q/k normed over all heads together. Every point is checked against the HF
modules in tests/bridge/test_eager_capture.py and eager == vLLM (through vLLM's Transformers
backend, the default door) in tests/bridge/vllm/test_backend.py; here: what post-norm changes,
and the door itself."""

from __future__ import annotations

import torch

from interp_engine import run_with_cache
from specs import SPECS
from tests._reference import PROMPT, assert_resid_mid_add_is_a_hand_add

TOL = dict(rtol=1e-5, atol=1e-5)


def test_sublayers_read_the_raw_residual_and_add_a_normed_output(eager_models):
    model = eager_models["olmo2"]
    g = model.graph
    ids = model.to_tokens(PROMPT)
    names = ("resid_pre", "resid_mid", "attn_out", "mlp_out", "q", "z")
    cache = run_with_cache(model, ids, [f"{n}.{L}" for n in names for L in range(model.n_layers)])
    for L in range(model.n_layers):
        layer = model.hf.model.layers[L]
        attn = layer.self_attn
        with torch.no_grad():
            q = attn.q_norm(attn.q_proj(cache.get("resid_pre", L)))  # no norm in front
            attn_out = layer.post_attention_layernorm(attn.o_proj(cache.get("z", L).flatten(-2)))
            mlp_out = layer.post_feedforward_layernorm(layer.mlp(cache.get("resid_mid", L)))
        torch.testing.assert_close(cache.get("q", L), q.view(1, -1, g.n_heads, g.d_head), **TOL)
        torch.testing.assert_close(cache.get("attn_out", L), attn_out, **TOL)
        torch.testing.assert_close(cache.get("mlp_out", L), mlp_out, **TOL)


def test_resid_mid_steering_reaches_the_mlp_and_the_residual(eager_models):
    """Adding v at resid_mid.1 == adding it to post_attention_layernorm's output by hand."""
    model = eager_models["olmo2"]
    assert_resid_mid_add_is_a_hand_add(model, model.hf.model.layers[1].post_attention_layernorm, seed=2)


def test_the_transformers_backend_is_the_default_door():
    """A spec with no vLLM map (and no stated refusal) runs through vLLM's Transformers
    backend, its map the eager one under the backend's root; a stated refusal stays one."""
    spec = SPECS["olmo2"]
    assert spec.vllm_model_impl == "transformers" and spec.vllm_served
    assert spec.vllm["resid_mid"].path == "model.layers.{L}.mlp" == spec.eager["resid_mid"].path
    assert spec.vllm["attn_out"].source == "module_out"
    assert spec.vllm_final_norm_path == "model.norm"
    # q and k at the HF norms; v and mlp_pre as parts of what vLLM's fusers merge the HF projections into
    assert spec.vllm["q"].path == "model.layers.{L}.self_attn.q_norm" and spec.vllm["q"].split is None
    assert spec.vllm["v"].path.endswith("self_attn.qkv_proj") and spec.vllm["v"].split.index == 2
    assert spec.vllm["mlp_pre"].path.endswith("mlp.gate_up_proj") and spec.vllm["mlp_pre"].split.index == 0
    neox = SPECS["gpt_neox"]
    assert neox.vllm_model_impl == "transformers"
    assert neox.vllm["resid_pre"].path == "model.layers.{L}" and neox.vllm_final_norm_path == "model.final_layer_norm"
    assert not SPECS["deepseek_v4"].vllm_served and SPECS["deepseek_v4"].vllm_model_impl == ""
    for native in ("qwen3", "gpt2", "gemma3", "mixtral"):
        assert SPECS[native].vllm_model_impl == ""


def test_vllm_fused_only_amends_the_derived_map():
    """vllm_fused replaces taps of the map derived for the Transformers backend; a spec with its
    own vLLM map writes its taps there, so both at once is refused at construction."""
    import dataclasses

    import pytest

    spec = SPECS["olmo2"]
    assert dict(spec.vllm_fused).keys() == {"v", "mlp_pre"}
    with pytest.raises(ValueError, match="vllm_fused amends"):
        dataclasses.replace(SPECS["qwen3"], vllm_fused={"v": spec.vllm["v"]})
    copy = dataclasses.replace(spec, arch="olmo2_copy")  # a copy of a derived spec keeps its map
    assert copy.vllm == spec.vllm
