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

One-token captures of the same row widths share a slab instead (``Inbox.rows``): a region laid
out point by point, each request taking the next rows of every point's block. Requests added
one after another sit side by side in a prefill's forward, so their rows of a point are also
side by side in the file, and a worker writes a compiled tap's rows of the whole batch in one
write (runtime ``_sink_together``) instead of one per request. A full slab goes back to the
file once the last request holding rows in it leaves it. The slab taking requests is kept when
its last one leaves (a client capturing one prompt at a time would otherwise reserve a new slab
per request, ~25 us of ``posix_fallocate`` each): the next request takes its first rows again.
Such idle slabs go back when the file has no other room (``reclaim``).
"""

from __future__ import annotations

import mmap
import os
import uuid
import weakref

import numpy as np
import torch

from .board import shared_dir

__all__ = ["Inbox", "Slab"]

SIZE = 16 << 20  # bytes of the file: captures larger than a quarter of it go through the rpc
# a generation's region is held from its first step to its last: all of them together may take
# at most half the file, so long generations never leave one-token captures without room
HELD_SHARE = 0.5
_ALIGN = 64
SLAB_BYTES = 2 << 20  # a slab of one-token captures; a request whose rows need more takes a region
SLAB_ROWS = 1024  # rows of each point a slab holds at most
_SLABS = 8  # slabs taking requests at once (one per set of widths), at most


class Slab:
    """A region shared by one-token captures whose reads have the same row ``widths``: point
    j's rows sit at ``blocks[j]``, ``capacity`` rows of ``widths[j]`` floats; the first ``used``
    rows of every block are taken, by ``users`` requests that have not left yet."""

    __slots__ = ("start", "nbytes", "widths", "capacity", "blocks", "used", "users")

    def __init__(self, start: int, nbytes: int, widths: tuple[int, ...], capacity: int) -> None:
        self.start, self.nbytes, self.widths, self.capacity = start, nbytes, widths, capacity
        blocks, at = [], start
        for w in widths:
            blocks.append(at)
            at += 4 * capacity * w
        self.blocks = tuple(blocks)
        self.used = 0
        self.users = 0


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
        # the whole file as floats, made once: a read slices it (a view per read costs 1 us more)
        self._floats = np.frombuffer(self._map, dtype=np.float32)
        self._free: list[list[int]] = [[0, self.size]]  # [start, end) runs, in file order
        self.held = 0  # bytes handed out to generations (take(..., held=True))
        self._slabs: dict[tuple[int, ...], Slab] = {}  # the slab taking requests, per set of widths
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
        if self.reclaim():  # no run fits: the idle slabs' room back, and look again
            return self.take(nbytes, held)
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

    def rows(self, widths: tuple[int, ...], n: int) -> tuple[Slab, tuple[int, ...]] | None:
        """``n`` rows of each of several points, ``widths`` floats a row, in the slab for those
        widths (a new one when it is full or there is none): the slab and the byte where each
        point's rows start. None where a slab cannot hold them: the caller takes a region."""
        row_bytes = 4 * sum(widths)
        capacity = min(SLAB_ROWS, SLAB_BYTES // row_bytes) if row_bytes else 0
        if n < 1 or n > capacity:
            return None
        slab = self._slabs.get(widths)
        if slab is None or slab.used + n > slab.capacity:
            if slab is not None:
                del self._slabs[widths]  # full: its rows go back once its users leave it
            if len(self._slabs) >= _SLABS and not (self.reclaim() and len(self._slabs) < _SLABS):
                return None
            start = self.take(capacity * row_bytes)
            if start is None:
                return None
            slab = self._slabs[widths] = Slab(start, capacity * row_bytes, widths, capacity)
        at = tuple(block + 4 * slab.used * w for block, w in zip(slab.blocks, widths))
        slab.used += n
        slab.users += 1
        return slab, at

    def leave(self, slab: Slab) -> None:
        """A request holding rows in ``slab`` is done with them (nobody reads them, and no
        worker can write them any more). The last one gives a full slab back, and leaves the
        slab taking requests idle: kept, its rows all free again."""
        slab.users -= 1
        if slab.users == 0:
            if self._slabs.get(slab.widths) is slab:
                slab.used = 0
            else:
                self.give(slab.start, slab.nbytes)

    def reclaim(self) -> bool:
        """The idle slabs (taking requests, but no request holds rows in them) back to the
        file; whether there were any."""
        idle = [widths for widths, slab in self._slabs.items() if slab.users == 0]
        for widths in idle:
            slab = self._slabs.pop(widths)
            self.give(slab.start, slab.nbytes)
        return bool(idle)

    def read(self, at: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A copy of ``rows`` float32 rows of ``width`` at byte ``at``, as ``dtype``."""
        first = at >> 2  # (regions and rows start on whole floats)
        out = torch.from_numpy(self._floats[first:first + rows * width].reshape(rows, width).copy())
        return out if dtype == torch.float32 else out.to(dtype)

    def read_batched(self, keys: tuple, at: tuple[int, ...], rows: int, widths: tuple[int, ...],
                     dtype: torch.dtype) -> dict:
        """``read`` of each ``keys[j]``'s rows at ``at[j]``, ``widths[j]`` floats a row, each
        copy shaped ``[1, rows, width]`` (a batch of one, as a capture returns it)."""
        floats, out = self._floats, {}
        for key, byte, width in zip(keys, at, widths):
            first = byte >> 2
            t = torch.from_numpy(floats[first:first + rows * width].reshape(1, rows, width).copy())
            out[key] = t if dtype == torch.float32 else t.to(dtype)
        return out

    def close(self) -> None:
        self._floats = None  # (the map cannot close while an array holds its buffer)
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
