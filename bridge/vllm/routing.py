"""MoE routing inside the vLLM worker: the rule the spec declares, and a check that vLLM's own
router applies that rule.

vLLM's fused MoE selects the experts from the router logits inside its kernel and never returns
the selection, so the runtime recomputes it from the logits it captures at the router
(``interp_engine._ops.route``). That is exact only if vLLM routes by the same rule: softmax
scoring, no grouped top-k, no custom routing function, no score-correction bias, no routed
scaling, the same k and the same renormalisation. ``mismatches`` reads vLLM's router object of
each MoE layer at start-up and names every difference, so the client refuses the selection
points before any forward instead of serving numbers vLLM did not use.
"""

from __future__ import annotations

from typing import Any

from specs import ArchSpec

__all__ = ["Rule", "expert_write_refusals", "experts_path", "mismatches", "rule_of"]

Rule = tuple[int, bool]  # (top_k, renormalize)


def rule_of(spec: ArchSpec, hf_config: Any) -> Rule | None:
    """The spec's routing rule for this checkpoint, or None when it declares none."""
    if spec.routing is None:
        return None
    return int(hf_config.num_experts_per_tok), spec.routing.renormalizes(hf_config)


def _differences(router: Any, rule: Rule) -> list[str]:
    top_k, renormalize = rule
    found = []
    if getattr(router, "top_k", top_k) != top_k:
        found.append(f"top_k={router.top_k}, the model's config says {top_k}")
    if bool(getattr(router, "renormalize", renormalize)) != renormalize:
        found.append(f"renormalize={router.renormalize}, the spec's rule says {renormalize}")
    if getattr(router, "scoring_func", "softmax") != "softmax":
        found.append(f"scoring_func={router.scoring_func!r}, not softmax")
    if getattr(router, "use_grouped_topk", False):
        found.append("grouped top-k")
    if getattr(router, "custom_routing_function", None) is not None:
        found.append("a custom routing function")
    if getattr(router, "e_score_correction_bias", None) is not None:
        found.append("a score-correction bias")
    if float(getattr(router, "routed_scaling_factor", 1.0)) != 1.0:
        found.append(f"routed_scaling_factor={router.routed_scaling_factor}")
    return found


def experts_path(spec: ArchSpec, layer: int) -> str | None:
    """vLLM's MoE runner of ``layer`` (next to the router module, as ``experts``), or None
    where the architecture's vLLM map names no router."""
    tap = spec.vllm.get("router_logits") or spec.vllm.get("expert_indices")
    if tap is None:
        return None
    return tap.module_path(layer).rsplit(".", 1)[0] + ".experts"


def expert_write_refusals(root: Any, spec: ArchSpec, layers: list[int]) -> dict[int, str]:
    """Layer -> why an ``experts=`` write cannot be served there (empty: every MoE layer can).
    The runtime scales the routing weights vLLM's router hands the fused experts
    (``router.select_experts``), which is exact where the kernel multiplies each expert's output
    by its weight; refused where the kernel routes from the logits itself (monolithic) or
    applies the weights to the experts' input."""
    out = {}
    for layer in layers:
        path = experts_path(spec, layer)
        if path is None:
            out[layer] = "this architecture's vLLM map names no MoE router"
            continue
        try:
            runner = root.get_submodule(path)
        except AttributeError:
            out[layer] = f"no vLLM MoE layer found at {path}"
            continue
        router, routed = getattr(runner, "router", None), getattr(runner, "routed_experts", None)
        if router is None or not callable(getattr(router, "select_experts", None)) or routed is None:
            out[layer] = f"vLLM's MoE layer at {path} has no router whose selection the runtime can reach"
        elif getattr(getattr(routed, "quant_method", None), "is_monolithic", False):
            out[layer] = f"vLLM's fused MoE kernel at {path} routes from the logits itself (monolithic)"
        elif getattr(routed, "apply_router_weight_on_input", False):
            out[layer] = (f"vLLM's fused MoE at {path} applies the routing weights to the experts' input, "
                          "so scaling a weight does not scale that expert's share")
    return out


def mismatches(root: Any, spec: ArchSpec, rule: Rule | None, layers: list[int]) -> dict[int, str]:
    """Layer -> why vLLM's router there does not follow ``rule`` (empty: every layer does).
    vLLM's MoE runner sits next to the router module, as ``experts``, and holds ``router``."""
    tap = spec.vllm.get("expert_indices")
    if tap is None or rule is None:
        return {}
    out = {}
    for layer in layers:
        parent = tap.module_path(layer).rsplit(".", 1)[0]
        try:
            router = root.get_submodule(parent + ".experts").router
        except AttributeError:
            out[layer] = f"no vLLM MoE router found at {parent}.experts"
            continue
        found = _differences(router, rule)
        if type(router).__name__ not in ("CPURouter", "FusedTopKRouter"):
            found.append(f"router {type(router).__name__}, whose rule interp_engine has not checked")
        if found:
            out[layer] = f"vLLM's router at {parent} uses " + "; ".join(found)
    return out
