"""Gemma 2 (Gemma2ForCausalLM): sandwich norms around attention and MLP, scaled embeddings,
final logit soft-capping. What a block adds to the residual is the output of its post-norm."""

from ._base import (COMMON_EAGER, COMMON_VLLM, SANDWICH_EAGER, SANDWICH_VLLM, SANDWICH_VLLM_WRITES,
                    TINY_SHAPE, ArchSpec, TinyRecipe, build_graph, merged)

_TINY = TinyRecipe(
    "Gemma2Config", seed=3, adds_bos=True,
    config={
        **TINY_SHAPE,
        # Real Gemma2 ties the LM head to the embeddings; vLLM's Gemma2 has no lm_head.
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 32,
        "sliding_window": 32,
        "layer_types": ("sliding_attention", "full_attention", "sliding_attention"),
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    # With tied, sqrt(hidden)-scaled embeddings, a token's own embedding dominates the
    # residual stream at random init and greedy decoding mostly repeats the last token.
    # A smaller embedding, larger post-sublayer gains (Gemma norms scale by 1 + weight)
    # and a larger final-norm gain (to keep logit margins) make decoding vary.
    # (Gains of 5 keep the residual stream's RMS near 10, float32 error near 1e-5.)
    norm_offsets={"post_attention_layernorm.weight": 4.0,
                  "post_feedforward_layernorm.weight": 4.0,
                  "model.norm.weight": 3.0},
    embedding_scale=0.2,
)

SPEC = ArchSpec(
    arch="gemma2",
    model_types=("gemma2",),
    hf_classes=("Gemma2ForCausalLM",),
    tiny={"tiny": _TINY},
    graph_from_config=lambda config: build_graph(SPEC, config, d_mlp=int(config.intermediate_size)),
    eager=merged(COMMON_EAGER, **SANDWICH_EAGER),
    vllm=merged(COMMON_VLLM, **SANDWICH_VLLM),
    vllm_writes=SANDWICH_VLLM_WRITES,
    vllm_unembed_path="model.embed_tokens",  # vLLM ties Gemma 2 logits to the embedding
    eager_attention_only="SDPA silently drops Gemma 2's attention-logit soft-capping",
)
