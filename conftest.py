"""Root fixtures shared by tests/ and property_tests/: one model per (arch, backend) for the
whole session, so each vLLM engine starts once."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# From the spec registry: every tiny architecture whose spec has a vLLM map.
from interp_engine.testing import VLLM_ARCHS  # noqa: E402,F401


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


class ModelPool:
    """Loads each (arch, backend, options) once; vLLM engines stay up for the session."""

    def __init__(self) -> None:
        self._models: dict[tuple, object] = {}

    def get(self, arch: str, backend: str = "eager", **options):
        key = (arch, backend, tuple(sorted(options.items())))
        if key not in self._models:
            if backend != "eager" and not vllm_installed():
                pytest.skip("vllm is not installed (INTERP_ENGINE_SKIP_VLLM=1 set-up)")
            from interp_engine import load_model
            from interp_engine.testing import tiny_model

            self._models[key] = load_model(tiny_model(arch), backend=backend, **options)
        return self._models[key]

    def close(self) -> None:
        for model in self._models.values():
            model.close()
        self._models.clear()


@pytest.fixture(scope="session")
def model_pool():
    pool = ModelPool()
    yield pool
    pool.close()
