"""Points vLLM holds inside fused modules, read by the worker runtime: q, k, v (parts of the
fused qkv projection, or the per-head q/k norms' outputs where the model has them) and mlp_pre
(the gate part of the fused gate_up projection; GPT-2's and GPT-NeoX's unfused first MLP
layer), next to mlp_act (down_proj's input). Every architecture of the registry that vLLM runs,
every layer, against eager's capture and against the hand-written HF references, fp32 to 1e-5
of scale. And pattern, which vLLM's kernels never form: rebuilt in the worker from the queries
and keys each attention kernel receives, against eager and HF's own attention probabilities,
on a prompt and on generated rows. Where vLLM cannot serve a point exactly, the refusal comes
before any forward."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from interp_engine import (Address, CapabilityUnsupported, SteerSpec, capture_generation, load_model,
                           run_with_cache)
from interp_engine.testing import VLLM_ARCHS, assert_close_scaled, tiny_model
from specs import SPECS
from tests._reference import reference_outputs, reference_points

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm not installed")]

# longer than the tiny recipes' sliding windows (16), so a windowed layer's keys are cut
PROMPT = ("Once upon a time, in a land far away, there lived a café owner who baked bread "
          "every morning before the sun rose over the hills")
INTERNALS = ("q", "k", "v", "mlp_pre", "mlp_act")


def internal_addresses(model) -> list[Address]:
    """Every address of the fused-internal points the model has (MoE layers have no mlp_*)."""
    names = {p.name for p in model.points()}
    return [Address(n, layer) for n in INTERNALS if n in names for layer in model.graph.layers_of(n)]


def assert_internals_match(eager, vllm, tokens) -> None:
    """vLLM's captures of every internal point equal eager's and the HF reference's."""
    points = internal_addresses(eager)
    assert points, "no internal point to compare"
    ce, cv = run_with_cache(eager, tokens, points), run_with_cache(vllm, tokens, points)
    ref = reference_points(eager, tokens)
    for address in points:
        assert_close_scaled(cv[address], ce[address], msg=f"{eager.graph.arch} {address} vs eager")
        assert_close_scaled(cv[address], ref[(address.name, address.layer)],
                            msg=f"{eager.graph.arch} {address} vs the HF reference")


@pytest.mark.parametrize("arch", VLLM_ARCHS)
def test_every_internal_point_is_served_or_refused_with_a_reason(arch):
    spec = SPECS[arch]
    for name in INTERNALS:
        if name in spec.eager:
            assert name in spec.vllm or name in spec.vllm_refused, (arch, name)


@pytest.mark.parametrize("arch", VLLM_ARCHS)
def test_fused_internals_equal_eager_and_reference(model_pool, arch):
    eager, vllm = model_pool.get(arch), model_pool.get(arch, "vllm")
    served = {p.name for p in vllm.points() if p.vllm}
    assert {"q", "k", "v"} <= served, (arch, served)
    assert_internals_match(eager, vllm, eager.to_tokens(PROMPT))


@pytest.mark.parametrize("arch", VLLM_ARCHS)
def test_writes_at_fused_internals_equal_eager(model_pool, arch):
    """A write at q, k, v or mlp_pre edits only its part of vLLM's fused output (per head inside
    GPT-NeoX's per-head q | k | v groups), or the per-head norm's output where the point is
    read there; three parts of one projection written in one request; the written point read
    back in the same request. Against eager, whose writes at these points equal the HF
    references (tests/bridge/test_eager_ops.py)."""
    eager, vllm = model_pool.get(arch), model_pool.get(arch, "vllm")
    tokens = eager.to_tokens(PROMPT)
    g, L = eager.graph, 1
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(g.n_kv_heads, g.d_head, generator=gen)
    last = f"resid_post.{eager.n_layers - 1}"
    specs = [SteerSpec.zero(f"q.{L}", heads=[g.n_heads - 1]),
             SteerSpec.scale(f"k.{L}", 0.5, heads=[0], positions=(1, 2)),
             SteerSpec.add(f"v.{L}", kv, scale=2.0),
             SteerSpec.scale(f"q.{L}", 2.0, heads=[0]) | SteerSpec.mean(f"k.{L}", kv, heads=[g.n_kv_heads - 1])
             | SteerSpec.zero(f"v.{L}", heads=[0], positions=(3,))]
    served = {p.name for p in vllm.points() if p.vllm}
    layer = next((m for m in g.layers_of("mlp_pre") if m >= L), None) if "mlp_pre" in served else None
    if layer is not None:
        specs.append(SteerSpec.scale(f"mlp_pre.{layer}", 3.0, neurons=[0, 5]))
    plain = run_with_cache(eager, tokens, [last])[last]
    for spec in specs:
        reads = [last] + [str(op.address) for op in spec.ops]
        want, got = run_with_cache(eager, tokens, reads, steer=spec), run_with_cache(vllm, tokens, reads, steer=spec)
        assert not torch.allclose(want[last], plain), f"{arch} {spec} changes nothing"
        for point in reads:
            assert_close_scaled(got[point], want[point], msg=f"{arch} {spec}: {point}")


