"""Installing the runtime in a worker's model runner, and finding it there again. The plugin
(``plugin.py``) calls ``install_runtime`` right after vLLM loads the model, in every engine that
asks for the runtime, including workers of engines this library did not start (``vllm serve``);
the worker extension (``worker.py``) reaches it through ``runtime_of``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["install_runtime", "runtime_of", "tp_rank_and_size"]

_ATTR = "_interp_engine_runtime"


def tp_rank_and_size() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def install_runtime(runner: Any):
    """The runtime of this model runner, installed on first call (idempotent)."""
    runtime = getattr(runner, _ATTR, None)
    if runtime is not None:
        return runtime
    from specs import spec_for_config

    from .routing import rule_of
    from .runtime import Runtime

    spec = spec_for_config(runner.model_config.hf_config)
    rank, world = tp_rank_and_size()
    # points a tensor-parallel rank holds only a slice of are stored on every rank
    shards = frozenset(name for name, tap in spec.vllm.items() if tap.sharded) if world > 1 else frozenset()
    runtime = Runtime(runner, spec, store_captures=rank == 0, rank=rank, rank_shards=shards)
    runtime.routing = rule_of(spec, runner.model_config.hf_config)
    from .static_worker import install_static

    install_static(runtime, runner)  # vllm-static: taps into the graph before it compiles
    setattr(runner, _ATTR, runtime)
    return runtime


def runtime_of(runner: Any):
    runtime = getattr(runner, _ATTR, None)
    if runtime is None:
        raise RuntimeError("the interp_engine runtime is not installed in this worker: call "
                           "collective_rpc('interp_install') first (load_model does)")
    return runtime
