"""One declarative spec per architecture, found by itself: adding an architecture is adding one
file here that defines ``SPEC`` (an ``ArchSpec``). Everything else (the tiny-model factory, the
test parametrisation, the CLI's choices) derives its list from ``SPECS``."""

from __future__ import annotations

import importlib
import pkgutil
from types import MappingProxyType

from ._base import ArchSpec, Routing, Split, Tap, TinyRecipe, VllmTap

__all__ = ["ArchSpec", "Routing", "SPECS", "Split", "Tap", "TinyRecipe", "VllmTap", "spec_for_config"]


def _discover() -> dict[str, ArchSpec]:
    found: dict[str, ArchSpec] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        spec = getattr(importlib.import_module(f"{__name__}.{info.name}"), "SPEC", None)
        if not isinstance(spec, ArchSpec):
            raise TypeError(f"specs/{info.name}.py must define SPEC = ArchSpec(...)")
        if spec.arch in found:
            raise ValueError(f"two spec files declare arch {spec.arch!r}")
        found[spec.arch] = spec
    return found


SPECS = MappingProxyType(_discover())


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
