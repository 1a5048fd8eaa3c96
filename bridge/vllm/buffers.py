"""Where the worker runtime keeps a request's captured rows until its client collects them.

``Buffer``: one request's rows of one point, indexed by absolute position. ``Arena``: the rows
of one point for every request reading it, in one tensor where each request holds a region, so
that a decode step's rows of all its readers go in with one ``index_copy_`` (per-request copies
cost a few microseconds each: 16 requests capturing 8 points is 128 of them per step).
"""

from __future__ import annotations

import torch

__all__ = ["Arena", "Buffer"]


class Arena:
    """One point's rows for many requests: a CPU tensor of regions (first fit, neighbours
    merged when freed), dropped once every region is back."""

    __slots__ = ("data", "top", "free")

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.top = 0  # rows below this are in some region or in ``free``
        self.free: list[tuple[int, int]] = []  # (start, rows), sorted, none touching ``top``

    def take(self, size: int, like: torch.Tensor) -> int:
        """A region of ``size`` rows shaped like ``like``'s rows; its first row."""
        if self.data is not None and tuple(self.data.shape[1:]) != tuple(like.shape[1:]):
            raise ValueError(f"rows of shape {tuple(like.shape[1:])} in an arena of {tuple(self.data.shape[1:])}")
        for i, (start, n) in enumerate(self.free):
            if n >= size:
                self.free[i:i + 1] = [] if n == size else [(start + size, n - size)]
                return start
        start, self.top = self.top, self.top + size
        if self.data is None or self.top > self.data.shape[0]:
            rows = max(self.top, 256 if self.data is None else 2 * self.data.shape[0])
            grown = torch.empty((rows,) + tuple(like.shape[1:]), dtype=like.dtype)
            if self.data is not None:
                grown[:start] = self.data[:start]
            self.data = grown
        return start

    def give(self, start: int, size: int) -> None:
        """A region back."""
        self.free.append((start, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        if merged and merged[-1][0] + merged[-1][1] == self.top:
            self.top = merged.pop()[0]
        self.free = merged
        if self.top == 0:
            self.data = None  # nothing held: the memory goes back too

    def put(self, rows_at: torch.Tensor, rows: torch.Tensor) -> None:
        """``rows`` into the arena's rows ``rows_at`` (int64)."""
        self.data.index_copy_(0, rows_at, rows)


class Buffer:
    """One request's rows of one point: indexed by absolute position, sized for the whole
    request when it is admitted (``hint``), grown if a request outlives that. Its rows live in
    a region of ``arena`` while they fit there (a request that outgrows it moves to rows of its
    own). Which positions it holds is kept as plain ints: every position below ``covered`` is
    written, ``gaps`` holds written spans above it (none unless rows arrive out of order); a
    recomputed position keeps its last value."""

    __slots__ = ("own", "arena", "start", "size", "filled", "covered", "gaps", "hint")

    def __init__(self, hint: int = 16, arena: Arena | None = None) -> None:
        self.own: torch.Tensor | None = None
        self.arena = arena
        self.start = -1  # its region's first row in the arena (-1: none taken yet)
        self.size = 0
        self.filled = 0  # 1 + the highest position written
        self.covered = 0  # positions [0, covered) are all written
        self.gaps: list[tuple[int, int]] = []
        self.hint = hint

    @property
    def data(self) -> torch.Tensor | None:
        if self.start >= 0:
            return self.arena.data[self.start:self.start + self.size]
        return self.own

    def in_arena(self, top: int, like: torch.Tensor) -> bool:
        """Whether positions below ``top`` fit in this buffer's arena region (taken now if
        none is yet)."""
        if self.start < 0:
            if self.arena is None or self.own is not None:
                return False
            self.size = max(top, self.hint)
            self.start = self.arena.take(self.size, like)
        return top <= self.size

    def _room(self, top: int, rows: torch.Tensor) -> None:
        if self.start < 0 and self.own is None and self.arena is not None:
            self.in_arena(top, rows)
        have = self.data
        if have is None or top > have.shape[0]:
            capacity = max(top, self.hint) if have is None else max(top, 2 * have.shape[0])
            grown = torch.empty((capacity,) + tuple(rows.shape[1:]), dtype=rows.dtype)
            if have is not None:
                grown[: self.filled] = have[: self.filled]
            self.drop()
            self.own = grown

    def mark(self, first: int, top: int) -> None:
        """Positions ``first .. top - 1`` are written."""
        if first <= self.covered and not self.gaps:  # in order (every step of a request, bar drafts)
            if top > self.covered:
                self.covered = top
            if top > self.filled:
                self.filled = top
            return
        self.filled = max(self.filled, top)
        if first > self.covered:
            self.gaps.append((first, top))
            return
        self.covered = max(self.covered, top)
        if self.gaps:
            self.gaps.sort()
            left = []
            for lo, hi in self.gaps:
                if lo <= self.covered:
                    self.covered = max(self.covered, hi)
                else:
                    left.append((lo, hi))
            self.gaps = left

    def put(self, first: int, rows: torch.Tensor) -> None:
        """``rows`` at positions ``first, first + 1, ...`` (what one forward holds of a request)."""
        top = first + rows.shape[0]
        if top == first:
            return
        if self.start >= 0 and top <= self.size:  # in its region: one slice of the arena
            self.arena.data[self.start + first:self.start + top] = rows
        else:
            data = self.data
            if data is None or top > data.shape[0]:
                self._room(top, rows)
                data = self.data
            data[first:top] = rows
        self.mark(first, top)

    def put_at(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """``rows`` at arbitrary ``positions`` (int64 ``[rows]``)."""
        if positions.numel() == 0:
            return
        index = positions.long()
        self._room(int(index.max()) + 1, rows)
        self.data.index_copy_(0, index, rows)
        for p in sorted(set(index.tolist())):
            self.mark(p, p + 1)

    def complete(self, rows: int) -> bool:
        return self.data is not None and self.covered >= rows

    def drop(self) -> None:
        """Let the rows go (its arena region back)."""
        if self.start >= 0:
            self.arena.give(self.start, self.size)
            self.start = -1
        self.own = None
