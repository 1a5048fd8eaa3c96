"""GPT-OSS (GptOssForCausalLM): the Llama layout with biased projections, alternating
sliding-window and global attention, a learned attention sink per head (an extra logit in each
softmax that takes probability mass and adds no value), and a routed MoE in every layer.

Its router (``mlp.router``, biased) keeps the top-k logits and takes the softmax over those
alone, which equals the renormalised top-k of the softmax over all experts (so
``expert_assignment`` recomputes it from router_logits); the MoE block returns
``(hidden, router_scores)``. The experts use a clamped SwiGLU, so mlp_pre/mlp_act have no dense
counterpart. ``pattern`` holds the probabilities over the keys: with the sink's share dropped,
a row sums to less than 1. Transformers runs sinks only in its eager attention kernel.

vLLM runs GPT-OSS natively (its CPU attention kernel applies the sinks; its fused MoE the
clamped SwiGLU): attention is ``attn`` there, the router ``mlp.router`` returns the logits
alone (the runtime recomputes the selection from them, bias included), and the decoder layer
is called with hidden_states first."""

from ._base import (COMMON_EAGER, COMMON_VLLM, COMMON_VLLM_WRITES, LAYER, QKV_PARTS, TINY_SHAPE, ArchSpec,
                    Routing, Split, Tap, TinyRecipe, VllmTap, build_graph, merged)

_QKV = LAYER + ".attn.qkv_proj"  # vLLM's attention module is ``attn`` here

_TINY = TinyRecipe("GptOssConfig", seed=15, config={
    **TINY_SHAPE,
    "intermediate_size": 64,  # per expert
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 16,
    "layer_types": ("sliding_attention", "full_attention", "sliding_attention"),
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
})


def _graph(config):
    n_layers = int(config.num_hidden_layers)
    return build_graph(SPEC, config, moe_layers=tuple(range(n_layers)),
                       n_experts=int(config.num_local_experts), top_k=int(config.num_experts_per_tok))


SPEC = ArchSpec(
    arch="gpt_oss",
    model_types=("gpt_oss",),
    hf_classes=("GptOssForCausalLM",),
    tiny={"tiny": _TINY},
    graph_from_config=_graph,
    eager=merged(
        COMMON_EAGER, mlp_pre=None, mlp_act=None,
        mlp_out=Tap(LAYER + ".mlp", "out0"),
        router_logits=Tap(LAYER + ".mlp.router", "out0", "flat"),
        expert_weights=Tap(LAYER + ".mlp.router", "out1", "flat"),
        expert_indices=Tap(LAYER + ".mlp.router", "out2", "flat"),
    ),
    eager_attention_only="transformers has no SDPA path for GPT-OSS's attention sinks",
    vllm=merged(
        COMMON_VLLM, mlp_pre=None, mlp_act=None,
        attn_out=VllmTap("module_out", LAYER + ".attn"),
        z=VllmTap("module_in", LAYER + ".attn.o_proj", "heads", sharded=True),
        q=VllmTap("module_out", _QKV, "heads", split=Split(QKV_PARTS, 0)),
        k=VllmTap("module_out", _QKV, "kv_heads", split=Split(QKV_PARTS, 1)),
        v=VllmTap("module_out", _QKV, "kv_heads", split=Split(QKV_PARTS, 2)),
        pattern=VllmTap("attn_qk", LAYER + ".attn.attn"),  # the kernel applies the sinks
        router_logits=VllmTap("module_out", LAYER + ".mlp.router"),
        expert_weights=VllmTap("route_weights", LAYER + ".mlp.router"),
        expert_indices=VllmTap("route_indices", LAYER + ".mlp.router"),
    ),
    # top-k of the biased logits, softmax over the k (vLLM's GptOssMLP: renormalize=True)
    routing=Routing(renormalize=True),
    vllm_writes=COMMON_VLLM_WRITES,
    vllm_layer_hidden_arg=0,
)
