"""The worker runtime's capture buffers (bridge/vllm/buffers.py): requests share one arena per
point, each in its own region; rows land at their positions whichever way they arrive, a
request that outgrows its region keeps every row, and regions come back for reuse."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bridge.vllm.buffers import Arena, Buffer


def _rows(first: int, n: int, width: int = 4, tag: float = 0.0) -> torch.Tensor:
    """Rows whose values name their position (and request)."""
    return torch.arange(first, first + n, dtype=torch.float32)[:, None].repeat(1, width) + tag


def test_requests_in_one_arena_keep_their_own_rows_and_positions():
    arena = Arena()
    a, b = Buffer(8, arena), Buffer(9, arena)
    a.put(0, _rows(0, 3, tag=100.0))
    b.put(0, _rows(0, 5, tag=200.0))
    assert a.start != b.start and a.arena is b.arena is arena
    for p in range(3, 7):  # decode steps, as the runtime's one-copy path does them
        assert a.in_arena(p + 1, _rows(p, 1)) and b.in_arena(p + 3, _rows(p, 1))
        arena.put(torch.tensor([a.start + p, b.start + p + 2]), torch.cat([_rows(p, 1, tag=100.0),
                                                                         _rows(p + 2, 1, tag=200.0)]))
        a.mark(p, p + 1)
        b.mark(p + 2, p + 3)
    assert a.complete(7) and not a.complete(8) and b.complete(9)
    assert torch.equal(a.data[:7], _rows(0, 7, tag=100.0))
    assert torch.equal(b.data[:9], _rows(0, 9, tag=200.0))


def test_a_request_that_outgrows_its_region_keeps_every_row():
    arena = Arena()
    a, b = Buffer(4, arena), Buffer(4, arena)
    a.put(0, _rows(0, 4, tag=1.0))
    b.put(0, _rows(0, 4, tag=2.0))
    a.put(4, _rows(4, 3, tag=1.0))  # past its 4 rows: moves to rows of its own
    assert a.start < 0 and a.own is not None and not a.in_arena(8, _rows(0, 1))
    b.put(4, _rows(4, 1, tag=2.0))  # b too; a's old region is free for the next request
    c = Buffer(4, arena)
    c.put(0, _rows(0, 2, tag=3.0))
    assert torch.equal(a.data[:7], _rows(0, 7, tag=1.0))
    assert torch.equal(b.data[:5], _rows(0, 5, tag=2.0))
    assert torch.equal(c.data[:2], _rows(0, 2, tag=3.0))


def test_rows_out_of_order_fill_gaps_and_regions_come_back():
    arena = Arena()
    a = Buffer(16, arena)
    a.put(4, _rows(4, 2))
    assert not a.complete(1) and a.filled == 6
    a.put_at(torch.tensor([3, 1]), torch.cat([_rows(3, 1), _rows(1, 1)]))
    a.put(0, _rows(0, 1))
    a.put(2, _rows(2, 1))
    assert a.complete(6) and torch.equal(a.data[:6], _rows(0, 6))
    b = Buffer(16, arena)
    b.put(0, _rows(0, 1))
    first = b.start
    a.drop()
    b.drop()
    assert arena.top == 0 and arena.free == [] and arena.data is None  # all back: memory too
    c, d = Buffer(16, arena), Buffer(16, arena)
    c.put(0, _rows(0, 1))
    d.put(0, _rows(0, 1))
    assert (c.start, d.start) == (0, first)
    c.drop()
    e = Buffer(8, arena)
    e.put(0, _rows(0, 1))
    assert e.start == 0 and arena.free == [(8, 8)]  # first fit: the freed region, what is left of it


def test_an_arena_refuses_rows_of_another_width():
    arena = Arena()
    Buffer(4, arena).put(0, _rows(0, 1, width=4))
    try:
        Buffer(4, arena).put(0, _rows(0, 1, width=5))
    except ValueError as exc:
        assert "shape" in str(exc)
    else:
        raise AssertionError("rows of another width went into the arena")


def test_a_decode_step_copies_the_rows_it_can_in_one_go_and_leaves_the_rest_to_their_own():
    """The runtime's one-copy path for a decode step (Runtime._read_decode): readers whose row
    is the next position of their region go in together; one that outgrew its region, and one
    whose row is not the position it expects, are handed back to be read on their own."""
    import numpy as np

    from bridge.vllm.runtime import Runtime

    arena = Arena()
    fits, outgrown, skipping, late = (Buffer(8, arena) for _ in range(4))
    for i, buffer in enumerate((fits, outgrown, skipping, late)):
        buffer.put(0, _rows(0, 4, tag=10.0 * i))
    outgrown.put(4, _rows(4, 5, tag=10.0))  # past its 8 rows: rows of its own now
    late.put(4, _rows(4, 1, tag=30.0))
    # this step's forward: rows 0..3 are [other request, late, fits, outgrown | skipping]
    positions = np.array([7, 5, 4, 9, 6])
    step = torch.stack([torch.full((4,), -1.0), torch.full((4,), 35.0), torch.full((4,), 4.0),
                        torch.full((4,), 19.0), torch.full((4,), 26.0)])
    buffers = [fits, outgrown, skipping, late]
    at_rows = np.array([2, 3, 4, 1])
    which = torch.tensor([2, 3, 4, 1])  # rows of ``step`` (lo = 0), in the readers' order
    rest = Runtime._read_decode(SimpleNamespace(pos_np=positions), [arena, which, buffers, at_rows, None], step)
    assert rest == [1, 2]  # outgrown (own rows), skipping (position 6, expects 4)
    assert fits.covered == 5 and torch.equal(fits.data[4], torch.full((4,), 4.0))
    assert late.covered == 6 and torch.equal(late.data[5], torch.full((4,), 35.0))
    assert outgrown.covered == 9 and skipping.covered == 4  # untouched: theirs to read
    assert torch.equal(skipping.data[:4], _rows(0, 4, tag=20.0))


def test_a_steady_decode_goes_through_its_run_and_falls_back_when_a_reader_strays():
    """After a step where every reader took its next row together, the steps after go through
    that step's _DecodeRun (one copy, no per-reader search). Each step's rows land at their
    positions; a reader whose position is not the one after last step's, and a region that
    would overflow, send the step the long way, with nothing lost and no neighbour's rows touched."""
    import numpy as np

    from bridge.vllm.runtime import Runtime, _DecodeRun

    arena = Arena()
    a, b = Buffer(8, arena), Buffer(8, arena)  # neighbouring regions of 8 rows each
    a.put(0, _rows(0, 4, tag=100.0))
    b.put(0, _rows(0, 6, tag=200.0))
    decode = [arena, None, [a, b], np.array([0, 1]), None]  # rows 0, 1 of each forward, in order
    runtime = SimpleNamespace()
    runs = 0
    for step in range(6):  # a reads 4..9, b 6..11: b's region (8 rows) is full after two steps
        pa, pb = 4 + step, 6 + step
        runtime.pos_np = np.array([pa, pb])
        run = decode[4]
        rest = Runtime._read_decode(runtime, decode, torch.cat([_rows(pa, 1, tag=100.0), _rows(pb, 1, tag=200.0)]))
        runs += run is not None and rest == []
        for i in rest:  # as _apply does: each on its own
            buffer, p, tag = ((a, pa, 100.0), (b, pb, 200.0))[i]
            buffer.put(p, _rows(p, 1, tag=tag))
    assert runs == 1  # step 1 went through step 0's run; step 2 would overflow b's region
    assert a.covered == 10 and b.covered == 12
    assert torch.equal(a.data[:10], _rows(0, 10, tag=100.0)) and torch.equal(b.data[:12], _rows(0, 12, tag=200.0))

    # a reader that strays (a recomputed position): the run declines and writes nothing
    c, d = Buffer(16, arena), Buffer(16, arena)
    c.put(0, _rows(0, 2, tag=300.0))
    d.put(0, _rows(0, 2, tag=400.0))
    runtime.pos_np = np.array([2, 2])
    run = _DecodeRun(arena, [c, d], np.array([0, 1]), [1, 1], None)  # as if built last step at 1, 1
    assert run.step(runtime.pos_np, torch.cat([_rows(2, 1, tag=300.0), _rows(2, 1, tag=400.0)]))
    runtime.pos_np = np.array([3, 2])  # d is at 2 again: not the position after last step's
    assert not run.step(runtime.pos_np, torch.cat([_rows(3, 1, tag=300.0), _rows(2, 1, tag=-1.0)]))
    assert c.covered == 3 and d.covered == 3 and torch.equal(d.data[:3], _rows(0, 3, tag=400.0))
    assert torch.equal(c.data[:3], _rows(0, 3, tag=300.0))


def test_an_arena_that_grows_keeps_the_rows_already_in_it():
    arena = Arena()
    buffers = [Buffer(100, arena) for _ in range(4)]  # 400 rows: past the arena's first 256
    for i, buffer in enumerate(buffers):
        buffer.put(0, _rows(0, 50, tag=1000.0 * i))
    assert arena.data.shape[0] >= 400
    for i, buffer in enumerate(buffers):
        assert torch.equal(buffer.data[:50], _rows(0, 50, tag=1000.0 * i))
