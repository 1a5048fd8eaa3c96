"""Root fixtures shared by tests/ and property_tests/: one model per (arch, backend) for the
whole session, so each vLLM engine starts once."""

from __future__ import annotations

import collections
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
    """Loads each (arch, backend, options) once. vLLM engines stay up while they are among the
    ``MAX_ENGINES`` most recently asked for; an older one is closed (its processes and KV cache
    freed) and starts again if asked for later, so the session's memory stays bounded however
    many architectures the registry holds."""

    MAX_ENGINES = int(os.environ.get("INTERP_ENGINE_TEST_MAX_ENGINES", "9"))
    KV_BYTES = 256 << 20  # KV cache per test engine: ample for the tiny models' contexts

    def __init__(self) -> None:
        self._models: dict[tuple, object] = {}
        self._engines: collections.OrderedDict[tuple, None] = collections.OrderedDict()

    def get(self, arch: str, backend: str = "eager", **options):
        if backend == "vllm" and set(options) <= {"enable_prompt_embeds"}:
            options["enable_prompt_embeds"] = True  # one engine per arch serves ids and embeds alike
        key = (arch, backend, tuple(sorted(options.items())))
        if key not in self._models:
            if backend != "eager" and not vllm_installed():
                pytest.skip("vllm is not installed (INTERP_ENGINE_SKIP_VLLM=1 set-up)")
            from interp_engine import load_model
            from interp_engine.testing import tiny_model

            extra = {"kv_cache_memory_bytes": self.KV_BYTES} if backend != "eager" else {}
            self._models[key] = load_model(tiny_model(arch), backend=backend, **options, **extra)
        if backend != "eager":
            self._engines[key] = None
            self._engines.move_to_end(key)
            while len(self._engines) > self.MAX_ENGINES:
                old, _ = self._engines.popitem(last=False)
                self._models[old].close()
        return self._models[key]

    def close(self) -> None:
        for model in self._models.values():
            model.close()
        self._models.clear()
        self._engines.clear()


@pytest.fixture(scope="session")
def model_pool():
    pool = ModelPool()
    yield pool
    pool.close()
