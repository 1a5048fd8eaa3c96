"""A Cache survives pickling (torch.save) and a safetensors round trip with every tensor,
the attention mask and its shape checks intact."""

from __future__ import annotations

import pickle

import pytest
import torch

from interp_engine import Address, Cache, run_with_cache
from tests._reference import PROMPT


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
