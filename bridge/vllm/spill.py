"""Captured rows of a collect rpc through a file instead of through the rpc's answer.

A multiprocess engine carries an rpc's answer from the worker to the engine core and on to the
client, serialized at each hop: for sixteen requests capturing three points (about 1 MB of
rows) that took about 3 ms, every engine step waiting behind it, where an empty rpc takes a
quarter of a millisecond. So the client makes one empty file per rank (``SpillFiles.make``)
and names it in the rpc; each worker writes the rows of its answers into its file with one
``writev`` and answers with where each tensor lies (``encode``); the client reads each file once
and takes the rows as views of its private mapping of it (``SpillFiles.take``), then
removes the files.

A worker that cannot open its file (it runs on another machine) or fails to write it, and
answers too small to be worth a file, send their rows in the answer as before: the client
takes either. Nothing but the rows moves: errors and status stay in the answer.
"""

from __future__ import annotations

import mmap
import os
import uuid

import numpy as np
import torch

from .board import shared_dir
from .sink import write_rows
from .wire import tensor_to_wire

__all__ = ["SpillFiles", "as_rows", "encode"]

MIN_BYTES = 64 << 10  # below this, the rpc's own serialization costs less than a file
_IOV = 512  # pieces per pwritev (IOV_MAX is 1024 on Linux)


class SpillFiles:
    """The client's side: where workers may write a collect rpc's rows, one file per rank."""

    def __init__(self, world: int, directory: str | None = None) -> None:
        if directory is None:
            directory = shared_dir()
        self.world, self.directory = int(world), directory

    def make(self) -> str:
        """A fresh base path; the file of rank r is ``f"{base}.{r}"``, made empty here (a
        worker only opens it: it never creates one, so a worker elsewhere writes nothing)."""
        base = os.path.join(self.directory, f"interp-engine-rows-{uuid.uuid4().hex}")
        for rank in range(self.world):
            os.close(os.open(f"{base}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return base

    def take(self, base: str, answers) -> None:
        """Resolve the spilled rows of ``answers`` (a list per rank of collect answers, or an
        exception) in place: each ``[dtype, shape, [at, n]]`` becomes ``[dtype, shape, rows]``,
        a view of the rank's file as read; then remove every rank's file."""
        try:
            if isinstance(answers, BaseException):
                return
            read: dict[int, memoryview] = {}
            for per_rank in answers:
                for answer in per_rank:
                    if not answer.get("spilled"):
                        continue
                    rank = int(answer.get("rank", 0))
                    if rank not in read:
                        read[rank] = _read(f"{base}.{rank}")
                    data = read[rank]
                    for key, (dtype, shape, where) in list(answer["values"].items()):
                        if isinstance(where, (list, tuple)):
                            at, n = where
                            if at + n > len(data):
                                raise RuntimeError(f"rank {rank}'s rows file ends at byte {len(data)}, "
                                                   f"its answer says {key} ends at {at + n}")
                            answer["values"][key] = (dtype, shape, data[at:at + n])
        finally:
            self.remove(base)

    def remove(self, base: str) -> None:
        for rank in range(self.world):
            try:
                os.unlink(f"{base}.{rank}")
            except FileNotFoundError:
                pass


def _read(path: str) -> memoryview:
    """The file's bytes, mapped privately (no copy: its pages are the ones the worker wrote, and
    a write to a tensor viewing them changes only this process's copy). The mapping lives as
    long as a tensor views it; the file itself is removed right after."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return memoryview(bytearray())
        return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY))


def as_rows(value: torch.Tensor) -> torch.Tensor:
    """What a worker's collect keeps of a point's rows until ``encode``: a contiguous CPU tensor."""
    return value.detach().to("cpu").contiguous()


def encode(answers: list[dict], path: str | None) -> None:
    """The worker's side: write the rows of ``answers`` (tensors, from ``as_rows``) into
    ``path`` (made by the client) and put ``(dtype, shape, [at, n])`` in place of each; or, when
    they are small, or the file cannot be opened or written here, make them wire tensors
    ``(dtype, shape, bytes)`` that travel in the answer."""
    pieces = [(answer, key, value) for answer in answers for key, value in answer.get("values", {}).items()
              if isinstance(value, torch.Tensor)]
    if path and pieces and _spill(pieces, path):
        return
    for answer, key, value in pieces:
        answer["values"][key] = tensor_to_wire(value)


def _spill(pieces: list, path: str) -> bool:
    views = [value.view(-1).view(torch.uint8).numpy() for _, _, value in pieces if value.numel()]
    total = sum(v.nbytes for v in views)
    if total < MIN_BYTES:
        return False
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return False  # not on this machine: the rows go in the answer
    try:
        if _write_all(fd, views) != total:
            return False
    except OSError:
        return False  # a full disk, say: the rows go in the answer, nothing is lost
    finally:
        os.close(fd)
    at = 0
    for answer, key, value in pieces:
        dtype = str(value.dtype).replace("torch.", "")
        if not value.numel():
            answer["values"][key] = tensor_to_wire(value)
            continue
        n = value.numel() * value.element_size()
        answer["values"][key] = (dtype, list(value.shape), [at, n])
        answer["spilled"] = True
        at += n
    return True


def _write_all(fd: int, buffers: list) -> int:
    """Write ``buffers`` one after another from byte 0 of ``fd`` (``pwritev`` a few hundred at
    a time: the system caps one call's pieces); the bytes written."""
    done = 0
    for i in range(0, len(buffers), _IOV):
        chunk = [memoryview(b).cast("B") for b in buffers[i:i + _IOV]]
        size = sum(len(v) for v in chunk)
        n = os.pwritev(fd, chunk, done)
        if n < size:  # a short write: the rest of this chunk one piece at a time
            skip, left = n, []
            for view in chunk:
                if skip >= len(view):
                    skip -= len(view)
                    continue
                left.append(view[skip:])
                skip = 0
            at = done + n
            for view in left:
                write_rows(fd, np.frombuffer(view, dtype=np.uint8), at)
                at += len(view)
        done += size
    return done
