"""Admission control for plans: a vLLM logits processor whose only work is ``validate_params``,
which vLLM calls in the frontend process for every request before it is scheduled — for an
in-process or multiprocess ``LLM``, ``AsyncLLM`` and ``vllm serve`` alike (a bad request there is
an HTTP 400). It checks a request's plan against the model graph registered in this process
(``register_graph``; ``load_model`` and ``interp-engine serve`` register theirs), or, where none
is, its structure and vector names. It leaves logits untouched. A plan this process's own client
built (``issue``) from a Plan already checked against the model passes without being parsed
again; the worker parses every plan in any case, and a bad one fails only its own request.
A plan comes as a mapping or packed into bytes (wire.py, ``pack_plan``).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from .wire import KEY, PACKED, PlanError, plan_from_args, unpack_plan

__all__ = ["PlanValidator", "fingerprint", "issue", "register_graph", "unregister_graph"]

_GRAPHS: dict[str, Any] = {}
# plans built here from checked Plans, not yet validated: a mapping's rid -> None, or a packed
# plan's id -> the bytes object itself (kept, so the id names that object and no later one)
_ISSUED: dict[str | int, Any] = {}
_ISSUED_KEEP = 1 << 13  # a request that never reached vLLM leaves its entry: keep the newest only


def issue(plan: str | bytes) -> None:
    """Mark a wire plan as built in this process from a Plan that capture_plan / steer_plan
    checked against the registered graph: validating it once more in the same process would
    only repeat that work (a parse of every vector, per request). ``plan``: a mapping plan's
    rid, or a packed plan (``pack_plan``), which passes only as this very bytes object."""
    if isinstance(plan, bytes):
        _ISSUED[id(plan)] = plan
    else:
        _ISSUED[plan] = None
    if len(_ISSUED) > _ISSUED_KEEP:
        del _ISSUED[next(iter(_ISSUED))]


def fingerprint(graph) -> str:
    return f"{graph.arch}:{graph.n_layers}:{graph.d_model}:{graph.d_vocab}"


def register_graph(graph) -> str:
    key = fingerprint(graph)
    _GRAPHS[key] = graph
    return key


def unregister_graph(graph) -> None:
    _GRAPHS.pop(fingerprint(graph), None)


def _served_graph():
    """The graph of the model a server names in ``INTERP_ENGINE_MODEL`` (interp-engine serve)."""
    import os

    path = os.environ.get("INTERP_ENGINE_MODEL")
    if not path:
        return None
    from transformers import AutoConfig

    from specs import spec_for_config

    config = AutoConfig.from_pretrained(path)
    graph = spec_for_config(config).graph_from_config(config)
    register_graph(graph)
    return graph


def graph_for(extra_args) -> Any:
    data = extra_args.get(KEY) if isinstance(extra_args, dict) else None
    if isinstance(data, dict) and data.get("model") in _GRAPHS:
        return _GRAPHS[data["model"]]
    if not _GRAPHS:
        return _served_graph()
    if len(_GRAPHS) == 1:
        return next(iter(_GRAPHS.values()))
    return None


class PlanValidator(LogitsProcessor):
    """Refuses a request whose plan cannot run, before vLLM schedules it."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        extra = getattr(sampling_params, "extra_args", None)
        if not extra:
            return
        data = extra.get(KEY) if isinstance(extra, dict) else None
        if isinstance(data, dict) and _ISSUED.pop(data.get("rid"), 0) is None:
            return  # checked where it was built (``issue``)
        if isinstance(data, bytes) and _ISSUED.pop(id(data), None) is data:
            return  # (packed: this very object was issued)
        try:
            if isinstance(data, PACKED):  # unpacked once, for the graph and the parse
                extra = {**extra, KEY: unpack_plan(data)}
            plan_from_args(extra, graph=graph_for(extra))
        except PlanError:
            raise
        except Exception as exc:  # anything else is still this request's fault, named
            raise PlanError(f"interp_engine plan: {exc}") from exc

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass
