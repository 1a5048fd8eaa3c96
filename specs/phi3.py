"""Phi-3 (Phi3ForCausalLM): the Llama layout with fused projections. ``qkv_proj`` writes q, k
and v side by side and ``gate_up_proj`` writes the gate then the up projection; the taps take
their parts with a declared ``Split``. vLLM runs Phi-3 as its Llama model (same module names,
fused there too)."""

from ._base import (COMMON_EAGER, COMMON_VLLM, COMMON_VLLM_WRITES, GATE_UP_PARTS, LAYER, QKV_PARTS,
                    TINY_SHAPE, ArchSpec, Split, Tap, TinyRecipe, build_graph, merged)

_QKV = LAYER + ".self_attn.qkv_proj"

SPEC = ArchSpec(
    arch="phi3",
    model_types=("phi3",),
    hf_classes=("Phi3ForCausalLM",),
    tiny={"tiny": TinyRecipe("Phi3Config", seed=7, config={
        **TINY_SHAPE, "original_max_position_embeddings": TINY_SHAPE["max_position_embeddings"]})},
    graph_from_config=lambda config: build_graph(SPEC, config, d_mlp=int(config.intermediate_size)),
    eager=merged(
        COMMON_EAGER,
        q=Tap(_QKV, "out", "heads", Split(QKV_PARTS, 0)),
        k=Tap(_QKV, "out", "kv_heads", Split(QKV_PARTS, 1)),
        v=Tap(_QKV, "out", "kv_heads", Split(QKV_PARTS, 2)),
        mlp_pre=Tap(LAYER + ".mlp.gate_up_proj", "out", None, Split(GATE_UP_PARTS, 0)),
    ),
    vllm=COMMON_VLLM,
    vllm_writes=COMMON_VLLM_WRITES,
)
