"""Your own vLLM engine (``vllm.LLM``, ``AsyncLLM``, Ray workers) with the runtime in it.

``load_model(..., backend="vllm")`` starts and drives an engine for you. When you hold the
engine yourself, three calls do the same work through vLLM's public surface::

    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.engine.arg_utils import AsyncEngineArgs
    from bridge.vllm.own import engine_kwargs, wire_request

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, **engine_kwargs(dtype="float32")))
    request = wire_request(path, points=["resid_post.1"], steer=spec)    # plain data
    params = SamplingParams(max_tokens=8, temperature=0.0, extra_args=request.extra_args)
    async for out in engine.generate({"prompt_token_ids": ids}, params, request_id=request.rid):
        ...
    captures = request.captures(await engine.collective_rpc("interp_collect", args=request.collect_args))

(On the CPU backend set ``VLLM_CPU_KVCACHE_SPACE`` (GiB) first, as for any vLLM engine there.)
``engine_kwargs`` adds what the runtime needs (its worker extension, the admission check,
eager mode, no prefix caching) and refuses a value that contradicts it. ``wire_request``
validates the plan against the model's graph (read from its config; no weights) and returns
its plain-data form; the captures come back, per request, from every worker (sharded points are
put back together across tensor-parallel ranks).
"""

from __future__ import annotations

import copy
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from interp_engine._address import Address

from .wire import KEY, merge_ranks, plan_to_wire

__all__ = ["WireRequest", "engine_kwargs", "wire_request"]

EXTENSION = "bridge.vllm.worker.InterpWorkerExtension"
VALIDATOR = "bridge.vllm.validator:PlanValidator"
_REQUIRED = {"worker_extension_cls": EXTENSION, "enforce_eager": True, "enable_prefix_caching": False}


def engine_kwargs(**kwargs: Any) -> dict:
    """Engine arguments for ``vllm.LLM(**...)`` / ``AsyncEngineArgs(**...)`` with the runtime
    loaded; your own arguments pass through."""
    for key, value in _REQUIRED.items():
        if key in kwargs and kwargs[key] != value:
            raise ValueError(f"{key}={kwargs[key]!r} cannot carry the interp_engine runtime: it needs "
                             f"{key}={value!r} (for compiled graphs, use backend='vllm-static')")
    processors = list(kwargs.pop("logits_processors", None) or [])
    if VALIDATOR not in processors:
        processors.append(VALIDATOR)
    return {**kwargs, **_REQUIRED, "logits_processors": processors}


@dataclass(frozen=True)
class WireRequest:
    """One request's plan as plain data: send ``extra_args`` with the request (request id
    ``rid``), then pass what ``collective_rpc("interp_collect", args=collect_args)`` returns to
    ``captures``."""

    rid: str
    wire: Mapping[str, Any]
    reads: tuple[Address, ...] = field(default=())

    @property
    def extra_args(self) -> dict[str, Any]:
        """A fresh ``extra_args`` dict (plain data, safe to send to another process)."""
        return {KEY: copy.deepcopy(dict(self.wire))}

    @property
    def collect_args(self) -> tuple:
        return (self.rid, None)

    def captures(self, results: Sequence[Mapping]) -> dict[Address, torch.Tensor]:
        """Rows ``[1, positions, ...]`` per captured point (every position the engine ran for
        this request; ``pattern`` as ``[1, n_heads, positions, positions]``), from the workers'
        ``interp_collect`` answers."""
        found = [r for r in results if r.get("found")]
        if not found:
            raise KeyError(f"no worker holds captures for request {self.rid!r}: was it sent with "
                           "these extra_args, has it finished, and were they collected already?")
        errors = [r["error"] for r in found if r.get("error")]
        if errors:
            raise RuntimeError(f"request {self.rid!r} failed in the runtime: {errors[0]}")
        return {a: v.unsqueeze(0) for a, v in merge_ranks(self.reads, found).items()}


def wire_request(model: Any, points: Sequence[str | Address] = (), steer: Any = None,
                 rid: str | None = None) -> WireRequest:
    """The plan of one request (capture ``points``, apply ``steer``, a SteerSpec) as plain data,
    checked against ``model``'s graph: ``model`` is a loaded interp_engine Model or a model
    directory / hub name (only its config is read)."""
    from interp_engine._plan import capture_plan, steer_plan

    graph = getattr(model, "graph", None)
    if graph is None:
        from transformers import AutoConfig

        from interp_engine._model import resolve_model_path
        from specs import spec_for_config

        config = AutoConfig.from_pretrained(resolve_model_path(os.fspath(model)))
        graph = spec_for_config(config).graph_from_config(config)
    plan = capture_plan(graph, list(points)) | steer_plan(graph, steer)
    rid = rid or f"interp-{uuid.uuid4().hex}"
    from .validator import register_graph  # the admission check in this process knows the graph

    wire = plan_to_wire(plan, rid, model=register_graph(graph))
    return WireRequest(rid, MappingProxyType(wire), tuple(plan.reads))
