"""A Cache survives pickling (torch.save) and a safetensors round trip with every tensor,
the attention mask and its shape checks intact."""

from __future__ import annotations

import pickle

import pytest
import torch

from interp_engine import Address, Cache, CapabilityUnsupported, run_with_cache
from interp_engine.testing import TINY_ARCHS
from tests._reference import PROMPT, decoder_layers, final_norm


def _cache(model):
    return run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.0", "resid_post.1", "z.0"])


def _same(a: Cache, b: Cache) -> None:
    assert list(a) == list(b)
    for address in a:
        torch.testing.assert_close(a[address], b[address], rtol=0, atol=0)
    torch.testing.assert_close(a.attention_mask, b.attention_mask, rtol=0, atol=0)


def test_a_cache_pickles_and_torch_saves(eager_models, tmp_path):
    cache = _cache(eager_models["qwen3"])
    _same(cache, pickle.loads(pickle.dumps(cache)))
    torch.save(cache, tmp_path / "c.pt")
    _same(cache, torch.load(tmp_path / "c.pt", weights_only=False))


def test_save_and_load_round_trip_through_safetensors(eager_models, tmp_path):
    model = eager_models["qwen3"]
    cache = _cache(model)
    cache.save(tmp_path / "c.safetensors")
    back = Cache.load(tmp_path / "c.safetensors", graph=model.graph)
    _same(cache, back)
    assert back.graph is model.graph
    _same(cache, Cache.load(tmp_path / "c.safetensors"))


def test_load_refuses_a_file_not_written_by_save(tmp_path):
    from safetensors.torch import save_file

    save_file({"resid_post.0": torch.zeros(1, 2, 4)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not written by Cache.save"):
        Cache.load(tmp_path / "other.safetensors")


def test_load_checks_shapes_against_the_graph(eager_models, tmp_path):
    model = eager_models["qwen3"]
    Cache({Address("resid_post", 0): torch.zeros(1, 3, 5)}).save(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="resid_post.0 has shape"):
        Cache.load(tmp_path / "bad.safetensors", graph=model.graph)


@pytest.mark.vllm
def test_patterns_and_save_on_vllm_match_eager(model_pool, tmp_path):
    pytest.importorskip("vllm")
    eager, vllm = model_pool.get("qwen3"), model_pool.get("qwen3", "vllm")
    tokens = eager.to_tokens(PROMPT)
    on_vllm = run_with_cache(vllm, tokens, "resid_post.*")
    on_eager = run_with_cache(eager, tokens, "resid_post.*")
    assert list(on_vllm) == list(on_eager) == [Address("resid_post", i) for i in range(eager.graph.n_layers)]
    for address in on_eager:
        torch.testing.assert_close(on_vllm[address], on_eager[address], rtol=1e-4, atol=1e-4)
    on_vllm.save(tmp_path / "v.safetensors")
    _same(on_vllm, Cache.load(tmp_path / "v.safetensors", graph=vllm.graph))


def test_accumulated_and_decomposed_resid_match_the_hf_modules(eager_models):
    from tests._reference import reference_points

    model = eager_models["qwen3"]
    n = model.graph.n_layers
    tokens = model.to_tokens(PROMPT)
    ref = reference_points(model, tokens)
    cache = run_with_cache(model, tokens, "resid_*.*")
    acc, labels = cache.accumulated_resid(return_labels=True)
    assert labels == [f"resid_pre.{i}" for i in range(n)] + [f"resid_post.{n - 1}"]
    want = torch.stack([ref[("resid_pre", i)] for i in range(n)] + [ref[("resid_post", n - 1)]])
    torch.testing.assert_close(acc, want)
    assert cache.accumulated_resid(1, incl_mid=True).shape[0] == 2
    parts = run_with_cache(model, tokens, ["resid_pre.0", "attn_out.*", "mlp_out.*"]).decompose_resid()
    assert parts.shape[0] == 1 + 2 * n
    torch.testing.assert_close(parts.sum(0), ref[("resid_post", n - 1)], rtol=1e-4, atol=1e-5)
    with pytest.raises(KeyError, match="decompose_resid needs attn_out.0"):
        cache.decompose_resid()
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\]|layer must be an int"):
        cache.accumulated_resid(n + 1)


# ---- apply_ln: the norm's scale, checked on the HF norm modules -------------------------------

def _hf_affine(norm):
    """The weight and bias a HF norm module applies after normalising, from the classes' own
    forward: Gemma's RMSNorm multiplies by ``1 + weight``, the others by ``weight``; LayerNorm
    adds its bias."""
    weight = norm.weight.detach()
    if type(norm).__name__.startswith("Gemma"):
        weight = 1.0 + weight
    bias = getattr(norm, "bias", None)
    return weight, (torch.zeros_like(weight) if bias is None else bias.detach())


def _hf_eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", None) or norm.eps)


def _hf_input_norm(model, layer):
    block = decoder_layers(model.hf)[layer]
    return block.ln_1 if hasattr(block, "ln_1") else block.input_layernorm


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_apply_ln_is_the_hf_final_norm_less_its_weight_and_bias(eager_models, arch):
    """``weight * sum(components) + bias`` with apply_ln is the HF final norm module's output on
    the last resid_post, for the decomposition and for the accumulated stream's last entry;
    every entry is centred (LayerNorm) and divided by the one scale of the final residual
    (TransformerLens), computed here with the module's own epsilon; the graph's norm facts are
    the module's."""
    model = eager_models[arch]
    n = model.graph.n_layers
    tokens = model.to_tokens(PROMPT)
    cache = run_with_cache(model, tokens, ["resid_pre.*", "resid_post.*", "attn_out.*", "mlp_out.*"]
                           if arch != "deepseek_v4" else ["attn_out.*", "mlp_out.*"])
    if not model.residual_basis.lens_valid:
        with pytest.raises(CapabilityUnsupported, match="logit_lens"):
            cache.apply_ln_to_stack(torch.stack([cache["attn_out.0"]]))
        return
    norm = final_norm(model.hf)
    assert model.graph.final_norm.kind == ("layer" if isinstance(norm, torch.nn.LayerNorm) else "rms")
    assert model.graph.final_norm.eps == _hf_eps(norm)
    weight, bias = _hf_affine(norm)
    last = cache[f"resid_post.{n - 1}"]
    with torch.no_grad():
        want = norm(last)
    acc, labels = cache.accumulated_resid(apply_ln=True, return_labels=True)
    assert labels == [f"resid_pre.{i}" for i in range(n)] + [f"resid_post.{n - 1}"]
    torch.testing.assert_close(weight * acc[-1] + bias, want, rtol=1e-5, atol=1e-5)
    parts = cache.decompose_resid(apply_ln=True)
    torch.testing.assert_close(weight * parts.sum(0) + bias, want, rtol=1e-4, atol=1e-4)
    x = cache["resid_pre.1"]
    if isinstance(norm, torch.nn.LayerNorm):
        x = x - x.mean(-1, keepdim=True)
        spread = last.var(-1, keepdim=True, unbiased=False)
    else:
        spread = last.pow(2).mean(-1, keepdim=True)
    torch.testing.assert_close(acc[1], x / (spread + _hf_eps(norm)).sqrt(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache.accumulated_resid(), cache.accumulated_resid(apply_ln=False))


@pytest.mark.parametrize("arch", ["qwen3", "gpt2", "gemma2"])
def test_apply_ln_below_the_last_layer_is_that_blocks_input_norm(eager_models, arch):
    """At ``layer`` < n_layers the scale is the one block ``layer``'s input norm computes on
    resid_pre.{layer}: the decomposition's pieces sum, through the module's weight and bias, to
    that module's output; without resid_pre.{layer} in the cache it is named."""
    model = eager_models[arch]
    tokens = model.to_tokens(PROMPT)
    cache = run_with_cache(model, tokens, ["resid_pre.*", "attn_out.*", "mlp_out.*"])
    norm = _hf_input_norm(model, 2)
    weight, bias = _hf_affine(norm)
    with torch.no_grad():
        want = norm(cache["resid_pre.2"])
    parts = cache.decompose_resid(layer=2, apply_ln=True)
    assert parts.shape[0] == 5
    torch.testing.assert_close(weight * parts.sum(0) + bias, want, rtol=1e-4, atol=1e-4)
    acc = cache.accumulated_resid(layer=2, apply_ln=True)
    assert acc.shape[0] == 2
    partial = run_with_cache(model, tokens, ["resid_pre.0", "resid_pre.1"])
    with pytest.raises(KeyError, match="resid_pre.2"):
        partial.accumulated_resid(layer=2, apply_ln=True)
    with pytest.raises(KeyError, match="resid_post.2"):
        partial.apply_ln_to_stack(torch.stack([partial["resid_pre.0"]]))


def _hf_mlp_norm(model, layer):
    """The norm module that reads the stream before block ``layer``'s MLP, by the HF classes'
    own forward: GPT-2's ln_2, Gemma 2's pre_feedforward_layernorm (its
    post_attention_layernorm normalises the attention output), the others'
    post_attention_layernorm."""
    block = decoder_layers(model.hf)[layer]
    for name in ("ln_2", "pre_feedforward_layernorm", "post_attention_layernorm"):
        if hasattr(block, name):
            return getattr(block, name)
    raise AssertionError(type(block).__name__)


@pytest.mark.parametrize("arch", ["qwen3", "gpt2", "gemma2"])
def test_mlp_input_is_what_that_blocks_mlp_norm_reads(eager_models, arch):
    """``mlp_input=True`` ends the stack at resid_mid.{layer} (the accumulated stream) or
    attn_out.{layer} (the decomposition), and apply_ln divides by the scale of that MLP's own
    input norm: the pieces sum, through the HF module's weight and bias, to its output."""
    model = eager_models[arch]
    tokens = model.to_tokens(PROMPT)
    cache = run_with_cache(model, tokens, ["resid_pre.*", "resid_mid.*", "attn_out.*", "mlp_out.*"])
    norm = _hf_mlp_norm(model, 1)
    weight, bias = _hf_affine(norm)
    with torch.no_grad():
        want = norm(cache["resid_mid.1"])
    acc, labels = cache.accumulated_resid(layer=1, mlp_input=True, apply_ln=True, return_labels=True)
    assert labels == ["resid_pre.0", "resid_pre.1", "resid_mid.1"]
    torch.testing.assert_close(weight * acc[-1] + bias, want, rtol=1e-5, atol=1e-5)
    parts, labels = cache.decompose_resid(layer=1, mlp_input=True, apply_ln=True, return_labels=True)
    assert labels == ["resid_pre.0", "attn_out.0", "mlp_out.0", "attn_out.1"]
    torch.testing.assert_close(weight * parts.sum(0) + bias, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="mlp_input=True needs the layer"):
        cache.accumulated_resid(mlp_input=True)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\] with mlp_input"):
        cache.decompose_resid(layer=3, mlp_input=True)


def test_mlp_input_is_refused_where_attention_and_mlp_run_in_parallel(eager_models):
    model = eager_models["gpt_neox"]
    cache = run_with_cache(model, model.to_tokens(PROMPT), ["resid_pre.*", "attn_out.*", "mlp_out.*"])
    with pytest.raises(ValueError, match="in parallel"):
        cache.decompose_resid(layer=1, mlp_input=True)


@pytest.mark.parametrize("pos_slice", [-1, 2, [0, 3], (1, 2), slice(1, None, 2)])
def test_pos_slice_keeps_those_positions_and_their_own_scales(eager_models, pos_slice):
    """pos_slice picks positions before stacking (an int drops the axis, as in TransformerLens),
    and apply_ln divides each kept position by its own scale: the same numbers as the full
    stack indexed afterwards."""
    model = eager_models["qwen3"]
    cache = run_with_cache(model, model.to_tokens(PROMPT), ["resid_pre.*", "resid_mid.*", "resid_post.*",
                                                             "attn_out.*", "mlp_out.*"])
    index = (slice(None), slice(None), pos_slice if not isinstance(pos_slice, tuple) else list(pos_slice))
    for kwargs in (dict(), dict(layer=1, mlp_input=True), dict(layer=2)):
        for method in (cache.accumulated_resid, cache.decompose_resid):
            full = method(apply_ln=True, **kwargs)
            part = method(apply_ln=True, pos_slice=pos_slice, **kwargs)
            torch.testing.assert_close(part, full[index], rtol=0, atol=0)
            assert (part.dim() == 3) == isinstance(pos_slice, int)
    with pytest.raises(IndexError, match="outside"):
        cache.accumulated_resid(pos_slice=[0, 999])
    with pytest.raises(TypeError, match="pos_slice must be"):
        cache.accumulated_resid(pos_slice="last")


def test_the_capture_method_checks_the_rows_the_backend_hands_back(eager_models, monkeypatch):
    """``model.capture_generation`` returns a plain dict, not a Cache: its rows are still held
    to the graph's shapes (check_shapes), so a backend that hands back a position too few is
    caught there, naming the point."""
    import asyncio

    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)[0].tolist()
    _, rows = asyncio.run(model.capture_generation(ids, ["resid_post.0"], max_tokens=2, temperature=0.0))
    assert tuple(rows[Address("resid_post", 0)].shape) == (1, len(ids) + 1, model.d_model)
    assemble = model.backend.assemble
    monkeypatch.setattr(model.backend, "assemble",
                        lambda plan, capture: {a: t[:, :-1] for a, t in assemble(plan, capture).items()})
    with pytest.raises(ValueError, match=r"resid_post\.0"):
        asyncio.run(model.capture_generation(ids, ["resid_post.0"], max_tokens=2, temperature=0.0))
