"""Token batches: ids plus an attention mask, right-padded so positions stay absolute."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

__all__ = ["TokenBatch", "TokensLike", "as_batch"]


@dataclass(frozen=True, eq=False)
class TokenBatch:
    """``ids`` ``[batch, pos]`` (int64, right-padded) and ``attention_mask`` ``[batch, pos]``."""

    ids: torch.Tensor
    attention_mask: torch.Tensor
    padded: bool = field(default=None, compare=False)  # computed from the mask when not given

    def __post_init__(self) -> None:
        if self.padded is None:
            object.__setattr__(self, "padded", bool((self.attention_mask == 0).any()))

    @property
    def shape(self) -> torch.Size:
        return self.ids.shape

    @property
    def lengths(self) -> list[int]:
        return [int(n) for n in self.attention_mask.sum(dim=1)]

    def row(self, i: int) -> list[int]:
        if not self.padded:
            return self.ids[i].tolist()
        return self.ids[i, : self.lengths[i]].tolist()

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __repr__(self) -> str:
        return f"TokenBatch(shape={tuple(self.ids.shape)}, lengths={self.lengths})"


TokensLike = Union[TokenBatch, torch.Tensor, Sequence[int], Sequence[Sequence[int]]]


def _from_rows(rows: list[list[int]], pad_id: int) -> TokenBatch:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return TokenBatch(ids, mask)


def flat_ids(tokens: object, d_vocab: int) -> list[int] | None:
    """One prompt given as a list (or tuple) of ids, checked as ``as_batch`` checks it, without
    building a batch (a generation request's common case); None for anything else."""
    if not isinstance(tokens, (list, tuple)) or not tokens:
        return None
    if not all(type(t) is int for t in tokens):  # bools, numpy ints, nested rows: the general path
        return None
    if min(tokens) < 0 or max(tokens) >= d_vocab:
        bad = [t for t in tokens if t < 0 or t >= d_vocab][:5]
        raise ValueError(f"token ids outside the vocabulary [0, {d_vocab}): {bad}")
    return list(tokens)


def as_batch(tokens: TokensLike, d_vocab: int, pad_id: int = 0) -> TokenBatch:
    """Normalise what users pass (a TokenBatch, a ``[pos]`` or ``[batch, pos]`` tensor, a list
    of ids, or a list of lists) and check it: non-empty, integer, ids inside the vocabulary."""
    if isinstance(tokens, TokenBatch):
        batch = tokens
    elif isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got dtype {tokens.dtype}")
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 2:
            raise ValueError(f"token ids must be [pos] or [batch, pos], got shape {tuple(tokens.shape)}")
        ids = tokens.to(torch.long).cpu()
        if ids.shape[1] == 0:
            raise ValueError("empty prompt: pass at least one token id")
        low, high = torch.aminmax(ids)
        if int(low) < 0 or int(high) >= d_vocab:
            bad = ids[(ids < 0) | (ids >= d_vocab)][:5].tolist()
            raise ValueError(f"token ids outside the vocabulary [0, {d_vocab}): {bad}")
        return TokenBatch(ids, torch.ones_like(ids), padded=False)  # the fast path: no mask to check
    elif isinstance(tokens, (list, tuple)):
        if len(tokens) == 0:
            raise ValueError("empty prompt: pass at least one token id")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            rows = [list(tokens)]
        elif all(isinstance(t, (list, tuple)) for t in tokens):
            rows = [list(r) for r in tokens]
            if any(len(r) == 0 for r in rows):
                raise ValueError("empty prompt in batch: every row needs at least one token id")
            if not all(isinstance(t, int) and not isinstance(t, bool) for r in rows for t in r):
                raise TypeError("token ids must be ints")
        else:
            raise TypeError(
                f"cannot read tokens from {type(tokens).__name__} of mixed items: pass a list of "
                "ids, a list of lists, a tensor, or model.to_tokens(text)"
            )
        if all(len(r) == len(rows[0]) for r in rows):
            # one prompt, or rows of one length (the common case): no padding, so no mask to
            # build or check; the ids are checked here, as Python ints (56 -> 9 us a prompt)
            if min(map(min, rows)) < 0 or max(map(max, rows)) >= d_vocab:
                bad = [t for r in rows for t in r if t < 0 or t >= d_vocab][:5]
                raise ValueError(f"token ids outside the vocabulary [0, {d_vocab}): {bad}")
            ids = torch.tensor(rows, dtype=torch.long)
            return TokenBatch(ids, torch.ones_like(ids), padded=False)
        batch = _from_rows(rows, pad_id)
    elif isinstance(tokens, str):
        raise TypeError("got a str where token ids were expected: call model.to_tokens(text) first")
    else:
        raise TypeError(f"cannot read tokens from {type(tokens).__name__}")
    if batch.ids.shape[1] == 0:
        raise ValueError("empty prompt: pass at least one token id")
    if (batch.attention_mask.sum(dim=1) == 0).any():
        raise ValueError("empty prompt in batch: every row needs at least one real token")
    real = batch.ids[batch.attention_mask.bool()]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= d_vocab):
        bad = real[(real < 0) | (real >= d_vocab)][:5].tolist()
        raise ValueError(f"token ids outside the vocabulary [0, {d_vocab}): {bad}")
    mask = batch.attention_mask
    # Right padding only: each row's real tokens must be a prefix.
    if bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError("attention_mask must be right-padded (real tokens first, then padding)")
    return batch
