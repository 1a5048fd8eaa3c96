"""GPT-2 (GPT2LMHeadModel): pre-norm LayerNorm with bias, learned absolute positions, Conv1D
weights (stored [in, out]), one fused ``c_attn`` writing q | k | v, tied embeddings.

The block is a plain module on both engines (vLLM's GPT2Block returns the residual stream,
not a fused ``(h, r)`` pair), so every vLLM tap is a module input or output. Writes at a
module input edit the tensor in place on vLLM: GPT-2's block keeps ``ln_2``'s input as its
residual, so a resid_mid write there reaches both the MLP and the residual stream."""

from interp_engine._graph import ResidualBasis

from ._base import QKV_PARTS, ArchSpec, Split, Tap, TinyRecipe, VllmTap, build_graph

H = "transformer.h.{L}"


def _graph(config):
    d_model = int(config.hidden_size)
    return build_graph(SPEC, config, d_mlp=int(config.n_inner or 4 * d_model),
                       basis=ResidualBasis(1, True, True, note="learned position embeddings are "
                                           "added to the token embeddings before layer 0"))


SPEC = ArchSpec(
    arch="gpt2",
    model_types=("gpt2",),
    hf_classes=("GPT2LMHeadModel",),
    tiny={
        "tiny": TinyRecipe("GPT2Config", seed=8, config={
            "vocab_size": 512, "n_embd": 128, "n_layer": 3, "n_head": 4, "n_inner": 256,
            "n_positions": 512, "activation_function": "gelu_new", "tie_word_embeddings": True,
            "initializer_range": 0.12,
        }, embedding_scale=0.1),  # tied embeddings: a smaller own-token echo, so greedy varies
        # GPT-2 small's shape (GPT2Config() defaults, 124M parameters) with random weights, for
        # benchmarks at a realistic size; its vocabulary is larger than the test tokenizer's.
        "full": TinyRecipe("GPT2Config", seed=18, config={}),
    },
    graph_from_config=_graph,
    eager={
        "resid_pre": Tap(H, "in"),
        "resid_mid": Tap(H + ".ln_2", "in"),
        "resid_post": Tap(H, "out"),
        "attn_out": Tap(H + ".attn", "out0"),
        "mlp_out": Tap(H + ".mlp", "out"),
        "q": Tap(H + ".attn.c_attn", "out", "heads", Split(QKV_PARTS, 0)),
        "k": Tap(H + ".attn.c_attn", "out", "kv_heads", Split(QKV_PARTS, 1)),
        "v": Tap(H + ".attn.c_attn", "out", "kv_heads", Split(QKV_PARTS, 2)),
        "z": Tap(H + ".attn.c_proj", "in", "heads"),
        "pattern": Tap(H + ".attn", "out1"),
        "mlp_pre": Tap(H + ".mlp.c_fc", "out"),
        "mlp_act": Tap(H + ".mlp.c_proj", "in"),
    },
    final_norm_path="transformer.ln_f",
    final_norm_kind="layer",
    hf_base="transformer",
    vllm={
        "resid_pre": VllmTap("module_in", H),
        "resid_mid": VllmTap("module_in", H + ".ln_2"),
        "resid_post": VllmTap("module_out", H),
        "attn_out": VllmTap("module_out", H + ".attn"),
        "mlp_out": VllmTap("module_out", H + ".mlp"),
        "z": VllmTap("module_in", H + ".attn.c_proj", "heads", sharded=True),
        # vLLM's c_attn writes q | k | v as eager's Conv1D does (before any rotary: GPT-2 has none)
        "q": VllmTap("module_out", H + ".attn.c_attn", "heads", split=Split(QKV_PARTS, 0)),
        "k": VllmTap("module_out", H + ".attn.c_attn", "kv_heads", split=Split(QKV_PARTS, 1)),
        "v": VllmTap("module_out", H + ".attn.c_attn", "kv_heads", split=Split(QKV_PARTS, 2)),
        "mlp_pre": VllmTap("module_out", H + ".mlp.c_fc"),
        "mlp_act": VllmTap("module_in", H + ".mlp.c_proj", sharded=True),
        "pattern": VllmTap("attn_qk", H + ".attn.attn"),
    },
    vllm_final_norm_path="transformer.ln_f",
)
