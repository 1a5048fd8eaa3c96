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

__all__ = ["AFFINE", "OP_MATH", "Selection", "apply_write", "attention_pattern", "effective_vector",
           "expert_factor", "reshape_point", "route", "select_rows", "selector_columns", "stored",
           "weight_experts"]


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


def _zero(region, vec, base):
    return torch.zeros_like(region) if base is None else -base


def _scale(region, vec, base):  # vec is the factor, a 0-d tensor
    full = region if base is None else region + base
    new = full * vec.to(region.dtype)
    return new if base is None else new - base


OP_MATH: dict[str, Callable] = {"add": _add, "set": _set, "ablate": _ablate, "zero": _zero,
                                "mean": _set, "scale": _scale, "patch": _set}
"""op -> f(region, effective vector, base) -> new region. ``base`` (or None) is what the tensor
being written is offset from the point's value by: the op reads ``region + base`` and the result
is written back minus ``base`` (vLLM's fused layers carry resid_mid as ``x + residual``).
``mean`` and ``patch`` write given values as ``set`` does (a mean vector; another run's values
per position); ``zero`` writes zeros; ``scale`` multiplies by the factor."""

AFFINE: dict[str, tuple[str, float]] = {"add": ("1", 0.0), "set": ("0", 0.0), "mean": ("0", 0.0),
                                        "patch": ("0", 0.0), "ablate": ("1", 1.0), "zero": ("0", 0.0),
                                        "scale": ("factor", 0.0)}
"""Each op as ``s * x + v - p * (x . u) u`` (what a compiled steering site evaluates): ``s`` is 1,
0 or the op's factor, ``p`` 1 for a projection. ``v`` is the effective vector for add / set /
mean / patch and zero for the others; ``u`` the unit direction for ablate."""


def affine(kind: str, scale: float) -> tuple[float, float]:
    s, p = AFFINE[kind]
    return (float(scale) if s == "factor" else float(s)), p


def effective_vector(kind: str, vec: torch.Tensor | None, scale: float,
                     cols: torch.Tensor | None = None) -> torch.Tensor:
    """What an op writes with: ``scale * vector`` for add, the unit direction for ablate (the
    direction restricted to ``cols``, then normalised), the factor (0-d) for scale, nothing
    (an empty tensor) for zero, the values themselves for set / mean / patch. With ``cols``
    (a head or neuron selector's columns) the vector keeps only those columns."""
    if kind == "scale":
        return torch.tensor(float(scale), dtype=torch.float64 if vec is None else vec.dtype)
    if kind == "zero":
        return torch.zeros(0)
    if cols is not None:
        vec = vec.index_select(-1, cols.to(vec.device))
    if kind == "add":
        return vec * scale
    if kind == "ablate":
        norm = vec.norm()
        if not float(norm.detach()) > 0:
            raise ValueError("the ablation direction is zero on the selected heads or neurons")
        return vec / norm
    return vec


def selector_columns(select, unit: tuple[int, ...]) -> torch.Tensor | None:
    """The columns of a point's flat per-token row (``unit`` its per-token shape, e.g.
    ``(n_heads, d_head)``) that a selector ``(kind, indices)`` names: whole heads (every
    ``d_head`` column of each head) or single neurons. None: every column."""
    if select is None:
        return None
    _, indices = select
    index = torch.as_tensor(indices, dtype=torch.long)
    inner = 1
    for size in unit[1:]:
        inner *= size
    if inner == 1:
        return index
    return (index[:, None] * inner + torch.arange(inner)[None, :]).flatten()


