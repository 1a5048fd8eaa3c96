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


def _engine_key(item, archs: dict) -> tuple | None:
    """The (architecture, variant) an item's parameters name, or None: a parameter that is an
    architecture, or a tuple that starts with one ((arch, backend), (arch, dtype))."""
    spec = getattr(item, "callspec", None)
    for value in (spec.params.values() if spec is not None else ()):
        if isinstance(value, str) and value in archs:
            return archs[value], ""
        if isinstance(value, tuple) and value and isinstance(value[0], str) and value[0] in archs:
            return archs[value[0]], "/".join(map(str, value[1:]))
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Run each module's architecture-parametrised tests architecture by architecture.

    pytest orders a function-scoped parametrisation test by test (each test over every
    architecture, then the next test), which with more architectures than ``MAX_ENGINES``
    closes and restarts every engine for every test (least-recently-used eviction of a cycle
    longer than the pool always misses). Within a module, the items that name an architecture
    are put back into their own slots grouped by architecture (the order inside a group kept);
    the architectures' order alternates from module to module, so a module starts on the
    engines the previous one left running. Items that name no architecture keep their places."""
    from interp_engine.testing import TINY_ARCHS

    by_module: dict = collections.defaultdict(list)
    for i, item in enumerate(items):
        by_module[item.module].append(i)
    for n, (module, slots) in enumerate(by_module.items()):
        rank = {a: (k if n % 2 == 0 else -k) for k, a in enumerate(TINY_ARCHS)}
        keyed = [(i, _engine_key(items[i], rank)) for i in slots]
        keyed = [(i, key) for i, key in keyed if key is not None]
        if len(keyed) < 2:
            continue
        order = sorted(keyed, key=lambda pair: (pair[1], pair[0]))
        moved = [items[i] for i, _ in order]
        for (i, _), item in zip(keyed, moved):
            items[i] = item


@pytest.fixture(scope="session")
def model_pool():
    pool = ModelPool()
    yield pool
    pool.close()
