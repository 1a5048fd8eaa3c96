"""Qwen3 (Qwen3ForCausalLM): Llama layout plus per-head RMSNorm on q and k."""

from ._base import (COMMON_EAGER, COMMON_VLLM, COMMON_VLLM_WRITES, LAYER, QK_NORM_VLLM, TINY_SHAPE, ArchSpec,
                    Tap, TinyRecipe, build_graph, merged)

# "bench": a random Qwen3 of about 26M parameters (hidden 512, 8 layers, 8 heads of 64).
_BENCH = {
    "vocab_size": 512,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1536,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "initializer_range": 0.05,
}

SPEC = ArchSpec(
    arch="qwen3",
    model_types=("qwen3",),
    hf_classes=("Qwen3ForCausalLM",),
    tiny={"tiny": TinyRecipe("Qwen3Config", seed=1, config=TINY_SHAPE),
          "bench": TinyRecipe("Qwen3Config", seed=11, config=_BENCH)},
    graph_from_config=lambda config: build_graph(SPEC, config, d_mlp=int(config.intermediate_size)),
    eager=merged(
        COMMON_EAGER,
        # q_norm / k_norm act on [batch, pos, heads, d_head] before rotary embedding.
        q=Tap(LAYER + ".self_attn.q_norm", "out"),
        k=Tap(LAYER + ".self_attn.k_norm", "out"),
    ),
    vllm=merged(COMMON_VLLM, **QK_NORM_VLLM),
    vllm_writes=COMMON_VLLM_WRITES,
)
