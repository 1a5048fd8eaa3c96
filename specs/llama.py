"""Llama (LlamaForCausalLM): the reference pre-norm layout."""

from ._base import COMMON_EAGER, COMMON_VLLM, COMMON_VLLM_WRITES, ArchSpec, build_graph

SPEC = ArchSpec(
    arch="llama",
    model_types=("llama",),
    graph_from_config=lambda config: build_graph(SPEC, config, d_mlp=int(config.intermediate_size)),
    eager=COMMON_EAGER,
    vllm=COMMON_VLLM,
    vllm_writes=COMMON_VLLM_WRITES,
)
