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


def _engines_that_fit() -> int:
    """How many test engines stay up at once: as many as this machine's free memory holds at
    about ``ENGINE_BYTES`` each, keeping ``SPARE_BYTES`` for the test process, its eager models
    and the engines some tests start themselves; between 4 and 16. A restart costs about 20 s
    (start and close). Measured on a 24 GiB machine: an engine core process holds about 430 MiB
    of its own, a worker about 590 MiB with the pool's KV cache (a tensor-parallel engine has
    two), and an engine a test starts itself holds vLLM's 1 GiB CPU KV cache on top. With 14
    pooled engines the lowest free memory in a run was 2.3 GiB; this allows 13 there."""
    ENGINE_BYTES, SPARE_BYTES = int(1.2 * (1 << 30)), 7 << 30
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 9
    return max(4, min(16, (free - SPARE_BYTES) // ENGINE_BYTES))


class ModelPool:
    """Loads each (arch, backend, options) once. vLLM engines stay up while they are among the
    ``MAX_ENGINES`` most recently asked for (``INTERP_ENGINE_TEST_MAX_ENGINES``, else what free
    memory holds); an older one is closed (its processes and KV cache freed) and starts again if
    asked for later, so the session's memory stays bounded however many architectures the
    registry holds."""

    MAX_ENGINES = int(os.environ.get("INTERP_ENGINE_TEST_MAX_ENGINES") or _engines_that_fit())
    # KV cache per test engine: ample for the tiny models' contexts (about 20,000 tokens of the
    # largest; the tests' harvests keep at most 16 windows of 16 positions in flight)
    KV_BYTES = 32 << 20

    def __init__(self) -> None:
        self._models: dict[tuple, object] = {}
        self._engines: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._evicted: set[tuple] = set()

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
                ENGINE_STARTS[key] += 1
        elif key in self._evicted:  # closed to make room: its engine starts again on first use
            self._evicted.discard(key)
            ENGINE_STARTS[key] += 1
        if backend != "eager":
            self._engines[key] = None
            self._engines.move_to_end(key)
            while len(self._engines) > self.MAX_ENGINES:
                old, _ = self._engines.popitem(last=False)
                self._models[old].close()
                self._evicted.add(old)
        return self._models[key]

    def close(self) -> None:
        """Closes every model at once: a vLLM engine's close mostly waits for its processes to
        exit (seconds each), so one after another would add up."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, len(self._models))) as threads:
            list(threads.map(lambda model: model.close(), list(self._models.values())))
        self._models.clear()
        self._engines.clear()


# (arch, backend, options) -> how many times the pool built that model's engine this session (a
# count above 1 is a restart after eviction: printed at the end, as the first thing to check
# when the suite slows down)
ENGINE_STARTS: collections.Counter = collections.Counter()


def pytest_terminal_summary(terminalreporter) -> None:
    if ENGINE_STARTS:
        again = sum(n - 1 for n in ENGINE_STARTS.values())
        terminalreporter.write_line(f"model pool: {sum(ENGINE_STARTS.values())} vLLM engines started "
                                    f"({len(ENGINE_STARTS)} distinct, {again} restarts after eviction)")
        for key, n in ENGINE_STARTS.most_common():
            if n > 1:
                terminalreporter.write_line(f"  started {n}x: {key}")


def _engine_key(item, archs) -> tuple[str, str] | None:
    """The (architecture, variant) an item's parameters name, or None: a parameter that is an
    architecture, or a tuple that starts with one ((arch, backend), (arch, dtype))."""
    spec = getattr(item, "callspec", None)
    for value in (spec.params.values() if spec is not None else ()):
        if isinstance(value, str) and value in archs:
            return value, ""
        if isinstance(value, tuple) and value and isinstance(value[0], str) and value[0] in archs:
            return value[0], "/".join(map(str, value[1:]))
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Run each module's architecture-parametrised tests architecture by architecture, starting
    with the engines the modules before it left running.

    pytest orders a function-scoped parametrisation test by test (each test over every
    architecture, then the next test), which with more architectures than ``MAX_ENGINES``
    closes and restarts every engine for every test (least-recently-used eviction of a cycle
    longer than the pool always misses). Within a module, the items that name an architecture
    are put back into their own slots grouped by architecture (the order inside a group kept).
    The pool is followed through the run as ordered so far: a module takes first the
    architectures whose engines are up, least recently used first (none is evicted while they
    run), then the others. Items that name no architecture keep their places."""
    from interp_engine.testing import TINY_ARCHS

    archs = set(TINY_ARCHS)
    by_module: dict = collections.defaultdict(list)
    for i, item in enumerate(items):
        by_module[item.module].append(i)
    up: collections.OrderedDict = collections.OrderedDict()  # (arch, variant) engines, oldest first
    for module, slots in by_module.items():
        keyed = [(i, _engine_key(items[i], archs)) for i in slots]
        keyed = [(i, key) for i, key in keyed if key is not None]
        rank: dict[str, int] = {}
        for arch, _ in up:
            rank.setdefault(arch, len(rank))
        for arch in TINY_ARCHS:
            rank.setdefault(arch, len(rank))
        order = sorted(keyed, key=lambda pair: (rank[pair[1][0]], pair[1][1], pair[0]))
        moved = [(items[i], key) for i, key in order]
        for (i, _), (item, _) in zip(keyed, moved):
            items[i] = item
        for item, (arch, variant) in moved:  # what the pool holds after this module
            if variant.endswith("eager") or item.get_closest_marker("vllm") is None:
                continue
            engine = (arch, variant or "vllm")
            up[engine] = None
            up.move_to_end(engine)
            while len(up) > ModelPool.MAX_ENGINES:
                up.popitem(last=False)


@pytest.fixture(scope="session")
def model_pool():
    pool = ModelPool()
    yield pool
    pool.close()
