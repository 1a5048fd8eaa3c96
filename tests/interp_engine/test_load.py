"""Loading: local directories, hub names through the local HF cache only (failing fast and
naming the model), argument checks, dtype, and how the eager model is built."""

from __future__ import annotations

import json
import time

import pytest
import torch

from interp_engine import CapabilityUnsupported, ModelNotFound, SteerSpec, load_model, steer
from interp_engine._model import resolve_model_path
from tests._reference import PROMPT


def test_hub_name_missing_from_the_cache_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    name = "no-such-org/definitely-not-cached-model"
    start = time.monotonic()
    with pytest.raises(ModelNotFound) as info:
        load_model(name)
    assert time.monotonic() - start < 5.0
    message = str(info.value)
    assert repr(name) in message and "local Hugging Face cache" in message
    assert isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize("name, match", [
    ("./not/a/dir", "not found"),
    ("/abs/missing/dir", "not found"),
    ("plainname", "not found"),
    ("too/many/slashes", "not found"),
])
def test_bad_names(name, match):
    start = time.monotonic()
    with pytest.raises(ModelNotFound, match=match) as info:
        load_model(name)
    assert repr(name) in str(info.value)
    assert time.monotonic() - start < 5.0


def test_directory_without_config_and_a_file(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json"):
        load_model(tmp_path)
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    with pytest.raises(ModelNotFound, match="is a file"):
        load_model(file)


def test_unsupported_architecture_lists_supported(tmp_path):
    from specs import SPECS

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    with pytest.raises(ValueError) as info:
        load_model(tmp_path)
    message = str(info.value)
    assert "'bloom'" in message
    for spec in SPECS.values():
        for t in spec.model_types:
            assert t in message


def test_argument_checks(tiny_dirs):
    path = tiny_dirs["qwen3"]
    with pytest.raises(ValueError, match="unknown backend 'torch'"):
        load_model(path, backend="torch")
    with pytest.raises(CapabilityUnsupported, match="static_point"):  # no engine starts
        load_model(path, backend="vllm-static", static_points=["z.0"])
    with pytest.raises(CapabilityUnsupported, match="gradients"):
        load_model(path, backend="vllm", requires_grad=True)
    with pytest.raises(ValueError, match="static_points"):
        load_model(path, static_points="auto")
    with pytest.raises(TypeError, match="gpu_memory_utilization"):
        load_model(path, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_model(path, dtype="float8")


def test_local_directory_loads(tiny_dirs, eager_models):
    path = tiny_dirs["llama"]
    assert resolve_model_path(path) == path
    assert resolve_model_path(str(path)) == path
    model = eager_models["llama"]
    assert model.path == path and model.backend_name == "eager"
    assert model.dtype == torch.float32
    assert not model.hf.training
    assert "llama" in repr(model) and "3 layers" in repr(model)
    assert model.tok.eos_id == model.hf.config.eos_token_id
    ids = model.to_tokens(PROMPT)
    assert ids.dtype == torch.long and ids.shape[0] == 1
    assert model.to_string(ids) == PROMPT  # llama adds a BOS, which decodes away


def test_other_dtype(tiny_dirs):
    model = load_model(tiny_dirs["qwen3"], dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert next(model.hf.parameters()).dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"float32.*bfloat16"):
        with steer(model, SteerSpec.add("resid_post.0", torch.randn(model.d_model))):
            pass
    with steer(model, SteerSpec.add("resid_post.0", torch.randn(model.d_model, dtype=torch.bfloat16))):
        pass
    assert load_model(tiny_dirs["qwen3"], dtype=torch.float32).dtype == torch.float32


def test_gemma2_runs_the_attention_that_honours_soft_capping(eager_models, hf_copies):
    """SDPA drops Gemma 2's attention-logit soft-cap; the eager backend must not."""
    model = eager_models["gemma2"]
    assert model.hf.config.attn_logit_softcapping
    assert model.hf.config._attn_implementation == "eager"
    ids = model.to_tokens(PROMPT)
    with torch.no_grad():
        torch.testing.assert_close(model.hf(ids).logits, hf_copies["gemma2"](ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_hub_name_in_the_local_cache_loads(monkeypatch, tmp_path):
    """A hub name resolves through the local HF cache layout (models--org--name/snapshots/<rev>)."""
    import shutil

    import huggingface_hub.constants as hub_constants

    from interp_engine import load_model, run_with_cache
    from interp_engine.testing import tiny_model

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--Qwen--Qwen3-8B"
    shutil.copytree(tiny_model("qwen3"), repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    model = load_model("Qwen/Qwen3-8B")
    assert model.graph.arch == "qwen3" and model.path == repo / "snapshots" / revision
    reference = load_model(tiny_model("qwen3"))
    tokens = model.to_tokens("Hello")
    assert torch.equal(run_with_cache(model, tokens, ["resid_post.0"])["resid_post.0"],
                       run_with_cache(reference, tokens, ["resid_post.0"])["resid_post.0"])


@pytest.mark.vllm
def test_gemma2_in_float16_is_refused_at_load_on_vllm():
    pytest.importorskip("vllm")
    from interp_engine import CapabilityUnsupported, load_model
    from interp_engine.testing import tiny_model

    with pytest.raises(CapabilityUnsupported, match=r"float16.*gemma2.*bfloat16"):
        load_model(tiny_model("gemma2"), backend="vllm", dtype="float16")
