"""Hook lowering shared by the eager bridge: turn a Plan's reads and writes into forward hooks
on named modules, scoped to one forward call and removed on every path.

Hook closures do the least possible work (no shape checks, no allocation beyond the op):
they run on every layer of every decode step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from interp_engine._plan import SteerOp

__all__ = ["ForwardWindow", "HookSet", "apply_op", "select_columns"]


@dataclass(frozen=True)
class ForwardWindow:
    """Which absolute positions the columns of one forward hold."""

    start: int
    length: int
    prompt_len: int | None  # None: the whole input is prompt (no generation)


def select_columns(op: SteerOp, window: ForwardWindow):
    """(cols, rows) for an op in a window: cols None = every column; () = skip this forward."""
    prompt_len = window.prompt_len if window.prompt_len is not None else window.start + window.length
    lo, hi = window.start, window.start + window.length
    if op.positions == "all":
        return None, None
    if op.positions == "prompt":
        end = min(hi, prompt_len) - lo
        if end <= 0:
            return (), None
        return (None if end >= window.length else slice(0, end)), None
    if op.positions == "generated":
        begin = max(lo, prompt_len) - lo
        if begin >= window.length:
            return (), None
        return (None if begin == 0 else slice(begin, window.length)), None
    pairs = [(p - lo, j) for j, p in enumerate(op.positions) if lo <= p < hi]
    if not pairs:
        return (), None
    cols = torch.tensor([c for c, _ in pairs], dtype=torch.long)
    rows = torch.tensor([j for _, j in pairs], dtype=torch.long) if op.vector.dim() == 2 else None
    return cols, rows


def apply_op(kind: str, x: torch.Tensor, vec: torch.Tensor, cols, rows) -> torch.Tensor:
    """Apply one steering op to ``x`` ``[batch, pos, d_model]`` (out of place)."""
    region = x if cols is None else x[:, cols]
    v = vec if rows is None else vec[rows]
    if kind == "add":
        new = region + v
    elif kind == "set":
        new = v.to(region.dtype).expand_as(region)
    else:  # ablate: v is a unit direction
        new = region - (region @ v).unsqueeze(-1) * v
    if cols is None:
        return new
    out = x.clone()
    out[:, cols] = new
    return out


class HookSet:
    """Registered hooks for one forward; a context manager that always removes them."""

    def __init__(self) -> None:
        self._handles: list = []

    def read(self, module: nn.Module, how: str, sink: list) -> None:
        """Append the tensor ``how`` names to ``sink`` on every call. Nothing is detached here:
        a detached capture runs under ``torch.no_grad`` already, so there is no graph to drop."""
        if how == "in":
            def pre(mod, args, kwargs):
                sink.append(args[0] if args else kwargs["hidden_states"])
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        elif how == "out":
            self._handles.append(module.register_forward_hook(lambda mod, args, out: sink.append(out)))
        else:
            index = int(how[3:])
            self._handles.append(module.register_forward_hook(
                lambda mod, args, out: sink.append(out[index])))

    def write(self, module: nn.Module, how: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Register ``fn(x) -> x'`` on the tensor ``how`` names."""
        if how == "in":
            def pre(mod, args, kwargs):
                if args:
                    return (fn(args[0]),) + tuple(args[1:]), kwargs
                kwargs = dict(kwargs)
                kwargs["hidden_states"] = fn(kwargs["hidden_states"])
                return args, kwargs
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            return

        if how == "out":
            self._handles.append(module.register_forward_hook(lambda mod, args, out: fn(out)))
            return
        index = int(how[3:])

        def hook(mod, args, out):
            return out[:index] + (fn(out[index]),) + out[index + 1:]
        self._handles.append(module.register_forward_hook(hook))

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    @contextlib.contextmanager
    def active(self) -> Iterator["HookSet"]:
        try:
            yield self
        finally:
            self.remove()
