"""A status board: how a steering-only request ends without a collect rpc.

A request that only writes (steers, patches, ablates) brings nothing back from the workers, yet
the client must still learn whether every worker served its plan (a worker that could not admit
it, or failed while applying it, must fail the request: nothing is dropped silently), and the
workers must free its state. Asking through ``collective_rpc`` costs a round trip through the
engine core per finishing step (about 0.7 ms on CPU: a quarter of a one-request prefill).

So the client keeps a small file of status bytes (``StatusBoard``), one row per request slot and
one byte per worker rank, and names a slot in the request's plan. Each worker's runtime writes
its byte when it admits the request (``OK``) and again whenever serving it fails (``FAILED``),
always inside the forward, so before the step's outputs leave the worker; the client, once it
holds the request's last output, reads the row. Every rank ``OK``: done, no rpc (the workers
free such a request themselves when vLLM lets it go). Anything else (a failure, or a worker on
another machine that cannot open the file and wrote nothing) falls back to the collect rpc, which
brings the error back. A slot is zeroed before it is handed out again, and handed out again only
once no worker can still write for its last request.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid
import weakref

__all__ = ["BoardFiles", "StatusBoard", "OK", "FAILED", "shared_dir"]

OK, FAILED = 1, 2
_SLOTS = 4096


def shared_dir() -> str:
    """Where the client makes the files its workers write into: memory (/dev/shm) where it may."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class StatusBoard:
    """The client's status file: ``slots`` rows of ``world`` bytes, mapped."""

    def __init__(self, world: int, slots: int = _SLOTS, directory: str | None = None) -> None:
        if directory is None:
            directory = shared_dir()
        self.world, self.slots = int(world), int(slots)
        self.path = os.path.join(directory, f"interp-engine-board-{uuid.uuid4().hex}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.world * self.slots)
            self._map = mmap.mmap(fd, self.world * self.slots)
        finally:
            os.close(fd)
        self._free = list(range(self.slots - 1, -1, -1))
        self._done = bytes([OK]) * self.world
        # a client that exits without closing its model still removes the file
        self._unlink = weakref.finalize(self, _unlink, self.path)

    def take(self) -> int | None:
        """A free slot, its row zeroed (None when all are taken: the request collects by rpc)."""
        if not self._free:
            return None
        slot = self._free.pop()
        at = slot * self.world
        self._map[at:at + self.world] = bytes(self.world)
        return slot

    def where(self, slot: int) -> dict:
        """The plan's ``board`` entry for ``slot``: the file and the byte of rank 0."""
        return {"path": self.path, "at": slot * self.world}

    def ok(self, slot: int) -> bool:
        """Whether every rank admitted the request in ``slot`` and none failed serving it."""
        at = slot * self.world
        return self._map[at:at + self.world] == self._done

    def give(self, slot: int) -> None:
        """``slot`` back (no worker writes for its request any more)."""
        self._free.append(slot)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self._unlink()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class BoardFiles:
    """The boards a worker writes into, mapped: a status byte is a store, not a system call
    (a step may admit sixteen requests). ``path -> map`` (None: not on this machine)."""

    def __init__(self) -> None:
        self.open: dict[str, mmap.mmap | None] = {}

    def mark(self, path: str, at: int, value: int) -> bool:
        """Write ``value`` at byte ``at`` of board ``path``; False where the file cannot be
        opened here (the client is on another machine: it collects by rpc) or has no byte
        ``at`` (a plan that names a row of some other file)."""
        board = self.open.get(path, -1)
        if board == -1:
            board = self.open[path] = _map(path)
        if board is None or not 0 <= at < len(board):
            return False
        board[at] = value
        return True

    def close_all(self) -> None:
        for board in self.open.values():
            if board is not None:
                board.close()
        self.open.clear()


def _map(path: str) -> mmap.mmap | None:
    """The board at ``path`` mapped for writing (the client made it: never created here)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size) if size else None
    except OSError:
        return None
    finally:
        os.close(fd)
