"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention, a routed MoE block in every sparse layer."""

from ._base import (COMMON_EAGER, COMMON_VLLM, COMMON_VLLM_WRITES, LAYER, QK_NORM_VLLM, TINY_SHAPE, ArchSpec,
                    Routing, Tap, TinyRecipe, VllmTap, build_graph, merged)

_TINY = TinyRecipe("Qwen3MoeConfig", seed=4, config={
    **TINY_SHAPE,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
    "norm_topk_prob": True,
})


def _graph(config):
    n_layers = int(config.num_hidden_layers)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", []) or [])
    moe = tuple(i for i in range(n_layers)
                if i not in dense and int(config.num_experts) > 0 and (i + 1) % step == 0)
    d_mlp = int(config.intermediate_size) if len(moe) < n_layers else None
    return build_graph(SPEC, config, moe_layers=moe, n_experts=int(config.num_experts),
                       top_k=int(config.num_experts_per_tok), d_mlp=d_mlp)


# Only a config with mlp_only_layers has dense MLP layers (the tiny recipe has none).
_DENSE_MLP = ("the dense (mlp_only_layers) MLP layers of Qwen3-MoE are not mapped in its vLLM taps; "
              "every other layer is a routed MoE block, which has no single MLP hidden layer")

SPEC = ArchSpec(
    arch="qwen3_moe",
    model_types=("qwen3_moe",),
    hf_classes=("Qwen3MoeForCausalLM",),
    tiny={"tiny": _TINY},
    graph_from_config=_graph,
    eager=merged(
        COMMON_EAGER,
        q=Tap(LAYER + ".self_attn.q_norm", "out"),
        k=Tap(LAYER + ".self_attn.k_norm", "out"),
        # The router returns (logits, top-k weights, top-k indices) on flattened tokens.
        router_logits=Tap(LAYER + ".mlp.gate", "out0", "flat"),
        expert_weights=Tap(LAYER + ".mlp.gate", "out1", "flat"),
        expert_indices=Tap(LAYER + ".mlp.gate", "out2", "flat"),
    ),
    vllm=merged(COMMON_VLLM, **QK_NORM_VLLM, mlp_pre=None, mlp_act=None,
                router_logits=VllmTap("module_out", LAYER + ".mlp.gate"),
                expert_weights=VllmTap("route_weights", LAYER + ".mlp.gate"),
                expert_indices=VllmTap("route_indices", LAYER + ".mlp.gate")),
    vllm_refused={name: _DENSE_MLP for name in ("mlp_pre", "mlp_act")},
    vllm_writes=COMMON_VLLM_WRITES,
    # softmax over all experts, top-k, renormalised when norm_topk_prob (vLLM: renormalize=norm_topk_prob)
    routing=Routing(renormalize="norm_topk_prob"),
)
