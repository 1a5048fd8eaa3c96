"""Shapes checked for real at the public entry points: the dimension names bound to the loaded
model's own sizes, so a wrong width is reported against the model's d_model; a Cache that
refuses a tensor whose shape is not its point's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from interp_engine import (DIMS, Address, Cache, ShapeError, SteerSpec, decode_residuals,
                           head_contributions, run_with_cache, top_logprobs)
from jaxtyping import Float

from interp_engine._shapes import entry, model_dims
from tests._reference import PROMPT, count_forwards


def test_the_public_entry_points_are_checked():
    import interp_engine as ie
    from interp_engine import Model

    for fn, params in ((ie.run_with_cache, {"tokens"}), (ie.capture_generation, {"tokens"}),
                       (ie.generate_stream, {"tokens"}), (ie.decode_residuals, {"resid"}),
                       (ie.top_logprobs, {"logits"}), (Model.generate_text, {"token_ids"}),
                       (Model.generate_from_embeds, {"embeds"}), (Model.decode_residuals, {"cache"}),
                       (Model.capture_generation, {"token_ids"})):
        assert set(fn.__entry_checked__) == params, fn


def test_a_wrong_width_names_the_models_d_model(eager_models):
    model = eager_models["qwen3"]
    with count_forwards(model.hf) as calls:
        with pytest.raises(ShapeError, match=r"resid is a tensor of shape \[2, 5, 64\].*"
                                             r"float \[\*lead, d_model\] with d_model=128 on this qwen3 model"):
            decode_residuals(model, torch.randn(2, 5, 64))
        with pytest.raises(ShapeError, match=r"d_model=128"):
            model.decode_residuals(torch.randn(7))
        with pytest.raises(ShapeError, match=r"embeds .*\[4, 100\].*d_model=128"):
            asyncio.run(model.generate_from_embeds(torch.randn(4, 100)))
        with pytest.raises(ShapeError, match=r"dtype torch.int64"):
            decode_residuals(model, torch.zeros(3, 128, dtype=torch.long))
    assert calls == []
    # the right width passes, whatever the leading dims
    assert decode_residuals(model, torch.randn(2, 3, 128)).shape == (2, 3, model.d_vocab)


def test_dims_are_bound_per_call_not_per_process(eager_models):
    """The same function on a model of another width binds that width (one memo per call)."""
    @entry
    def g(model, x: Float[torch.Tensor, "pos d_model"]):
        return x.shape

    small = type("M", (), {"graph": type("G", (), {})()})()
    for name, value in dict(d_model=16, d_vocab=10, n_heads=2, n_kv_heads=1, d_head=8, d_mlp=32,
                            n_experts=0, top_k=0, residual_basis=type("B", (), {"n_streams": 1})(),
                            arch="toy").items():
        setattr(small.graph, name, value)
    assert g(small, torch.zeros(3, 16)) == (3, 16)
    assert g(eager_models["qwen3"], torch.zeros(3, 128)) == (3, 128)
    with pytest.raises(ShapeError, match="d_model=16 on this toy"):
        g(small, torch.zeros(3, 128))
    assert set(model_dims(small.graph)) == {"d_model", "d_vocab", "n_heads", "n_kv_heads", "d_head",
                                            "d_mlp", "n_streams"}
    assert set(model_dims(small.graph)) <= set(DIMS)


def test_tokens_of_the_wrong_kind_are_refused_before_any_forward(eager_models):
    model = eager_models["qwen3"]
    with count_forwards(model.hf) as calls:
        with pytest.raises(ShapeError, match=r"tokens is a tensor of shape \[1, 2, 3\]"):
            run_with_cache(model, torch.zeros(1, 2, 3, dtype=torch.long), ["resid_post.0"])
        with pytest.raises(TypeError, match=r"dtype torch.float32, expected int"):
            run_with_cache(model, torch.zeros(1, 3), ["resid_post.0"])
    assert calls == []


def test_top_logprobs_checks_its_logits():
    with pytest.raises(ShapeError, match=r"logits is a tensor of shape \[2, 5\].*\[d_vocab\]"):
        top_logprobs(torch.zeros(2, 5), 1)


# ---- Cache ---------------------------------------------------------------------------------

def test_a_cache_refuses_a_tensor_of_the_wrong_shape(eager_models):
    model = eager_models["qwen3"]
    g = model.graph
    mask = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"resid_post.1 has shape \[7\], expected \[batch, pos, d_model\]"):
        Cache({Address("resid_post", 1): torch.zeros(7)})
    with pytest.raises(ValueError, match=r"resid_post.1 has shape \[1, 4, 64\], expected \[1, 4, 128\]"):
        Cache({Address("resid_post", 1): torch.zeros(1, 4, 64)}, mask, g)
    with pytest.raises(ValueError, match=r"z.0 has shape \[1, 4, 4, 16\].*d_head is 32"):
        Cache({Address("z", 0): torch.zeros(1, 4, 4, 16)}, mask, g)
    with pytest.raises(ValueError, match=r"pattern.0 .*\[1, 4, 4, 5\]"):
        Cache({Address("pattern", 0): torch.zeros(1, g.n_heads, 4, 5)}, mask, g)
    with pytest.raises(ValueError, match=r"layer 9 out of range"):
        Cache({Address("resid_post", 9): torch.zeros(1, 4, 128)}, mask, g)
    with pytest.raises(ValueError, match=r"pos is 4 here"):  # two entries disagree, no graph
        Cache({Address("resid_post", 0): torch.zeros(1, 4, 128), Address("mlp_out", 0): torch.zeros(1, 5, 128)})
    with pytest.raises(TypeError, match="torch.Tensor"):
        Cache({Address("resid_post", 0): [0.0] * 128})
    ok = Cache({"resid_post.1": torch.zeros(1, 4, 128), Address("z", 0): torch.zeros(1, 4, 4, 32)}, mask, g)
    assert set(ok) == {Address("resid_post", 1), Address("z", 0)}  # string keys become addresses


def test_every_cache_the_library_returns_carries_its_graph(eager_models):
    model = eager_models["qwen3"]
    cache = run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.0", "z.1", "pattern.2"])
    assert cache.graph is model.graph
    assert cache.to("cpu").graph is model.graph
    contributions = head_contributions(model, cache, 1)
    assert contributions.shape == (1, cache["z.1"].shape[1], model.graph.n_heads, model.d_model)


def test_steering_vectors_of_the_wrong_width_name_d_model(eager_models):
    model = eager_models["qwen3"]
    from interp_engine import steer

    with pytest.raises(ValueError, match=r"width 64, expected d_model=128"):
        with steer(model, SteerSpec.add("resid_post.0", torch.randn(64))):
            pass
