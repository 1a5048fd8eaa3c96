"""GPT-NeoX / Pythia (GPTNeoXForCausalLM): parallel blocks (attention and the MLP both read
the layer's input, through their own LayerNorms, and are added to it together), partial rotary
embedding, and one fused ``query_key_value`` laid out per head as q | k | v.

resid_mid has no meaning in a parallel block: the graph refuses it with capability
``sequential_block`` and says so in its residual-basis description. vLLM 0.32 has no native
GPT-NeoX model: it runs the HF modules through its Transformers backend, the default for a
spec with no vLLM map (the map is the eager one moved under that backend's root)."""

from interp_engine._graph import ResidualBasis

from ._base import ArchSpec, Split, Tap, TinyRecipe, build_graph

L_ = "gpt_neox.layers.{L}"
_QKV = L_ + ".attention.query_key_value"
_PER_HEAD = (("d_head",), ("d_head",), ("d_head",))


def _graph(config):
    parallel = bool(config.use_parallel_residual)
    basis = ResidualBasis(1, True, True, parallel_block=parallel)
    graph = build_graph(SPEC, config, d_mlp=int(config.intermediate_size), basis=basis)
    if parallel:
        graph = graph.with_points(tuple(p for p in graph.points() if p.name != "resid_mid"))
    return graph


_EAGER = {
    "resid_pre": Tap(L_, "in"),
    "resid_mid": Tap(L_ + ".post_attention_layernorm", "in"),  # sequential variant only
    "resid_post": Tap(L_, "out"),
    "attn_out": Tap(L_ + ".attention", "out0"),
    "mlp_out": Tap(L_ + ".mlp", "out"),
    "q": Tap(_QKV, "out", "heads", Split(_PER_HEAD, 0, per="n_heads")),
    "k": Tap(_QKV, "out", "kv_heads", Split(_PER_HEAD, 1, per="n_heads")),
    "v": Tap(_QKV, "out", "kv_heads", Split(_PER_HEAD, 2, per="n_heads")),
    "z": Tap(L_ + ".attention.dense", "in", "heads"),
    "pattern": Tap(L_ + ".attention", "out1"),
    "mlp_pre": Tap(L_ + ".mlp.dense_h_to_4h", "out"),
    "mlp_act": Tap(L_ + ".mlp.dense_4h_to_h", "in"),
}

SPEC = ArchSpec(
    arch="gpt_neox",
    model_types=("gpt_neox",),
    hf_classes=("GPTNeoXForCausalLM",),
    tiny={
        "tiny": TinyRecipe("GPTNeoXConfig", seed=9, config={
            "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "intermediate_size": 256, "max_position_embeddings": 512, "rotary_pct": 0.25,
            "use_parallel_residual": True, "tie_word_embeddings": False, "initializer_range": 0.1,
        }),
        # Pythia-160M's shape with random weights, for benchmarks at a realistic size.
        "full": TinyRecipe("GPTNeoXConfig", seed=19, config={
            "vocab_size": 50304, "hidden_size": 768, "num_hidden_layers": 12,
            "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 2048,
            "rotary_pct": 0.25, "use_parallel_residual": True, "tie_word_embeddings": False,
        }),
    },
    graph_from_config=_graph,
    eager=_EAGER,
    final_norm_path="gpt_neox.final_layer_norm",
    final_norm_kind="layer",
    hf_base="gpt_neox",
)
