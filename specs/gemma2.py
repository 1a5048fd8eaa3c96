"""Gemma 2 (Gemma2ForCausalLM): sandwich norms around attention and MLP, scaled embeddings,
final logit soft-capping. What a block adds to the residual is the output of its post-norm."""

from ._base import COMMON_EAGER, COMMON_VLLM, LAYER, ArchSpec, Tap, VllmTap, build_graph, merged

SPEC = ArchSpec(
    arch="gemma2",
    model_types=("gemma2",),
    graph_from_config=lambda config: build_graph(SPEC, config, d_mlp=int(config.intermediate_size)),
    eager=merged(
        COMMON_EAGER,
        attn_out=Tap(LAYER + ".post_attention_layernorm", "out"),
        resid_mid=Tap(LAYER + ".pre_feedforward_layernorm", "in"),
        mlp_out=Tap(LAYER + ".post_feedforward_layernorm", "out"),
    ),
    vllm=merged(
        COMMON_VLLM,
        attn_out=VllmTap("module_out", LAYER + ".post_attention_layernorm"),
    ),
    # Gemma 2 adds attention to the residual at the pre-feedforward fused norm.
    vllm_writes=merged({}, resid_mid=VllmTap("fused_in_sum", LAYER + ".pre_feedforward_layernorm")),
    vllm_unembed_path="model.embed_tokens",  # vLLM ties Gemma 2 logits to the embedding
    eager_attention_only="SDPA silently drops Gemma 2's attention-logit soft-capping",
)
