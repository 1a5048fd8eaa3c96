"""Mistral (MistralForCausalLM): the Llama layout, with sliding-window attention.

The tiny recipe's window (16) is shorter than the test prompts, so a backend that ignored it
would not match."""

from ._base import COMMON_EAGER, COMMON_VLLM, COMMON_VLLM_WRITES, TINY_SHAPE, ArchSpec, TinyRecipe, build_graph

SPEC = ArchSpec(
    arch="mistral",
    model_types=("mistral",),
    hf_classes=("MistralForCausalLM",),
    tiny={"tiny": TinyRecipe("MistralConfig", seed=6, adds_bos=True,
                             config={**TINY_SHAPE, "sliding_window": 16})},
    graph_from_config=lambda config: build_graph(SPEC, config, d_mlp=int(config.intermediate_size)),
    eager=COMMON_EAGER,
    vllm=COMMON_VLLM,
    vllm_writes=COMMON_VLLM_WRITES,
)
