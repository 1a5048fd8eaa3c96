"""Capabilities are data, answerable before any forward: the CAPABILITIES table, the
refusal error, and what a loaded eager model says about itself."""

from __future__ import annotations

import pytest

from interp_engine import (CAPABILITIES, POINTS, Capability, CapabilityUnsupported, GradSupport,
                           ResidualBasis)
from interp_engine._points import BACKENDS
from tests._reference import count_forwards


def test_every_capability_is_documented():
    assert CAPABILITIES
    for name, cap in CAPABILITIES.items():
        assert isinstance(cap, Capability) and cap.name == name
        assert isinstance(cap.why, str) and len(cap.why) > 20, name
        assert isinstance(cap.instead, str) and len(cap.instead) > 5, name
        assert isinstance(cap.backends, frozenset) and cap.backends <= set(BACKENDS), name
        for backend in BACKENDS:
            assert cap.served_by(backend) == (backend in cap.backends)
    with pytest.raises(TypeError):
        CAPABILITIES["new"] = CAPABILITIES["gradients"]  # type: ignore[index]


def test_points_name_existing_capabilities():
    for spec in POINTS.values():
        if spec.capability is not None:
            assert spec.capability in CAPABILITIES, spec.name
        if not (spec.vllm and spec.vllm_static):
            # a point some backend cannot serve says which capability explains the refusal
            assert spec.capability in CAPABILITIES or spec.name in ("z", "router_logits"), spec.name


def test_refusal_message_names_capability_why_and_instead():
    exc = CapabilityUnsupported("gradients", "vllm")
    assert exc.capability == "gradients" and exc.backend == "vllm"
    message = str(exc)
    assert "gradients" in message and "'vllm'" in message
    assert CAPABILITIES["gradients"].why in message and CAPABILITIES["gradients"].instead in message
    custom = CapabilityUnsupported("static_graph", "eager", detail="extra detail", why="because", instead="do x")
    assert "extra detail" in str(custom) and "because" in str(custom) and "do x" in str(custom)
    assert isinstance(exc, RuntimeError)


def test_model_facts_without_a_forward(eager_model, arch):
    model = eager_model
    with count_forwards(model.hf) as calls:
        assert model.backend_name == "eager"
        assert model.hooks_available is True
        assert model.graph_replay is False
        assert model.static_points == () and model.static_writes == ()
        assert model.n_layers == 3 and model.d_model == 128 and model.d_vocab == 512
        assert model.n_layers == model.hf.config.num_hidden_layers
        assert model.d_model == model.hf.config.hidden_size
        grad = model.grad_support
        assert isinstance(grad, GradSupport) and grad.backend == "eager"
        assert grad.through_forward and not grad.to_parameters
        assert "frozen" in grad.describe() and "eager" in grad.describe()
        basis = model.residual_basis
        assert isinstance(basis, ResidualBasis)
        names = [p.name for p in model.points()]
        repr(model)
    assert calls == []
    if arch == "deepseek_v4":
        assert (basis.n_streams, basis.additive, basis.lens_valid) == (4, False, False)
        assert "4 parallel residual streams" in basis.describe() and "not valid" in basis.describe()
        assert "resid_streams" in names
    else:
        assert (basis.n_streams, basis.additive, basis.lens_valid) == (1, True, True)
        assert "one additive residual stream" in basis.describe() and "logit lens valid" in basis.describe()
        assert "resid_streams" not in names
    cfg = model.hf.config  # routed experts, as the HF config says (not the spec)
    moe = any(getattr(cfg, k, 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    for name in ("router_logits", "expert_weights", "expert_indices"):
        assert (name in names) == moe, name
    for name in ("mlp_pre", "mlp_act"):
        assert (name in names) == (not moe), name  # every layer of the tiny MoE models is sparse
    assert (arch == "deepseek_v4") == ("q" not in names)
    for spec in model.points():
        assert spec.served_by("eager")
        assert model.graph.layers_of(spec.name), spec.name


def test_grad_support_of_a_trainable_model(model_pool):
    model = model_pool.get("qwen3", "eager", requires_grad=True)
    with count_forwards(model.hf) as calls:
        grad = model.grad_support
    assert calls == []
    assert grad.through_forward and grad.to_parameters
    assert "parameters" in grad.describe()


def test_point_table_per_model(eager_models):
    qwen = eager_models["qwen3"]
    by_name = {p.name: p for p in qwen.points()}
    assert by_name["pattern"].vllm and not by_name["pattern"].vllm_static  # rebuilt from the kernel's q, k
    for name in ("q", "k", "v", "mlp_pre", "mlp_act"):  # read inside vLLM's fused modules by the hook runtime
        assert by_name[name].vllm and not by_name[name].vllm_static, name
    assert by_name["resid_post"].vllm and by_name["z"].vllm
    assert by_name["resid_post"].writable and not by_name["z"].writable
    ds = {p.name: p for p in eager_models["deepseek_v4"].points()}
    assert ds["resid_post"].dims == ("batch", "pos", "n_streams", "d_model")
    assert not ds["resid_post"].writable and ds["mlp_out"].writable
    assert not any(p.vllm for p in ds.values())  # no vLLM path for DeepSeek-V4 here
    assert ds["resid_streams"].per_stream