@pytest.mark.parametrize("arch", VLLM_ARCHS)
def test_pattern_equals_eager_and_hf_on_prompt_and_generated_rows(model_pool, hf_copies, arch):
    """The probabilities HF's eager attention reports (output_attentions: GQA, causal mask,
    sliding windows, Gemma 2's soft-cap, GPT-OSS's sinks), at every layer: on a prompt longer
    than the windows, and on a capture while generating (one row per decode step)."""
    eager, vllm = model_pool.get(arch), model_pool.get(arch, "vllm")
    assert "pattern" in {p.name for p in vllm.points() if p.vllm}, arch
    points = [Address("pattern", layer) for layer in range(eager.n_layers)]
    tokens = eager.to_tokens(PROMPT)
    _, theirs = reference_outputs(hf_copies[arch], tokens, with_attentions=True)
    cv, ce = run_with_cache(vllm, tokens, points), run_with_cache(eager, tokens, points)
    for a in points:
        assert_close_scaled(cv[a], ce[a], msg=f"{arch} {a} vs eager")
        assert_close_scaled(cv[a], theirs[a.layer], msg=f"{arch} {a} vs HF")
    completion, cg = capture_generation(vllm, tokens, points, max_tokens=4, temperature=0.0)
    fed = torch.cat([tokens, torch.tensor([list(completion.token_ids[:-1])], dtype=tokens.dtype)], dim=1)
    _, theirs = reference_outputs(hf_copies[arch], fed, with_attentions=True)
    for a in points:
        assert cg[a].shape == (1, eager.graph.n_heads, fed.shape[1], fed.shape[1]), (a, cg[a].shape)
        assert_close_scaled(cg[a], theirs[a.layer], msg=f"{arch} {a} while generating vs HF")


def test_refusals_before_any_forward():
    """Under tensor parallelism each rank holds a slice of the fused projection (and the queries
    and keys of its own heads only): refused, as is vllm-static, whose graph taps are
    residual-width only; no engine starts for either."""
    model = load_model(tiny_model("qwen3"), backend="vllm", tensor_parallel_size=2)
    tokens = model.to_tokens("Hi")
    for point, capability in (("q.0", "attention_internals"), ("v.2", "attention_internals"),
                              ("mlp_pre.1", "mlp_internals"), ("pattern.1", "attention_pattern")):
        with pytest.raises(CapabilityUnsupported, match="tensor_parallel_size=2") as info:
            run_with_cache(model, tokens, [point])
        assert info.value.capability == capability and "tensor_parallel_size=1" in info.value.instead
    for spec, capability in ((SteerSpec.zero("q.0", heads=[1]), "attention_internals"),
                             (SteerSpec.scale("mlp_pre.1", 2.0), "mlp_internals")):
        with pytest.raises(CapabilityUnsupported, match="write at .* tensor_parallel_size=2") as info:
            run_with_cache(model, tokens, [], steer=spec)
        assert info.value.capability == capability
    assert model.backend._llm is None
    for point in ("q.1", "k.1", "v.1", "mlp_pre.1", "mlp_act.1", "pattern.1"):
        with pytest.raises(CapabilityUnsupported, match=f"static_point.*{point}"):
            load_model(tiny_model("qwen3"), backend="vllm-static", static_points=[point])
    assert not any(p.vllm_static for p in model.points() if p.name in INTERNALS + ("pattern",))


def test_a_kernel_the_pattern_cannot_be_rebuilt_for_is_refused_by_name():
    """Each worker reads every layer's attention kernel when the engine starts; a kernel doing
    what the rebuild does not (ALiBi, keys of another layer, a quantised KV cache) refuses
    pattern at that layer before the request runs, naming why. (Fake kernel, no engine.)"""
    from types import SimpleNamespace

    from bridge.vllm.attention import mismatches

    impl = SimpleNamespace(scale=0.125, alibi_slopes=[0.5] * 4, logits_soft_cap=0, sinks=None)
    odd = SimpleNamespace(impl=impl, attn_type="decoder", sliding_window=None, kv_cache_dtype="fp8",
                          kv_sharing_target_layer_name="model.layers.0.self_attn.attn")
    plain = SimpleNamespace(impl=SimpleNamespace(scale=0.125), attn_type="decoder", sliding_window=None,
                            kv_cache_dtype="auto", kv_sharing_target_layer_name=None)
    root = SimpleNamespace(get_submodule=lambda path: odd if ".1." in path else plain)
    found = mismatches(root, SPECS["qwen3"], [0, 1, 2])
    assert list(found) == [1]
    assert all(s in found[1] for s in ("ALiBi", "model.layers.0.self_attn.attn", "fp8")), found[1]
    model = load_model(tiny_model("qwen3"), backend="vllm")  # lazy: no engine
    backend = model.backend
    backend._llm, backend._pattern_mismatch = object(), found  # as if started with that kernel
    try:
        with pytest.raises(CapabilityUnsupported, match="ALiBi") as info:
            run_with_cache(model, model.to_tokens("Hi"), ["pattern.1"])
        assert info.value.capability == "attention_pattern" and info.value.instead
    finally:
        backend._llm = None
