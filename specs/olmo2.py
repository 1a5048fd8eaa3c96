"""OLMo 2 (Olmo2ForCausalLM): post-norm placement. A block has no norm before attention or the
MLP; each sublayer reads the residual stream itself and what it adds is its output through a
norm (``post_attention_layernorm``, ``post_feedforward_layernorm``), so attn_out and mlp_out are
read at those norms. q and k pass an RMSNorm over all heads together before rotary embedding.

vLLM 0.32 has no native OLMo 2 model (its registry sends ``Olmo2ForCausalLM`` to the
Transformers backend), so this spec has no vLLM map: the default door runs the HF modules inside
vLLM with the eager map moved under that backend's root. That backend's fusers merge q_proj,
k_proj and v_proj into one ``qkv_proj`` (q | k | v) and gate_proj and up_proj into one
``gate_up_proj`` (gate | up) under an act-and-mul: ``vllm_fused`` reads v and mlp_pre as parts
of those (q and k stay at q_norm / k_norm, which read the fused parts)."""

from ._base import (COMMON_EAGER, GATE_UP_PARTS, LAYER, QKV_PARTS, TINY_SHAPE, ArchSpec, Split, Tap, TinyRecipe,
                    VllmTap, build_graph, merged)

SPEC = ArchSpec(
    arch="olmo2",
    model_types=("olmo2",),
    hf_classes=("Olmo2ForCausalLM",),
    tiny={"tiny": TinyRecipe("Olmo2Config", seed=24, config=TINY_SHAPE)},
    graph_from_config=lambda config: build_graph(SPEC, config, d_mlp=int(config.intermediate_size)),
    eager=merged(
        COMMON_EAGER,
        attn_out=Tap(LAYER + ".post_attention_layernorm", "out"),
        resid_mid=Tap(LAYER + ".mlp", "in"),  # the MLP reads the residual stream itself
        mlp_out=Tap(LAYER + ".post_feedforward_layernorm", "out"),
        q=Tap(LAYER + ".self_attn.q_norm", "out", "heads"),
        k=Tap(LAYER + ".self_attn.k_norm", "out", "kv_heads"),
    ),
    vllm_fused={
        "v": VllmTap("module_out", LAYER + ".self_attn.qkv_proj", "kv_heads", split=Split(QKV_PARTS, 2)),
        "mlp_pre": VllmTap("module_out", LAYER + ".mlp.gate_up_proj", split=Split(GATE_UP_PARTS, 0)),
    },
)
