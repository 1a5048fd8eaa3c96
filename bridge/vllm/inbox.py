"""A capture's rows straight into a file the client maps: no collect rpc.

A capture request of a multiprocess engine gets its rows through the collect rpc when it ends:
client, engine core, workers and back, about 1.5 ms on CPU, on top of a sixteen-prompt prefill
step of about 9 ms. Instead its workers can write the rows where the client reads them, as
harvest's do (sink.py, float32), and say on the status board (board.py) that every row is in:
the client then copies them out of its mapping, with no rpc.
- A one-token request (``run_with_cache``, a prompt's capture) reads every row in its prefill:
  each forward's rows go in at their positions.
- A generation's rows are held in the workers' buffers as they are read (a write per request,
  point and step would cost more than the rpc saves) and written at once, one write per point,
  by the forward that reads its last position (``WireSink.hold``).
Anything else on the board (a failure, a generation that stopped before ``max_tokens``, a
worker on another machine that cannot open the file) falls back to the collect rpc, whose
answer holds the error or the rows.

``Inbox`` is that file: one per engine, sparse, cut into regions first fit. A region is one
request's sink (each read's rows in turn). It is reserved in the file (``posix_fallocate``) when
handed out, so a worker's write never meets a full tmpfs, and it is free again only once the
client read it (or gave the request up) and no worker can still write into it.
"""

from __future__ import annotations

import mmap
import os
import uuid
import weakref

import numpy as np
import torch

from .board import shared_dir

__all__ = ["Inbox"]

SIZE = 16 << 20  # bytes of the file: captures larger than a quarter of it go through the rpc
# a generation's region is held from its first step to its last: all of them together may take
# at most half the file, so long generations never leave one-token captures without room
HELD_SHARE = 0.5
_ALIGN = 64


class Inbox:
    """The client's rows file, mapped, and which of its bytes are handed out."""

    def __init__(self, size: int = SIZE, directory: str | None = None) -> None:
        if directory is None:
            directory = shared_dir()
        self.size = int(size)
        self.path = os.path.join(directory, f"interp-engine-inbox-{uuid.uuid4().hex}")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self._fd, self.size)
        self._map = mmap.mmap(self._fd, self.size, prot=mmap.PROT_READ)
        self._free: list[list[int]] = [[0, self.size]]  # [start, end) runs, in file order
        self.held = 0  # bytes handed out to generations (take(..., held=True))
        # a client that exits without closing its model still removes the file
        self._finalize = weakref.finalize(self, _remove, self.path, self._fd, self._map)

    def take(self, nbytes: int, held: bool = False) -> int | None:
        """The first byte of a free region of ``nbytes``, its pages reserved; None where none is
        free (or the file system has no room), or where a ``held`` region (a generation's) would
        take generations past ``HELD_SHARE`` of the file: the request collects by rpc."""
        n = -(-int(nbytes) // _ALIGN) * _ALIGN
        if n <= 0 or n > self.size // 4 or (held and self.held + n > self.size * HELD_SHARE):
            return None
        for i, (start, end) in enumerate(self._free):
            if end - start < n:
                continue
            try:
                os.posix_fallocate(self._fd, start, n)
            except OSError:
                return None
            if end - start == n:
                del self._free[i]
            else:
                self._free[i][0] = start + n
            if held:
                self.held += n
            return start
        return None

    def give(self, start: int, nbytes: int, held: bool = False) -> None:
        """The region at ``start`` back (nobody reads or writes it any more); ``held`` as taken."""
        n = -(-int(nbytes) // _ALIGN) * _ALIGN
        end = start + n
        if held:
            self.held -= n
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < start:
            i += 1
        free.insert(i, [start, end])
        if i + 1 < len(free) and free[i][1] == free[i + 1][0]:  # join the run after
            free[i][1] = free.pop(i + 1)[1]
        if i > 0 and free[i - 1][1] == free[i][0]:  # and the one before
            free[i - 1][1] = free.pop(i)[1]

    def read(self, at: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A copy of ``rows`` float32 rows of ``width`` at byte ``at``, as ``dtype``."""
        view = np.frombuffer(self._map, dtype=np.float32, count=rows * width, offset=at)
        out = torch.from_numpy(view.reshape(rows, width).copy())
        del view  # (the map cannot close while an array holds its buffer)
        return out if dtype == torch.float32 else out.to(dtype)

    def close(self) -> None:
        self._finalize()


def _remove(path: str, fd: int, mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a tensor still views it: the mapping goes with it
        pass
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
