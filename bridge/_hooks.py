"""Hook lowering shared by the eager bridge: turn a Plan's reads and writes into forward hooks
on named modules, scoped to one forward call and removed on every path.

Hook closures do the least possible work (no shape checks, no allocation beyond the op):
they run on every layer of every decode step. The op math and row selection they apply are the
backend-neutral ones in ``interp_engine._ops``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

__all__ = ["ForwardWindow", "HookSet"]


@dataclass(frozen=True)
class ForwardWindow:
    """Which absolute positions the columns of one forward hold."""

    start: int
    length: int
    prompt_len: int | None  # None: the whole input is prompt (no generation)

    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.length)

    @property
    def prompt_end(self) -> int:
        return self.prompt_len if self.prompt_len is not None else self.start + self.length


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

    def rewrite(self, module: nn.Module, fn: Callable[[tuple], tuple]) -> None:
        """Register ``fn(outputs) -> outputs`` on a module that returns a tuple (a write that
        needs several of its outputs: an MoE router's weights and the experts they belong to)."""
        self._handles.append(module.register_forward_hook(lambda mod, args, out: fn(out)))

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    @contextlib.contextmanager
    def active(self) -> Iterator["HookSet"]:
        try:
            yield self
        finally:
            self.remove()
