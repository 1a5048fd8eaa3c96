"""Gemma 3 (Gemma3ForCausalLM, text-only ``gemma3_text``): Gemma 2's four norms per layer
(sandwich norms around attention and the MLP), scaled embeddings, alternating sliding-window
and global attention with a separate rotary base for each, and per-head RMSNorm on q and k.

What a block adds to the residual is the output of its post-norm. Gemma 3 norms q and k after
moving heads before positions, so those taps read ``[batch, heads, pos, d_head]``
(``heads_first``). vLLM runs it natively, fused like Gemma 2, and norms q and k on
``[tokens, heads, d_head]`` views of its fused qkv_proj's parts."""

from ._base import (COMMON_EAGER, COMMON_VLLM, LAYER, QK_NORM_VLLM, SANDWICH_EAGER, SANDWICH_VLLM,
                    SANDWICH_VLLM_WRITES, TINY_SHAPE, ArchSpec, Tap, TinyRecipe, build_graph, merged)

_TINY = TinyRecipe(
    "Gemma3TextConfig", seed=13, adds_bos=True,
    config={
        **TINY_SHAPE,
        "tie_word_embeddings": True,  # as the real model (and vLLM) have it
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 32,
        # A window shorter than the test prompts, on the first and last layer; the middle one
        # is global. Each kind has its own rotary base, as in the real model.
        "sliding_window": 16,
        "layer_types": ("sliding_attention", "full_attention", "sliding_attention"),
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    },
    # As for Gemma 2: tied, sqrt(hidden)-scaled embeddings make greedy decoding echo the last
    # token at random init; a smaller embedding and larger post-sublayer and final gains
    # (Gemma norms scale by 1 + weight) make it vary. Gains of 2 keep the residual's max near
    # 18 (Gemma 2's gains of 5 would put it near 40, and fp32 kernel differences past 1e-5).
    norm_offsets={"post_attention_layernorm.weight": 1.0,
                  "post_feedforward_layernorm.weight": 1.0,
                  "model.norm.weight": 2.0},
    embedding_scale=0.2,
)

SPEC = ArchSpec(
    arch="gemma3",
    model_types=("gemma3_text",),
    hf_classes=("Gemma3ForCausalLM",),
    tiny={"tiny": _TINY},
    graph_from_config=lambda config: build_graph(SPEC, config, d_mlp=int(config.intermediate_size)),
    eager=merged(
        COMMON_EAGER,
        **SANDWICH_EAGER,
        q=Tap(LAYER + ".self_attn.q_norm", "out", "heads_first"),
        k=Tap(LAYER + ".self_attn.k_norm", "out", "heads_first"),
    ),
    vllm=merged(COMMON_VLLM, **SANDWICH_VLLM, **QK_NORM_VLLM),
    vllm_writes=SANDWICH_VLLM_WRITES,
)
