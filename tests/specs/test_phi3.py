"""Phi-3: fused qkv_proj and gate_up_proj served through a declared Split. The points are
checked against hand-cut parts of the HF outputs in tests/bridge/test_eager_capture.py (every
point of every registry arch); here: the split itself, and that its parts are really distinct."""

from __future__ import annotations

import pytest
import torch

from interp_engine import run_with_cache
from interp_engine._points import Split
from interp_engine.testing import tiny_graph
from specs import SPECS
from tests._reference import PROMPT, reference_points

TOL = dict(rtol=1e-5, atol=1e-5)


def test_split_bounds_follow_the_graph():
    g = tiny_graph("phi3")
    eager = SPECS["phi3"].eager
    q_w, kv_w = g.n_heads * g.d_head, g.n_kv_heads * g.d_head
    assert eager["q"].split.bounds(g) == (0, q_w)
    assert eager["k"].split.bounds(g) == (q_w, q_w + kv_w)
    assert eager["v"].split.bounds(g) == (q_w + kv_w, q_w + 2 * kv_w)
    assert eager["mlp_pre"].split.bounds(g) == (0, g.d_mlp)


def test_split_is_validated_and_compared_by_content():
    with pytest.raises(ValueError, match="index 3 out of range for 3 parts"):
        Split((("n_heads", "d_head"),) * 3, 3)
    assert Split([["d_mlp"], ["d_mlp"]], 0) == Split((("d_mlp",), ("d_mlp",)), 0)
    with pytest.raises(ValueError, match="unknown model dimension 'd_nope'"):
        Split((("d_nope",),), 0).bounds(tiny_graph("phi3"))


def test_fused_parts_equal_the_hf_modules_and_differ_from_each_other(eager_models):
    model = eager_models["phi3"]
    ids = model.to_tokens(PROMPT)
    names = ("q", "k", "v", "mlp_pre", "mlp_act")
    cache = run_with_cache(model, ids, [f"{n}.{L}" for n in names for L in range(model.n_layers)])
    ref = reference_points(model, ids)
    for L in range(model.n_layers):
        for n in names:
            torch.testing.assert_close(cache.get(n, L), ref[(n, L)], **TOL)
        # a split at a wrong offset would hand k's columns to v or q's to k: the parts differ
        assert not torch.allclose(cache.get("k", L), cache.get("v", L))
        # the gate half, not the up half: act(gate) * up is what enters down_proj
        hf_mlp = model.hf.model.layers[L].mlp
        up = ref[("mlp_act", L)] / hf_mlp.activation_fn(cache.get("mlp_pre", L))
        assert not torch.allclose(up, cache.get("mlp_pre", L), atol=1e-3)


def test_a_split_tap_on_a_writable_point_is_refused():
    import dataclasses

    from specs._base import QKV_PARTS, Tap

    phi3 = SPECS["phi3"]
    bad = {**phi3.eager, "attn_out": Tap(phi3.eager["q"].path, "out", None, Split(QKV_PARTS, 0))}
    with pytest.raises(ValueError, match="'attn_out' is writable"):
        dataclasses.replace(phi3, eager=bad)
