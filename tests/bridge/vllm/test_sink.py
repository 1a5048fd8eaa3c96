"""The worker's harvest sink (bridge/vllm/sink.py) without an engine: rows land at their
positions' bytes in the client's file, whether a forward's rows are consecutive or scattered;
which positions were written is known exactly; rows that would fall outside the request's
place are refused, never written; a file is opened once for all the requests that write into
it and closed when the last one ends."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import pytest
import torch

from bridge.vllm.sink import SinkFiles, SinkWriter
from bridge.vllm.wire import WireSink
from interp_engine import Address

A, B = Address("resid_post", 0), Address("mlp_out", 1)
W, N = 4, 6  # floats per row, positions per request


def _file(tmp_path, windows=2):
    path = tmp_path / "rows.raw"
    with open(path, "wb") as f:
        f.truncate(windows * 2 * N * W * 4)  # two points, each [windows, N, W] float32
    return path


def _sink(path, window, windows=2):
    block = N * W * 4
    return WireSink(str(path), MappingProxyType({str(A): window * block, str(B): windows * block + window * block}), N)


def _read(path, windows=2):
    flat = np.fromfile(path, dtype=np.float32)
    return flat[: windows * N * W].reshape(windows, N, W), flat[windows * N * W:].reshape(windows, N, W)


def test_rows_land_at_their_positions_and_what_was_written_is_known(tmp_path):
    path, files = _file(tmp_path), SinkFiles()
    first, second = SinkWriter(_sink(path, 0), files), SinkWriter(_sink(path, 1), files)
    assert len(files.open) == 1  # one file, opened once for both requests
    rows = torch.arange(N * W, dtype=torch.float32).reshape(N, W)
    first.write(A, rows[:4], np.arange(4))  # a prefill's consecutive rows
    first.write(A, rows[4:5], np.array([4]))  # then decode steps
    first.write(A, rows[5:6], np.array([5]))
    second.write(B, -rows[[5, 1, 3]], np.array([5, 1, 3]))  # scattered (drafts): one by one
    a, b = _read(path)
    assert np.array_equal(a[0], rows.numpy()) and not a[1].any()
    assert np.array_equal(b[1][[1, 3, 5]], -rows.numpy()[[1, 3, 5]]) and not b[1][[0, 2, 4]].any()
    assert not b[0].any()
    assert first.complete(A, N) and not first.complete(B, 1) and first.complete(B, 0)
    assert not second.complete(B, 2) and not second.complete(B, N + 1)
    second.write(B, rows[[0, 2, 4]].to(torch.float64), np.array([0, 2, 4]))  # other dtypes leave as float32
    assert second.complete(B, N)
    first.close()
    first.close()  # twice: released once
    assert len(files.open) == 1
    second.close()
    assert not files.open


def test_rows_marked_out_of_order_count_only_once_the_gap_before_them_is_written(tmp_path):
    """Rows a caller writes itself (``place``, then marking them in the record it hands back;
    several requests in one write) may come after a gap: they count as written, but the request
    is complete only up to the gap until it is filled."""
    path, files = _file(tmp_path), SinkFiles()
    writer = SinkWriter(_sink(path, 0), files)
    where, written = writer.place(A, W, 3, 2)
    assert where == 3 * W * 4 and writer.place(A, W, 5, 2) is None  # past its N rows
    written.mark(3, 5)  # (the record place hands back is the writer's own)
    assert writer.written(A) == 2 and not writer.complete(A, 1) and not writer.complete(A, 5)
    where, written = writer.place(A, W, 0, 2)
    assert where == 0
    written.mark(0, 2)
    assert writer.written(A) == 4 and writer.complete(A, 2) and not writer.complete(A, 3)
    writer.place(A, W, 2, 1)[1].mark(2, 3)
    assert writer.written(A) == 5 and writer.complete(A, 5) and not writer.complete(A, N)
    assert writer.written(B) == 0 and writer.complete(B, 0)
    writer.close()


def test_rows_outside_the_requests_place_are_refused_and_never_written(tmp_path):
    path, files = _file(tmp_path), SinkFiles()
    writer = SinkWriter(_sink(path, 0), files)
    with pytest.raises(ValueError, match="outside the sink's 6 rows"):
        writer.write(A, torch.ones(2, W), np.array([5, 6]))
    with pytest.raises(ValueError, match="outside the sink's 6 rows"):
        writer.write(A, torch.ones(2, W), np.array([3, 7]))  # scattered
    assert not np.fromfile(path, dtype=np.float32).any()
    small = tmp_path / "small.raw"
    small.write_bytes(bytes(N * W * 4))  # room for one point's rows only
    short = SinkWriter(_sink(small, 0), files)
    with pytest.raises(ValueError, match="end past the end of"):
        short.write(B, torch.ones(1, W), np.array([0]))
    writer.close()
    with pytest.raises(RuntimeError, match="after the request's sink was closed"):
        writer.write(A, torch.ones(1, W), np.array([0]))
    with pytest.raises(FileNotFoundError):  # another machine's file: the runtime buffers instead
        SinkWriter(_sink(tmp_path / "absent.raw", 0), files)


def test_the_runtime_says_served_on_the_board_only_once_every_row_of_every_read_is_in(tmp_path):
    """The worker's side of a harvest request on the status board (Runtime._sink_rows): OK goes
    on the board once, when the last read's last missing row is in; a read with a hole (a
    position the forwards skipped, as under prefix caching) never gets it, and neither does a
    request whose serving failed. The file is let go once it is served."""
    from bridge.vllm.board import FAILED, OK
    from bridge.vllm.runtime import Runtime, _Request
    from bridge.vllm.wire import WirePlan

    path = _file(tmp_path)

    def request(window):
        plan = WirePlan(f"r{window}", (A, B), (), sink=_sink(path, window), board=(str(tmp_path / "board"), 0))
        r = _Request(plan, N)
        marks = []
        r.report = marks.append
        return r, marks

    runtime = Runtime.__new__(Runtime)  # only what _sink_rows uses: no engine
    runtime.sink_files = SinkFiles()

    def forward(r, address, first, last):
        runtime.pos_np = np.arange(first, last + 1)
        runtime._sink_rows(r, address, torch.ones(last - first + 1, W), 0, last - first + 1)

    whole, marks = request(0)
    forward(whole, A, 0, N - 2)
    forward(whole, B, 0, N - 2)
    forward(whole, A, N - 1, N - 1)
    assert marks == [] and not whole.served  # B's last row is still to come
    forward(whole, B, N - 1, N - 1)
    assert marks == [OK] and whole.served and not whole.sink.open

    holed, marks = request(1)
    forward(holed, A, 0, N - 1)
    forward(holed, B, 2, N - 1)  # B's rows 0 and 1 never came
    assert marks == [] and not holed.served

    failed, marks = request(0)
    failed.fail("planted: serving it failed")
    forward(failed, A, 0, N - 1)
    forward(failed, B, 0, N - 1)
    assert marks == [FAILED] and not failed.served
    for r in (holed, failed):
        r.drop()
    assert runtime.sink_files.open == {}


def test_a_compiled_taps_rows_of_consecutive_windows_go_in_with_one_write(tmp_path, monkeypatch):
    """Runtime._sink_together: windows whose rows follow one another in the forward and in the
    file (the client lays a point's rows out in window order) go in with one write; windows out
    of that order take one write each; a window whose positions fall outside its place is left
    to its own write, which refuses it and fails that request alone. Each is served once every
    row of every read is in."""
    from bridge.vllm import runtime as runtime_module
    from bridge.vllm.board import OK
    from bridge.vllm.runtime import Runtime, _Request
    from bridge.vllm.wire import WirePlan
    from specs import SPECS

    windows = 4
    path = _file(tmp_path, windows)
    writes = []
    real = runtime_module.write_rows
    monkeypatch.setattr(runtime_module, "write_rows", lambda fd, data, at: (writes.append(at), real(fd, data, at)))

    def request(window):
        plan = WirePlan(f"r{window}", (A, B), (), sink=_sink(path, window, windows),
                        board=(str(tmp_path / "board"), 0))
        r = _Request(plan, N)
        r.sunk_marks = []
        r.report = r.sunk_marks.append
        return r

    runtime = Runtime.__new__(Runtime)  # only what _read_tap uses: no engine
    runtime.sink_files, runtime.arenas, runtime._runs = SinkFiles(), {}, {}
    runtime.store_captures, runtime.rank_shards, runtime.spec = True, frozenset(), SPECS["qwen3"]
    runtime._sinks_by_name = {}

    def value(window, address):
        return torch.arange(N * W, dtype=torch.float32).reshape(N, W) + 1000 * window + 100 * (address is B)

    def forward(order, address, positions=None):
        runtime.pos_np = np.concatenate([np.arange(N) if positions is None else positions for _ in order])
        rows = torch.cat([value(w, address) for w, _ in order])
        readers = [(r, i * N, (i + 1) * N, i * N) for i, (_, r) in enumerate(order)]
        writes.clear()
        runtime._read_tap(address, rows, readers)
        return len(writes)

    rs = [request(w) for w in range(windows)]
    assert forward([(0, rs[0]), (1, rs[1]), (2, rs[2])], A) == 1  # one run of the file
    assert forward([(2, rs[2]), (0, rs[0]), (1, rs[1])], B) == 2  # 2, then 0..1
    assert all(r.sunk_marks == [OK] and r.served for r in rs[:3])
    a, b = _read(path, windows)
    for w in range(3):
        assert np.array_equal(a[w], value(w, A).numpy()) and np.array_equal(b[w], value(w, B).numpy())

    last, stray = rs[3], request(3)
    forward([(3, last)], A)  # alone: the request's own write (SinkWriter.write)
    bad = np.arange(N) + 2  # positions 2 .. N + 1: past its N rows
    runtime.pos_np = np.concatenate([np.arange(N), bad])
    rows = torch.cat([value(3, B), torch.full((N, W), -1.0)])
    writes.clear()
    runtime._read_tap(B, rows, [(last, 0, N, 0), (stray, N, 2 * N, N)])
    assert last.served and last.error is None
    assert not stray.served and "outside the sink" in stray.error
    assert np.array_equal(_read(path, windows)[1][3], value(3, B).numpy())  # the stray wrote nothing


def test_rows_of_another_width_than_the_client_sized_are_refused_not_written(tmp_path):
    """A client that sized its file's regions (the inbox) names each read's width: rows of another
    width would run into the next region, so the worker refuses them and writes nothing."""
    path, files = _file(tmp_path), SinkFiles()
    sink = _sink(path, 0)
    sized = WireSink(sink.path, sink.offsets, N, MappingProxyType({str(A): W, str(B): W}))
    writer = SinkWriter(sized, files)
    with pytest.raises(ValueError, match=r"rows of 8 floats, but the client sized its sink for 4"):
        writer.write(A, torch.ones(2, 2 * W), np.arange(2))
    writer.write(B, torch.ones(1, W), np.array([0]))
    a, b = _read(path)
    assert not a.any() and b[0][0].all() and not writer.complete(A, 1)
    writer.close()
