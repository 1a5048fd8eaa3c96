"""Mixtral (MixtralForCausalLM): the Llama attention layout with a routed MoE block in every
layer. Its router (``mlp.gate``) takes the softmax over all experts, keeps the top k and
renormalises them; it returns (logits, top-k weights, top-k indices) on flattened tokens.

vLLM runs Mixtral natively with the MoE block under ``block_sparse_moe``: its ``gate`` returns
the router logits; the top-k choice happens inside the fused MoE kernel, so the runtime
recomputes expert_weights and expert_indices from those logits with the same rule."""

from ._base import (COMMON_EAGER, COMMON_VLLM, COMMON_VLLM_WRITES, LAYER, TINY_SHAPE, ArchSpec, Routing,
                    Tap, TinyRecipe, VllmTap, build_graph, merged)

_TINY = TinyRecipe("MixtralConfig", seed=12, adds_bos=True, config={
    **TINY_SHAPE,
    "intermediate_size": 64,  # per expert
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
})


def _graph(config):
    n_layers = int(config.num_hidden_layers)
    return build_graph(SPEC, config, moe_layers=tuple(range(n_layers)),
                       n_experts=int(config.num_local_experts), top_k=int(config.num_experts_per_tok))


SPEC = ArchSpec(
    arch="mixtral",
    model_types=("mixtral",),
    hf_classes=("MixtralForCausalLM",),
    tiny={"tiny": _TINY},
    graph_from_config=_graph,
    eager=merged(
        COMMON_EAGER, mlp_pre=None, mlp_act=None,
        router_logits=Tap(LAYER + ".mlp.gate", "out0", "flat"),
        expert_weights=Tap(LAYER + ".mlp.gate", "out1", "flat"),
        expert_indices=Tap(LAYER + ".mlp.gate", "out2", "flat"),
    ),
    vllm=merged(COMMON_VLLM, mlp_pre=None, mlp_act=None,
                router_logits=VllmTap("module_out", LAYER + ".block_sparse_moe.gate"),
                expert_weights=VllmTap("route_weights", LAYER + ".block_sparse_moe.gate"),
                expert_indices=VllmTap("route_indices", LAYER + ".block_sparse_moe.gate")),
    vllm_writes=COMMON_VLLM_WRITES,
    routing=Routing(renormalize=True),  # vLLM's MixtralMoE: renormalize=True
)