def apply_write(kind: str, x: torch.Tensor, vec: torch.Tensor, sel: Selection,
                base: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., rows, width]`` with op ``kind`` written at ``sel``'s rows (and only at
    columns ``cols`` when given: a head or neuron selector); out of place. A per-position
    vector is ``[n, k]``, or ``[batch, n, k]`` for a batch-aware patch."""
    rows, vector_rows = sel.rows, sel.vector_rows
    if vector_rows is not None:
        vec = vec.index_select(-2, vector_rows)
    if rows is None and cols is None:
        return OP_MATH[kind](x, vec, base)
    region = x if rows is None else x.index_select(-2, rows)
    b = base if base is None or rows is None else base.index_select(-2, rows)
    if cols is None:
        new = OP_MATH[kind](region, vec, b)
    else:
        sub = OP_MATH[kind](region.index_select(-1, cols), vec,
                            None if b is None else b.index_select(-1, cols))
        new = region.clone()
        new.index_copy_(-1, cols, sub)
    if rows is None:
        return new
    out = x.clone()
    out.index_copy_(-2, rows, new)
    return out


def expert_factor(kind: str, scale: float) -> float:
    """What an ``experts=`` write multiplies its experts' routing weights by: 0 for zero, the
    factor for scale."""
    return 0.0 if kind == "zero" else float(scale)


def weight_experts(weights: torch.Tensor, indices: torch.Tensor, experts: torch.Tensor, factor: float,
                   sel: Selection) -> torch.Tensor:
    """Routing weights ``[..., rows, top_k]`` (``indices`` the experts they belong to) with those
    of ``experts`` multiplied by ``factor`` at ``sel``'s rows; out of place. An expert's share of
    an MoE block's output is its weight times its output, so this zeroes or scales exactly that
    share and leaves the other experts' as they were."""
    hit = torch.isin(indices, experts)
    if sel.rows is not None:
        row = torch.zeros(weights.shape[-2], dtype=torch.bool, device=weights.device)
        row[sel.rows.to(weights.device)] = True
        hit = hit & row.unsqueeze(-1)
    return torch.where(hit, weights * factor, weights)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE router's selection from its logits ``[..., n_experts]``: ``(weights, indices)``,
    each ``[..., top_k]``, best expert first. The rule vLLM's fused MoE applies (its CPU router,
    and the same math as its GPU kernel): the top-k logits, then the softmax over those k
    (``renormalize``: equal to the renormalised top-k of the softmax over all experts, as
    Qwen3-MoE, Mixtral and GPT-OSS apply it) or each one's share of the softmax over all experts.
    Weights in float32, as the fused kernel uses them."""
    values, indices = torch.topk(logits.float(), top_k, dim=-1)
    if renormalize:
        weights = torch.softmax(values, dim=-1)
    else:
        weights = (values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).exp()
    return weights, indices


def attention_pattern(q: torch.Tensor, k: torch.Tensor, *, scale: float, window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The attention probabilities of one sequence, ``[n_heads, pos, key_pos]``, from its queries
    ``q`` ``[pos, n_heads, d_head]`` and keys ``k`` ``[pos, n_kv_heads, d_head]`` as the attention
    kernel receives them (after rotary embedding), position ``i`` at row ``i``. The pattern point's
    definition, for every architecture: scores ``q . k * scale`` (query head ``h`` reads KV head
    ``h // (n_heads / n_kv_heads)``), soft-capped as ``softcap * tanh(s / softcap)``, causal (key
    ``j <= i``) and within ``window`` keys when given (``i - j < window``); softmax in float32 over
    the keys, with one learned logit per head (``sinks``, ``[n_heads]``) joining the denominator
    where the model has attention sinks (its share is dropped: such a row sums to less than 1).
    Masked keys get probability 0. Returned in ``q``'s dtype."""
    n, n_heads, _ = q.shape
    groups = n_heads // k.shape[1]
    kk = k.float().repeat_interleave(groups, dim=1)  # [keys, n_heads, d_head]
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(k.shape[0], device=q.device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(q.dtype)
    sink = sinks.float().reshape(n_heads, 1, 1).expand(n_heads, n, 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)


def stored(t: torch.Tensor) -> torch.Tensor:
    """What a capture keeps of a tensor that the engine may overwrite later (vLLM's buffers,
    CUDA's in-place fused norms): a copy of its value, on the CPU."""
    return t.detach().to("cpu", copy=True)


_POST: dict[str | None, Callable] = {
    None: lambda t, graph, lead: t,
    "heads": lambda t, graph, lead: t.reshape(*lead, graph.n_heads, graph.d_head),
    "kv_heads": lambda t, graph, lead: t.reshape(*lead, graph.n_kv_heads, graph.d_head),
    "flat": lambda t, graph, lead: t.reshape(*lead, -1),
    # already split into heads, heads before positions ([batch, heads, pos, d_head]: Gemma 3
    # norms q and k after moving heads forward)
    "heads_first": lambda t, graph, lead: t.transpose(-3, -2),
}


def reshape_point(t: torch.Tensor, post: str | None, graph, lead: tuple[int, ...]) -> torch.Tensor:
    """A raw tap tensor as its point's shape: ``lead`` is ``(batch, pos)`` (eager) or ``(rows,)``
    (vLLM); ``post`` splits heads (``heads``/``kv_heads``), views flat tokens (``flat``) or
    moves heads after positions (``heads_first``)."""
    return _POST[post](t, graph, lead)
