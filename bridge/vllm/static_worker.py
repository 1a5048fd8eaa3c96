"""vllm-static in a worker: read the declared set from the engine's ``additional_config`` (which
vLLM folds into its compile-cache key) and patch it into the model before the first forward."""

from __future__ import annotations

from typing import Any

from .static_decl import CONFIG_KEY, StaticDeclaration

__all__ = ["install_static", "static_info"]


def declaration_of(runner: Any) -> StaticDeclaration | None:
    extra = getattr(getattr(runner, "vllm_config", None), "additional_config", None) or {}
    data = extra.get("interp_engine") if isinstance(extra, dict) else None
    if not isinstance(data, dict) or CONFIG_KEY not in data:
        return None
    return StaticDeclaration.from_config(data[CONFIG_KEY])


def install_static(runtime: Any, runner: Any) -> None:
    """Patch the declared taps into ``runner``'s model (a no-op for hook-based engines)."""
    declaration = declaration_of(runner)
    if declaration is None:
        return
    from .static_taps import StaticTaps

    config = runner.vllm_config
    max_tokens = int(config.scheduler_config.max_num_batched_tokens)
    d_model = int(config.model_config.hf_config.hidden_size)
    taps = StaticTaps(runtime.root, runtime.spec, declaration.points, declaration.writes, declaration.slots,
                      max_tokens, runtime.device, runtime.dtype, d_model)
    taps.patch()
    runtime.use_static(taps)

    def drain(module, args, out):
        if not runtime.store_captures:  # a tensor-parallel rank > 0: rank 0 holds the same rows
            for tap in taps.taps.values():  # (static points are full width after the all-reduce)
                tap.readers = []
            return None
        try:
            taps.drain(runtime._read_tap)
            runtime.flush_held()  # (each held request failing on its own inside)
        except Exception as exc:  # never into vLLM's forward: fail the readers instead
            for tap in taps.taps.values():
                for request, *_ in tap.readers:
                    request.fail(f"static capture failed: {exc!r}")
                tap.readers = []
        return None

    runtime.static_handle = runtime.root.register_forward_hook(drain)


def static_info(runtime: Any) -> dict:
    """What this worker compiled in, its buffer bytes, and the compile counters (for checks)."""
    from .static_taps import compilation_counts

    taps = runtime.static
    out = {"static": taps is not None, "counts": compilation_counts(),
           "config_hash": runtime.runner.vllm_config.compute_hash()}
    if taps is not None:
        out.update(points=[str(a) for a in taps.taps], writes=[str(a) for a in taps.sites],
                   buffer_bytes=taps.bytes, max_tokens=taps.max_tokens, slots=taps.n_slots)
    return out
