"""stop_at_layer (TransformerLens's argument) on eager: the forward runs layers 0..n-1 and no
further, the captures equal a full forward's, and what cannot exist (logits, points or writes at
layer n or later) is refused before any forward. Every architecture in the registry."""

from __future__ import annotations

import pytest
import torch

from interp_engine import SteerSpec, run, run_with_cache
from interp_engine._plan import Plan
from interp_engine.testing import TINY_ARCHS


def _layers_run(model):
    ran, handles = [], []
    for L in range(model.n_layers):
        module = model.hf.get_submodule(model.spec.eager["resid_pre"].module_path(L))
        handles.append(module.register_forward_hook(lambda mod, args, out, L=L: ran.append(L)))
    return ran, handles


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_stop_at_layer_runs_only_the_layers_before_it(model_pool, arch):
    model = model_pool.get(arch)
    ids = model.to_tokens("Hello there my friend")
    points = ["resid_post.0", "resid_pre.1"]
    full = run_with_cache(model, ids, points)
    ran, handles = _layers_run(model)
    try:
        cache = run_with_cache(model, ids, points, stop_at_layer=2)
        assert ran == [0, 1]
        ran.clear()
        ends = run_with_cache(model, ids, ["resid_pre.1"], stop_at_layer=1)  # the residual it ends with
        assert ran == [0] and torch.equal(ends["resid_pre.1"], full["resid_pre.1"])
        for p in points:
            assert torch.equal(cache[p], full[p]), p
        ran.clear()
        run_with_cache(model, ids, [], stop_at_layer=0)  # the embeddings alone
        assert ran == []
        spec = SteerSpec.add("mlp_out.0", torch.ones(model.d_model))  # writes before the stop apply
        want = run_with_cache(model, ids, ["resid_pre.1"], steer=spec)["resid_pre.1"]
        ran.clear()
        steered = run(model, ids, Plan(reads=["resid_pre.1"], writes=spec), stop_at_layer=1)
        assert ran == [0] and torch.equal(steered["resid_pre.1"], want)
        assert not torch.equal(want, full["resid_pre.1"])
    finally:
        for h in handles:
            h.remove()


def test_what_a_stopped_forward_cannot_give_is_refused_before_any_forward(model_pool):
    model = model_pool.get(TINY_ARCHS[0])
    ids = [3, 4, 5]
    ran, handles = _layers_run(model)
    try:
        with pytest.raises(ValueError, match="no logits"):
            run_with_cache(model, ids, ["resid_post.0"], stop_at_layer=1, return_logits=True)
        with pytest.raises(ValueError, match="resid_post.1: pass stop_at_layer=2"):
            run_with_cache(model, ids, ["resid_post.1"], stop_at_layer=1)
        with pytest.raises(ValueError, match="mlp_out.2"):
            run_with_cache(model, ids, ["resid_post.0"], stop_at_layer=1,
                           steer=SteerSpec.add("mlp_out.2", torch.ones(model.d_model)))
        with pytest.raises(ValueError, match=r"stop_at_layer must be an int in \[0, "):
            run_with_cache(model, ids, ["resid_post.0"], stop_at_layer=model.n_layers + 1)
        with pytest.raises(ValueError, match="stop_at_layer must be an int"):
            run_with_cache(model, ids, ["resid_post.0"], stop_at_layer=True)
        assert ran == []
    finally:
        for h in handles:
            h.remove()
