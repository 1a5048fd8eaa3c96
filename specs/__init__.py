"""One declarative spec per architecture. Adding an architecture is adding one file here and
one line to ``SPECS``."""

from __future__ import annotations

from types import MappingProxyType

from . import deepseek_v4, gemma2, llama, qwen3, qwen3_moe
from ._base import ArchSpec, Tap, VllmTap

__all__ = ["ArchSpec", "SPECS", "Tap", "VllmTap", "spec_for_config"]

SPECS = MappingProxyType({
    module.SPEC.arch: module.SPEC for module in (qwen3, llama, gemma2, qwen3_moe, deepseek_v4)
})


def spec_for_config(config: object) -> ArchSpec:
    model_type = getattr(config, "model_type", None)
    for spec in SPECS.values():
        if model_type in spec.model_types:
            return spec
    known = sorted(t for s in SPECS.values() for t in s.model_types)
    raise ValueError(
        f"no interp_engine spec for model_type {model_type!r}; supported model types: "
        f"{', '.join(known)}. Add a spec file under specs/ to support it."
    )
