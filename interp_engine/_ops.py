"""Backend-neutral intervention math: which rows an op touches, what it writes there, and how a
captured tensor takes its point's shape. Written once; the eager hooks and the vLLM runtime
both call these, so the two engines cannot disagree on what an op means.

Everything here works on ``[..., rows, width]`` tensors whose rows carry known absolute
positions: the columns of one eager forward window (``[batch, pos, d]``) or the flat rows of one
vLLM request (``[rows, d]``). No shape checks here: these run inside hooks on every layer of
every decode step.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = ["OP_MATH", "Selection", "apply_write", "reshape_point", "select_rows", "stored"]


class Selection(NamedTuple):
    """Which rows of a block an op writes: ``rows`` None means every row; ``vector_rows``
    picks the row of a per-position vector for each selected row (None: one vector for all)."""

    rows: torch.Tensor | None
    vector_rows: torch.Tensor | None
    empty: bool = False


EVERY_ROW = Selection(None, None)
NO_ROW = Selection(None, None, True)


def select_rows(positions_spec, per_position: bool, positions: torch.Tensor, prompt_len: int) -> Selection:
    """Rows of a block, at absolute ``positions`` (int64 ``[rows]``), that an op with
    ``positions_spec`` ("all" | "prompt" | "generated" | tuple of positions) writes.
    ``prompt_len`` splits prompt from generated positions."""
    if positions_spec == "all":
        return EVERY_ROW
    n = positions.shape[0]
    if positions_spec == "prompt":
        mask = positions < prompt_len
    elif positions_spec == "generated":
        mask = positions >= prompt_len
    else:
        wanted = torch.as_tensor(positions_spec, dtype=positions.dtype, device=positions.device)
        match = positions[:, None] == wanted[None, :]
        rows, vector_rows = torch.nonzero(match, as_tuple=True)
        if rows.numel() == 0:
            return NO_ROW
        return Selection(rows, vector_rows if per_position else None)
    rows = torch.nonzero(mask).flatten()
    if rows.numel() == 0:
        return NO_ROW
    if rows.numel() == n:
        return EVERY_ROW
    return Selection(rows, None)


def _add(region, vec, base):
    return region + vec


def _set(region, vec, base):
    new = vec.to(region.dtype).expand_as(region)
    return new if base is None else new - base


def _ablate(region, vec, base):  # vec is a unit direction
    full = region if base is None else region + base
    new = full - (full @ vec).unsqueeze(-1) * vec
    return new if base is None else new - base


OP_MATH: dict[str, Callable] = {"add": _add, "set": _set, "ablate": _ablate}
"""op -> f(region, effective vector, base) -> new region. ``base`` (or None) is what the tensor
being written is offset from the point's value by: the op reads ``region + base`` and the result
is written back minus ``base`` (vLLM's fused layers carry resid_mid as ``x + residual``)."""


def apply_write(kind: str, x: torch.Tensor, vec: torch.Tensor, sel: Selection,
                base: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., rows, width]`` with op ``kind`` written at ``sel``'s rows; out of place."""
    rows, vector_rows = sel.rows, sel.vector_rows
    if vector_rows is not None:
        vec = vec.index_select(0, vector_rows)
    if rows is None:
        return OP_MATH[kind](x, vec, base)
    region = x.index_select(-2, rows)
    b = None if base is None else base.index_select(-2, rows)
    out = x.clone()
    out.index_copy_(-2, rows, OP_MATH[kind](region, vec, b))
    return out


def stored(t: torch.Tensor) -> torch.Tensor:
    """What a capture keeps of a tensor that the engine may overwrite later (vLLM's buffers,
    CUDA's in-place fused norms): a copy of its value, on the CPU."""
    return t.detach().to("cpu", copy=True)


_POST: dict[str | None, Callable] = {
    None: lambda t, graph, lead: t,
    "heads": lambda t, graph, lead: t.reshape(*lead, graph.n_heads, graph.d_head),
    "kv_heads": lambda t, graph, lead: t.reshape(*lead, graph.n_kv_heads, graph.d_head),
    "flat": lambda t, graph, lead: t.reshape(*lead, -1),
}


def reshape_point(t: torch.Tensor, post: str | None, graph, lead: tuple[int, ...]) -> torch.Tensor:
    """A raw tap tensor as its point's shape: ``lead`` is ``(batch, pos)`` (eager) or ``(rows,)``
    (vLLM); ``post`` splits heads (``heads``/``kv_heads``) or views flat tokens (``flat``)."""
    return _POST[post](t, graph, lead)
