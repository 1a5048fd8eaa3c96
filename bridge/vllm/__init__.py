"""The vLLM bridge, as a small package: the client driver (``client``), the worker-resident
runtime (``runtime``, mixed into vLLM's workers by ``worker``), plans and captures as plain data
(``wire``), admission checks (``validator``), the server (``server``) and the ``vllm`` plugin
entry point (``plugin``). The only code in the project that imports vllm."""

from .client import VllmBackend, check_engine_kwargs

__all__ = ["VllmBackend", "check_engine_kwargs"]
