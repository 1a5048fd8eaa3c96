"""expert_indices / expert_weights on vLLM: recomputed in the worker from the captured router
logits with the architecture's routing rule, equal to eager's (indices exactly, weights to 1e-5)
at prompt and generated positions, for every MoE architecture vLLM serves (from the registry).

Ties: the two engines' router logits differ by rounding (at most 2.1e-6 measured on these
models), so where two logits at the top-k boundary (or inside the top k) are closer than that,
the engines may honestly pick or order differently. These fixed inputs are checked to hold no
such near-tie (every gap > 2e-5, ten times the measured difference; the smallest gap here is
6.8e-5), so exact equality is a fair demand and cannot flake; if a weight change ever puts a
near-tie there, the margin assertion names it instead of the comparison failing obscurely.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from interp_engine import CapabilityUnsupported, capture_generation, expert_assignment, run_with_cache
from interp_engine.testing import MOE_ARCHS, VLLM_ARCHS, assert_close_scaled
from specs import SPECS

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm not installed")]

ROUTED_ON_VLLM = [a for a in MOE_ARCHS if a in VLLM_ARCHS]  # from the spec registry
PROMPTS = ("Once upon a time, in a land far away", "def add(a, b):")
MARGIN = 2e-5


def test_every_moe_architecture_vllm_runs_declares_its_routing():
    assert ROUTED_ON_VLLM
    for arch in ROUTED_ON_VLLM:
        spec = SPECS[arch]
        assert spec.routing is not None, arch
        assert {"expert_indices", "expert_weights"} <= set(spec.vllm), arch


def min_margin(logits: torch.Tensor, top_k: int) -> float:
    """Smallest gap between consecutive logits among the top k + 1 (scale-relative): below the
    engines' rounding difference, the selection or its order may honestly differ."""
    top = torch.topk(logits.float(), top_k + 1, dim=-1).values
    scale = max(1.0, float(logits.abs().max()))
    return float((top[..., :-1] - top[..., 1:]).min()) / scale


@pytest.mark.parametrize("arch", ROUTED_ON_VLLM)
def test_selection_equals_eager_at_prompt_and_generated_positions(model_pool, arch):
    eager = model_pool.get(arch)
    vllm = model_pool.get(arch, "vllm", enable_prompt_embeds=True)
    g = eager.graph
    assert vllm.backend._routing_mismatch == {}  # vLLM's own routers follow the declared rule
    points = [f"{n}.{L}" for n in ("expert_indices", "expert_weights") for L in g.moe_layers]
    for prompt in PROMPTS:
        ids = eager.to_tokens(prompt)[0].tolist()
        completion, cv = capture_generation(vllm, ids, points, max_tokens=5, temperature=0.0)
        fed = ids + list(completion.token_ids[:-1])
        assert len(fed) > len(ids)  # generated positions are compared too
        ce = run_with_cache(eager, fed, points + [f"router_logits.{L}" for L in g.moe_layers])
        for L in g.moe_layers:
            margin = min_margin(ce.get("router_logits", L), g.top_k)
            assert margin > MARGIN, f"{arch} layer {L}: a near-tie ({margin:.2g}) makes this input unfit"
            idx_v, idx_e = cv.get("expert_indices", L), ce.get("expert_indices", L)
            assert idx_v.shape == idx_e.shape == (1, len(fed), g.top_k)
            assert torch.equal(idx_v, idx_e), (arch, L)
            assert_close_scaled(cv.get("expert_weights", L), ce.get("expert_weights", L), 1e-5,
                                msg=f"{arch} expert_weights.{L}")
            # expert_assignment takes the served selection, no top_k needed
            torch.testing.assert_close(expert_assignment(cv, L, g.n_experts),
                                       expert_assignment(ce, L, g.n_experts), atol=1e-5, rtol=1e-5)


def test_a_layer_whose_vllm_router_routes_otherwise_is_refused_before_any_forward(model_pool, monkeypatch):
    arch = ROUTED_ON_VLLM[0]
    vllm = model_pool.get(arch, "vllm", enable_prompt_embeds=True)
    layer = vllm.graph.moe_layers[0]
    before = vllm.backend.worker_stats()[0]["forwards"]
    monkeypatch.setattr(vllm.backend, "_routing_mismatch", {layer: "vLLM's router at x uses grouped top-k"})
    with pytest.raises(CapabilityUnsupported, match="grouped top-k") as info:
        run_with_cache(vllm, [3, 4, 5], [f"expert_weights.{layer}"])
    assert info.value.capability == "expert_selection" and info.value.instead
    assert vllm.backend.worker_stats()[0]["forwards"] == before  # refused before any forward
    run_with_cache(vllm, [3, 4, 5], [f"router_logits.{layer}"])  # the logits stay served


def _moe_tree(router, routed=None):
    """A stand-in for vLLM's Qwen3-MoE model tree (one layer): the gate module next to the MoE
    runner ``experts`` that holds ``router`` (and ``routed_experts``)."""
    from torch import nn

    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module()])
    mlp = root.model.layers[0].mlp = nn.Module()
    mlp.gate = nn.Linear(2, 8)
    mlp.experts = nn.Module()
    mlp.experts.router = router
    if routed is not None:
        mlp.experts.routed_experts = routed
    return root


def test_router_check_names_each_difference_from_the_rule():
    """bridge/vllm/routing.mismatches on vLLM's own CPU router objects (no engine)."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from bridge.vllm.routing import mismatches

    spec, tree = SPECS["qwen3_moe"], _moe_tree
    same = CPURouter(top_k=2, global_num_experts=8, renormalize=True)
    assert mismatches(tree(same), spec, (2, True), [0]) == {}
    other = CPURouter(top_k=2, global_num_experts=8, renormalize=False, scoring_func="sigmoid")
    why = mismatches(tree(other), spec, (2, True), [0])[0]
    assert "renormalize=False" in why and "sigmoid" in why
    assert "top_k=2" in mismatches(tree(same), spec, (4, True), [0])[0]


def test_expert_write_check_names_why_a_layer_cannot_take_one():
    """bridge/vllm/routing.expert_write_refusals on vLLM's CPU router (no engine): served where
    the fused experts weight each output by the router's weights, refused otherwise."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from bridge.vllm.routing import expert_write_refusals

    spec = SPECS["qwen3_moe"]

    def tree(router, monolithic=False, on_input=False):
        return _moe_tree(router, SimpleNamespace(quant_method=SimpleNamespace(is_monolithic=monolithic),
                                                 apply_router_weight_on_input=on_input))

    router = CPURouter(top_k=2, global_num_experts=8, renormalize=True)
    assert expert_write_refusals(tree(router), spec, [0]) == {}
    assert "monolithic" in expert_write_refusals(tree(router, monolithic=True), spec, [0])[0]
    assert "experts' input" in expert_write_refusals(tree(router, on_input=True), spec, [0])[0]
    assert "no router" in expert_write_refusals(tree(SimpleNamespace()), spec, [0])[0]
    assert "no vLLM MoE layer" in expert_write_refusals(tree(router), spec, [1])[1]
