"""backend="vllm-static": the vLLM backend with its taps and steering sites compiled into vLLM's
graph (``torch.compile`` stays on; on a GPU, CUDA graphs too), so captures and steering run at
compiled speed.

Everything else is the hook-based backend's (``client.VllmBackend``): plans travel in
``SamplingParams.extra_args``, the worker runtime maps rows to requests, captures come back
through ``collective_rpc``. The difference is where the work happens: the declared set
(``static_decl``) is patched into the decoder layers before vLLM compiles them, as custom ops
on persistent buffers (``static_taps``, ``static_ops``); the runtime fills small row-index
tensors outside the graph each step. Changing vectors or which request steers never recompiles.

What is not declared cannot be served: capturing or steering it raises CapabilityUnsupported
before any forward, naming the declared set and how to declare more.

Buffer memory per worker: ``model.static_buffer_bytes`` — each declared tap holds
``(max_num_batched_tokens + 1) x d_model`` values and each steering site ``2 x (slots + 1) x
d_model``, in the model dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from interp_engine._address import Address
from interp_engine._capabilities import CapabilityUnsupported
from interp_engine._plan import Plan
from interp_engine._points import POINTS

from .client import VllmBackend
from .static_decl import CONFIG_KEY, DEFAULT_SLOTS, StaticDeclaration, declare

__all__ = ["VllmStaticBackend"]


class VllmStaticBackend(VllmBackend):
    name = "vllm-static"
    hooks_available = True  # captures and steering, at the declared points

    def __init__(self, path, spec, graph, *, dtype: torch.dtype, max_model_len: int,
                 enable_prompt_embeds: bool = False, static_points: Any = "auto", static_writes: Any = None,
                 static_slots: int = DEFAULT_SLOTS, **engine_kwargs: Any) -> None:
        if engine_kwargs.pop("enforce_eager", False):
            raise ValueError("backend='vllm-static' compiles the model (its taps live in the compiled graph): "
                             "drop enforce_eager=True, or use backend='vllm' for hooks on an eager engine")
        extra = dict(engine_kwargs.pop("additional_config", None) or {})
        if "interp_engine" in extra:
            raise ValueError("additional_config['interp_engine'] is set by interp_engine (the declared set)")
        self.declaration: StaticDeclaration = declare(spec, graph, static_points, static_writes, static_slots)
        super().__init__(path, spec, graph, dtype=dtype, max_model_len=max_model_len,
                         enable_prompt_embeds=enable_prompt_embeds, **engine_kwargs)
        extra["interp_engine"] = {CONFIG_KEY: self.declaration.to_config()}
        self._kwargs.update(enforce_eager=False, additional_config=extra)
        # CUDA graphs replay the compiled model on a GPU (vLLM's default there); never on CPU
        self.graph_replay = bool(torch.cuda.is_available())

    @property
    def static_points(self) -> tuple[Address, ...]:
        return self.declaration.points

    @property
    def static_writes(self) -> tuple[Address, ...]:
        return self.declaration.writes

    @property
    def static_buffer_bytes(self) -> int:
        """Persistent buffer memory the declared set takes in each worker (bounded at load)."""
        tokens = self._kwargs.get("max_num_batched_tokens")
        if tokens is None:
            tokens = self.engine_config().scheduler_config.max_num_batched_tokens
        return self.declaration.buffer_bytes(int(tokens), self.graph.d_model, self.dtype.itemsize)

    def engine_config(self):
        """The VllmConfig this engine starts with (its ``compute_hash()`` keys vLLM's compile
        cache), built without starting anything."""
        from vllm.engine.arg_utils import EngineArgs

        kwargs = {k: v for k, v in self._kwargs.items() if k != "logits_processors"}
        return EngineArgs(**kwargs).create_engine_config()

    def _declared_hint(self, writing: bool) -> str:
        declared = self.static_writes if writing else self.static_points
        arg = "static_writes" if writing else "static_points"
        return (f"declared {arg}: [{', '.join(str(a) for a in declared) or 'none'}]; declare more with "
                f"load_model(..., backend='vllm-static', {arg}=[...]) (a new engine), or use backend='vllm'")

    def refusal(self, plan: Plan, batch, *, gradients: bool = False):
        for op in plan.writes:
            if op.experts is not None:
                return CapabilityUnsupported(
                    "expert_writes", self.name, detail=f"experts={list(op.experts)} at {op.address}",
                    why="vllm-static compiles residual-width steering sites, which add, set or project "
                        "a whole row; an expert's share is reached only through the routing weights",
                    instead="use backend='vllm' (its hook runtime scales the routing weights) or 'eager'")
        found = super().refusal(plan, batch, gradients=gradients)
        if found is not None:
            return found
        for address in plan.reads:
            if not POINTS[address.name].vllm_static:
                return CapabilityUnsupported("static_point", self.name, detail=f"capture {address}")
            if address not in self.declaration.point_set:
                return CapabilityUnsupported("undeclared_static_point", self.name,
                                             detail=f"capture {address}; {self._declared_hint(False)}")
        sites: set[Address] = set()
        for op in plan.writes:
            if op.address not in self.declaration.write_set:
                return CapabilityUnsupported("undeclared_static_point", self.name,
                                             detail=f"steer {op.address}; {self._declared_hint(True)}")
            if op.address in sites:
                return CapabilityUnsupported(
                    "static_point", self.name, detail=f"two steering ops at {op.address} in one request",
                    why="a compiled steering site applies one op per row and request",
                    instead="combine them into one vector (add) or steer at another declared site")
            sites.add(op.address)
        return None
