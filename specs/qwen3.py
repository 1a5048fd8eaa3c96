"""Qwen3 (Qwen3ForCausalLM): Llama layout plus per-head RMSNorm on q and k."""

from ._base import COMMON_EAGER, COMMON_VLLM, COMMON_VLLM_WRITES, LAYER, ArchSpec, Tap, build_graph, merged

SPEC = ArchSpec(
    arch="qwen3",
    model_types=("qwen3",),
    graph_from_config=lambda config: build_graph(SPEC, config, d_mlp=int(config.intermediate_size)),
    eager=merged(
        COMMON_EAGER,
        # q_norm / k_norm act on [batch, pos, heads, d_head] before rotary embedding.
        q=Tap(LAYER + ".self_attn.q_norm", "out"),
        k=Tap(LAYER + ".self_attn.k_norm", "out"),
    ),
    vllm=COMMON_VLLM,
    vllm_writes=COMMON_VLLM_WRITES,
)
