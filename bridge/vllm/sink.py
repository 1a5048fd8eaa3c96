"""Harvest rows straight into the client's file, as each forward's rows are read.

A harvest request's plan names a sink: a float32 file the client made at its full size and
maps, and where each point's rows of this request go in it (``wire.WireSink``). The worker
runtime writes a forward's rows of such a request at their positions as soon as it has read
them (``SinkWriter.write``): no per-request buffer, no copy at the end, and nothing to do when
the client asks for the request's status but check that every position was written. Files
stay open while a request writes into them, shared by every request that names the same file
(``SinkFiles``): one ``open`` per file, not one per request and point.

A file this process cannot open (a worker on another machine than the client) raises
``FileNotFoundError`` from ``SinkWriter``: the runtime then buffers the rows and sends them
back through the collect rpc, as for any capture.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from interp_engine._address import Address

from .wire import WireSink

__all__ = ["SinkFiles", "SinkWriter", "rows_are_values", "write_rows"]


def rows_are_values(tap) -> bool:
    """Whether the rows a worker reads at ``tap`` (a spec's ``VllmTap``) are the point's values,
    row-major, so they can go into a sink as they are read: every tap but ``attn_qk``, whose
    pattern is rebuilt from q and k when the request ends. The client (which plans) and the
    worker (which writes) both ask this."""
    return tap.source != "attn_qk"


class SinkFiles:
    """The sink files open in this worker: ``path -> [fd, size in bytes, writers]``."""

    def __init__(self) -> None:
        self.open: dict[str, list[int]] = {}

    def acquire(self, path: str) -> tuple[int, int]:
        entry = self.open.get(path)
        if entry is None:
            fd = os.open(path, os.O_WRONLY)  # the client made it at its full size: never create
            entry = self.open[path] = [fd, os.fstat(fd).st_size, 0]
        entry[2] += 1
        return entry[0], entry[1]

    def close_all(self) -> None:
        for fd, _, _ in self.open.values():
            os.close(fd)
        self.open.clear()

    def release(self, path: str) -> None:
        entry = self.open.get(path)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] <= 0:
            del self.open[path]
            os.close(entry[0])


class _Written:
    """Which positions of one point a request wrote: every one below ``covered`` (rows arrive in
    order, one forward after another), and a per-position array only once some arrive out of
    order (drafts): a prefill's request costs two integer updates, not array writes and scans."""

    __slots__ = ("n", "covered", "seen")

    def __init__(self, n: int) -> None:
        self.n = n
        self.covered = 0
        self.seen: np.ndarray | None = None

    def mark(self, first: int, top: int) -> None:
        if self.seen is None:
            if first <= self.covered:
                if top > self.covered:
                    self.covered = top
                return
            self.seen = np.zeros(self.n, dtype=bool)
            self.seen[:self.covered] = True
        self.seen[first:top] = True

    def mark_at(self, positions: np.ndarray) -> None:
        if self.seen is None:
            self.seen = np.zeros(self.n, dtype=bool)
            self.seen[:self.covered] = True
        self.seen[positions] = True

    def complete(self, rows: int) -> bool:
        if rows <= self.covered:
            return True
        return self.seen is not None and rows <= self.n and bool(self.seen[:rows].all())

    def count(self) -> int:
        return self.covered if self.seen is None else int(self.seen.sum())


class SinkWriter:
    """One request's rows into its sink, and which positions of each point it wrote."""

    def __init__(self, sink: WireSink, files: SinkFiles) -> None:
        self.sink, self.files = sink, files
        self.fd, self.size = files.acquire(sink.path)
        self.open = True
        self.points: dict[Address, tuple[int, int, _Written]] = {}  # (offset, row bytes, written)

    def write(self, address: Address, rows: torch.Tensor, positions: np.ndarray) -> None:
        """``rows`` (``[k, width]``, on the CPU) at ``positions`` (``[k]``) of ``address``."""
        if not self.open:
            raise RuntimeError(f"rows of {address} arrived after the request's sink was closed")
        k = rows.shape[0]
        data = rows.reshape(k, -1)
        if data.dtype != torch.float32:
            data = data.to(torch.float32)
        data = data.numpy()
        at, row_bytes, written = self._point(address, data.shape[1] * 4)
        first, last = int(positions[0]), int(positions[-1])
        if last - first + 1 == k and 0 <= first and last < written.n:
            # one forward's rows of a request: consecutive positions, bar drafts
            write_rows(self.fd, data, at + first * row_bytes)
            written.mark(first, last + 1)
            return
        if int(positions.min()) < 0 or int(positions.max()) >= written.n:
            raise ValueError(f"{address}: positions {positions.tolist()} outside the sink's {written.n} rows")
        for row, p in zip(data, positions.tolist()):
            write_rows(self.fd, row, at + p * row_bytes)
        written.mark_at(positions)

    def place(self, address: Address, width: int, first: int, k: int) -> tuple[int, "_Written"] | None:
        """Where in the file ``k`` rows of ``width`` floats at positions ``first ..
        first + k - 1`` of ``address`` go (the byte), for a caller writing them itself (several
        requests' rows in one write), and the record it marks them written in afterwards
        (``written.mark(first, first + k)``); None where ``write`` must do it (positions outside
        the sink: it says what is wrong)."""
        if not self.open:
            return None
        at, row_bytes, written = self._point(address, width * 4)
        if first < 0 or first + k > written.n:
            return None
        return at + first * row_bytes, written

    def _point(self, address: Address, row_bytes: int) -> tuple[int, int, _Written]:
        """Where ``address``'s rows start in the file, their size, and which are written (its
        first rows: checked to fit the file)."""
        known = self.points.get(address)
        if known is None or known[1] != row_bytes:
            key, sink = str(address), self.sink
            at, n = sink.offsets[key], sink.positions
            if sink.widths is not None and 4 * sink.widths[key] != row_bytes:
                raise ValueError(f"{address}: rows of {row_bytes // 4} floats, but the client sized its sink "
                                 f"for {sink.widths[key]}")
            if at + n * row_bytes > self.size:
                raise ValueError(f"{address}: {n} rows of {row_bytes} bytes at byte {at} end past the end of "
                                 f"{sink.path} ({self.size} bytes)")
            known = self.points[address] = (at, row_bytes, known[2] if known is not None else _Written(n))
        return known

    def written(self, address: Address) -> int:
        """How many positions of ``address`` were written."""
        known = self.points.get(address)
        return 0 if known is None else known[2].count()

    def complete(self, address: Address, rows: int) -> bool:
        """Whether positions ``0 .. rows - 1`` of ``address`` were all written."""
        if rows <= 0:
            return True
        known = self.points.get(address)
        return known is not None and known[2].complete(rows)

    def close(self) -> None:
        """No more rows come (the request ended): let the file go; what was written is kept."""
        if self.open:
            self.open = False
            self.files.release(self.sink.path)


def write_rows(fd: int, data: np.ndarray, at: int) -> None:
    """All of ``data`` (contiguous rows) into ``fd`` at byte ``at``."""
    view = memoryview(np.ascontiguousarray(data)).cast("B")  # (rows of a contiguous buffer: no copy)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n
