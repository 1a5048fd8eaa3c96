"""Llama (LlamaForCausalLM): the reference pre-norm layout."""

from ._base import COMMON_EAGER, COMMON_VLLM, COMMON_VLLM_WRITES, TINY_SHAPE, ArchSpec, TinyRecipe, build_graph

SPEC = ArchSpec(
    arch="llama",
    model_types=("llama",),
    hf_classes=("LlamaForCausalLM",),
    tiny={"tiny": TinyRecipe("LlamaConfig", seed=2, config=TINY_SHAPE, adds_bos=True)},
    graph_from_config=lambda config: build_graph(SPEC, config, d_mlp=int(config.intermediate_size)),
    eager=COMMON_EAGER,
    vllm=COMMON_VLLM,
    vllm_writes=COMMON_VLLM_WRITES,
)
