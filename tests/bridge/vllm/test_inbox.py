"""The inbox (bridge/vllm/inbox.py): a multiprocess engine's captures (a prompt's, and a
generation's, held in the workers until its last position) come back through a file the workers
write and the client maps, with no collect rpc, and equal eager's; anything the board does not
vouch for (a generation that stopped early too) falls back to the rpc; a region is reused only
once nobody reads or writes it (after a cancel too)."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

from bridge.vllm.inbox import Inbox
from interp_engine import Address, capture_generation, run_with_cache
from interp_engine._plan import capture_plan
from interp_engine._sampling import SamplingConfig
from interp_engine.testing import assert_close_scaled
from tests.bridge.vllm.test_board import _rpcs

PROMPTS = ["Once upon a time, in a land far away, there lived", "The capital of France is", "Hi"]


def test_regions_are_first_fit_joined_when_given_back_and_never_past_a_quarter(tmp_path):
    inbox = Inbox(size=4096, directory=str(tmp_path))
    try:
        a, b, c = inbox.take(100), inbox.take(64), inbox.take(1)
        assert (a, b, c) == (0, 128, 192)  # 64-byte aligned, in file order
        assert inbox.take(1025) is None  # more than a quarter of the file: the rpc carries it
        inbox.give(b, 64)
        assert inbox.take(64) == b  # the hole is reused first
        inbox.give(a, 100)
        inbox.give(b, 64)
        inbox.give(c, 1)
        assert inbox._free == [[0, 4096]]  # every run joined again
    finally:
        inbox.close()
    assert not os.path.exists(inbox.path)


def test_generations_regions_take_at_most_half_the_file_and_leave_room_for_one_token_captures(tmp_path):
    # a generation holds its region from its first step to its last: long ones together must not
    # send every prompt capture to the rpc
    inbox = Inbox(size=4096, directory=str(tmp_path))
    try:
        held = [inbox.take(1000, held=True), inbox.take(1000, held=True)]  # 1024 bytes each, aligned
        assert None not in held and inbox.held == 2048
        assert inbox.take(64, held=True) is None  # past half the file
        prompt = inbox.take(1024)
        assert prompt is not None  # a one-token capture still has room
        inbox.give(held[0], 1000, held=True)
        assert inbox.held == 1024
        again = inbox.take(1000, held=True)
        assert again == held[0]  # room for a generation again once one gave its region back
        for at in (held[1], again):
            inbox.give(at, 1000, held=True)
        inbox.give(prompt, 1024)
        assert inbox.held == 0 and inbox._free == [[0, 4096]]
    finally:
        inbox.close()


def test_one_token_captures_sit_side_by_side_in_each_points_block_of_a_shared_slab(tmp_path, monkeypatch):
    """Inbox.rows: requests with reads of the same widths take the next rows of every point's
    block of one slab (so a batch's rows of a point are consecutive in the file, as in the
    forward); a full slab makes way for a new one and goes back once its last user leaves;
    rows a slab cannot hold, or a set of widths past the slab count, are the caller's to place."""
    from bridge.vllm import inbox as inbox_module

    monkeypatch.setattr(inbox_module, "SLAB_BYTES", 4 * 10 * (3 + 5))  # 10 rows of widths (3, 5)
    inbox = Inbox(size=1 << 16, directory=str(tmp_path))
    try:
        (s1, at1), (s2, at2) = inbox.rows((3, 5), 4), inbox.rows((3, 5), 6)
        assert s1 is s2 and s1.capacity == 10 and s1.users == 2
        assert at1 == (s1.start, s1.start + 4 * 10 * 3)  # point 0's block, then point 1's
        assert at2 == (at1[0] + 4 * 4 * 3, at1[1] + 4 * 4 * 5)  # right after the first request's rows
        assert inbox.rows((3, 5), 11) is None  # more than a slab holds: a region of its own
        s3, at3 = inbox.rows((3, 5), 1)  # the first slab is full: a new one
        assert s3 is not s1 and at3 == (s3.start, s3.start + 4 * 10 * 3)
        other, _ = inbox.rows((7,), 2)  # other widths: a slab of their own
        assert other is not s1 and other is not s3
        inbox.leave(s1)
        assert s1.users == 1 and [s1.start, s1.start + s1.nbytes] not in inbox._free  # still used
        inbox.leave(s2)  # its last user: back to the file
        assert [s1.start, s1.start + s1.nbytes] in inbox._free
        inbox.leave(s3)  # the slab taking requests: kept, idle, for the next request from its first row
        assert inbox._slabs[(3, 5)] is s3 and s3.used == 0
        s4, at4 = inbox.rows((3, 5), 2)
        assert s4 is s3 and at4 == at3 and s3.users == 1
        inbox.leave(s4)
        inbox.leave(other)
        assert inbox.reclaim() and inbox._free == [[0, 1 << 16]] and not inbox._slabs
        monkeypatch.setattr(inbox_module, "_SLABS", 1)
        first, _ = inbox.rows((3, 5), 1)
        assert inbox.rows((7,), 1) is None  # no second slab while one takes requests
        inbox.leave(first)
        second, _ = inbox.rows((7,), 1)  # an idle one goes back for it
        assert second is not first and list(inbox._slabs) == [(7,)]
        inbox.leave(second)
        assert inbox.reclaim() and inbox._free == [[0, 1 << 16]] and not inbox._slabs
        # a region that fits only where an idle slab is: the slab goes back for it
        quarter = (1 << 16) // 4
        regions = [inbox.take(quarter) for _ in range(4)]
        assert regions == [0, quarter, 2 * quarter, 3 * quarter]
        inbox.give(regions[2], quarter)
        idle, _ = inbox.rows((3, 5), 1)
        inbox.leave(idle)
        assert idle.start == regions[2] and inbox._slabs[(3, 5)] is idle
        assert inbox.take(quarter) == regions[2] and not inbox._slabs
    finally:
        inbox.close()


def test_rows_are_read_as_a_copy_in_the_asked_dtype(tmp_path):
    inbox = Inbox(size=4096, directory=str(tmp_path))
    try:
        at = inbox.take(2 * 3 * 4)
        rows = np.arange(6, dtype=np.float32).reshape(2, 3) + 0.5
        with open(inbox.path, "r+b") as f:  # as a worker writes: through the file, not the map
            f.seek(at)
            f.write(rows.tobytes())
        got = inbox.read(at, 2, 3, torch.float32)
        assert torch.equal(got, torch.from_numpy(rows))
        assert inbox.read(at, 2, 3, torch.bfloat16).dtype == torch.bfloat16
        with open(inbox.path, "r+b") as f:
            f.seek(at)
            f.write(np.zeros(6, dtype=np.float32).tobytes())
        assert torch.equal(got, torch.from_numpy(rows))  # a copy: reusing the region changes nothing
    finally:
        inbox.close()


def test_a_requests_rows_of_every_point_are_read_at_once_as_a_batch_of_one(tmp_path):
    inbox = Inbox(size=4096, directory=str(tmp_path))
    try:
        a, b = inbox.take(2 * 3 * 4), inbox.take(2 * 5 * 4)
        rows_a = np.arange(6, dtype=np.float32).reshape(2, 3) + 0.5
        rows_b = -np.arange(10, dtype=np.float32).reshape(2, 5) - 0.25
        with open(inbox.path, "r+b") as f:
            for at, rows in ((a, rows_a), (b, rows_b)):
                f.seek(at)
                f.write(rows.tobytes())
        got = inbox.read_batched(("x", "y"), (a, b), 2, (3, 5), torch.float32)
        assert list(got) == ["x", "y"]
        assert torch.equal(got["x"], torch.from_numpy(rows_a)[None]) and torch.equal(got["y"], torch.from_numpy(rows_b)[None])
        assert inbox.read_batched(("x",), (a,), 2, (3,), torch.bfloat16)["x"].dtype == torch.bfloat16
        with open(inbox.path, "r+b") as f:
            f.seek(a)
            f.write(np.zeros(6, dtype=np.float32).tobytes())
        assert torch.equal(got["x"], torch.from_numpy(rows_a)[None])  # copies
    finally:
        inbox.close()


def test_a_client_that_exits_without_closing_leaves_no_inbox_file(tmp_path):
    import subprocess
    import sys

    code = ("from bridge.vllm.inbox import Inbox; "
            f"print(Inbox(size=4096, directory={str(tmp_path)!r}).path)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip().startswith(str(tmp_path)) and os.listdir(tmp_path) == []


def _points(model) -> list[Address]:
    last = model.n_layers - 1
    return [Address("resid_pre", 0), Address("resid_post", last), Address("attn_out", 1), Address("mlp_out", last),
            Address("z", 0), Address("mlp_act", 0), Address("resid_mid", 1)]


def _eager(eager, prompt: str, points) -> dict[Address, torch.Tensor]:
    cache = run_with_cache(eager, eager.to_tokens(prompt), points)
    return {a: cache[a] for a in points}


def _whole(backend) -> bool:
    """Every byte of the inbox free again, bar idle slabs (kept for the next one-token capture,
    and no request's): given back here."""
    inbox = backend._inbox
    inbox.reclaim()
    return inbox._free == [[0, inbox.size]] and inbox.held == 0 and not inbox._slabs


@pytest.fixture
def pair(model_pool):
    pytest.importorskip("vllm")
    eager, vllm = model_pool.get("qwen3"), model_pool.get("qwen3", "vllm")
    vllm.backend._engine()
    assert not vllm.backend.in_process and vllm.backend._inbox is not None  # the pool's engines are multiprocess
    return eager, vllm


def _assert_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for address, value in want.items():
        assert got[address].dtype == value.dtype and got[address].shape == value.shape, address
        torch.testing.assert_close(got[address], value, rtol=1e-5, atol=1e-5, msg=str(address))


def _assert_close(got: dict, want: dict) -> None:
    """Generated positions: decode kernels reduce in another order than eager's (1e-5 of the scale)."""
    assert set(got) == set(want)
    for address, value in want.items():
        assert got[address].dtype == value.dtype, address
        assert_close_scaled(got[address], value, msg=str(address))


@pytest.mark.vllm
def test_prompt_captures_come_through_the_inbox_without_a_collect_rpc_and_equal_eager(pair, monkeypatch):
    eager, vllm = pair
    points = _points(vllm)
    calls = _rpcs(vllm.backend, monkeypatch)
    for prompt in PROMPTS:
        cache = run_with_cache(vllm, vllm.to_tokens(prompt), points)
        _assert_equal({a: cache[a] for a in points}, _eager(eager, prompt, points))

    async def together():  # several requests in one prefill step, each its own region
        return await asyncio.gather(*(vllm.capture_generation(vllm.to_tokens(p), points, max_tokens=1,
                                                              temperature=0.0) for p in PROMPTS))

    for prompt, (_, cache) in zip(PROMPTS, asyncio.run(together())):
        _assert_equal({a: cache[a] for a in points}, _eager(eager, prompt, points))
    assert calls == []  # settled from the board: the rows were read from the inbox
    assert _whole(vllm.backend)


@pytest.mark.vllm
def test_each_set_of_points_gets_its_own_layout_and_a_pattern_still_comes_by_the_rpc(pair, monkeypatch):
    # the client works out once per set of reads whether (and how wide) its rows come through
    # the inbox: sets of one size, of other widths, and one that cannot use it, one after another
    eager, vllm = pair
    calls = _rpcs(vllm.backend, monkeypatch)
    prompt = PROMPTS[0]
    for points in ([Address("z", 1), Address("mlp_act", 1)], [Address("resid_post", 0), Address("z", 0)],
                   [Address("mlp_act", 0), Address("attn_out", 0)]):
        cache = run_with_cache(vllm, vllm.to_tokens(prompt), points)
        _assert_equal({a: cache[a] for a in points}, _eager(eager, prompt, points))
    assert calls == []
    points = [Address("resid_post", 0), Address("pattern", 1)]  # a pattern is rebuilt from q | k: by rpc
    cache = run_with_cache(vllm, vllm.to_tokens(prompt), points)
    _assert_equal({a: cache[a] for a in points}, _eager(eager, prompt, points))
    assert len(calls) == 1
    assert _whole(vllm.backend)


@pytest.mark.vllm
def test_generation_captures_are_written_once_at_their_last_position_without_a_collect_rpc(pair, monkeypatch):
    # requests of other lengths in the same steps: each is held in the workers, then written into
    # its region by the forward that reads its last position (one token: its prefill, as before)
    eager, vllm = pair
    points = _points(vllm)
    lengths = [6, 1, 9]
    calls = _rpcs(vllm.backend, monkeypatch)

    async def together():
        return await asyncio.gather(*(vllm.capture_generation(vllm.to_tokens(p), points, max_tokens=n,
                                                              temperature=0.0, stop_at_eos=False)
                                      for p, n in zip(PROMPTS, lengths)))

    for prompt, n, (completion, values) in zip(PROMPTS, lengths, asyncio.run(together())):
        want_completion, want = capture_generation(eager, eager.to_tokens(prompt), points, max_tokens=n,
                                                   temperature=0.0, stop_at_eos=False)
        assert completion.token_ids == want_completion.token_ids and len(completion.token_ids) == n
        _assert_close({a: values[a] for a in points}, {a: want[a] for a in points})
    assert calls == []  # settled from the board: the rows were read from the inbox
    assert _whole(vllm.backend)


@pytest.mark.vllm
def test_a_generation_that_stops_before_its_last_position_is_collected_by_rpc(pair, monkeypatch):
    # its workers never reach the position they would write its rows at: nothing on the board,
    # and the collect rpc answers with the rows they hold
    eager, vllm = pair
    points = _points(vllm)
    prompt = PROMPTS[1]
    full, _ = capture_generation(eager, eager.to_tokens(prompt), points, max_tokens=8, temperature=0.0,
                                 stop_at_eos=False)
    ids = list(full.token_ids)
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # the first token not seen before it
    _, want = capture_generation(eager, eager.to_tokens(prompt), points, max_tokens=k + 1, temperature=0.0,
                                 stop_at_eos=False)
    backend = vllm.backend
    calls = _rpcs(backend, monkeypatch)
    config = SamplingConfig(max_tokens=8, temperature=0.0, stop_at_eos=False, stop_token_ids=(ids[k],),
                            d_vocab=vllm.d_vocab)
    plan = capture_plan(vllm.graph, points)
    capture = backend.new_capture()
    steps = list(backend.generate(vllm.to_tokens(prompt)[0].tolist(), config, plan, capture))
    assert [step.token_id for step in steps] == ids[:k + 1] and steps[-1].finish_reason == "stop"
    assert calls == ["interp_collect_many"]
    values = backend.assemble(plan, capture)
    _assert_close({a: values[a] for a in points}, {a: want[a] for a in points})
    assert _whole(backend)


def _board_says_nothing(backend, monkeypatch) -> None:
    """The workers write the rows into the inbox, but the client never sees their OK."""
    monkeypatch.setattr(backend._board, "ok", lambda slot: False)


def _inbox_elsewhere(backend, monkeypatch) -> None:
    """As a worker on another machine: it cannot open the file, so it writes nothing there and
    says nothing on the board; its rows come in the rpc's answer."""
    monkeypatch.setattr(backend._inbox, "path", backend._inbox.path + "-on-another-machine")


@pytest.mark.vllm
@pytest.mark.parametrize("unvouched", [_board_says_nothing, _inbox_elsewhere], ids=lambda f: f.__name__[1:])
def test_rows_the_board_does_not_vouch_for_come_by_the_rpc(pair, monkeypatch, unvouched):
    """The client never takes the file on trust: without every worker's OK it collects by rpc,
    and takes each read from the answer or from what the workers wrote into its region."""
    eager, vllm = pair
    points = _points(vllm)
    assert _whole(vllm.backend)  # so the region is the file's start: poison it, as an earlier request's rows
    with open(vllm.backend._inbox.path, "r+b") as f:
        f.write(np.full(1 << 20, np.nan, dtype=np.float32).tobytes())  # (a whole slab: inbox.SLAB_BYTES)
    unvouched(vllm.backend, monkeypatch)
    calls = _rpcs(vllm.backend, monkeypatch)
    cache = run_with_cache(vllm, vllm.to_tokens(PROMPTS[0]), points)
    assert calls == ["interp_collect_many"]
    _assert_equal({a: cache[a] for a in points}, _eager(eager, PROMPTS[0], points))
    assert _whole(vllm.backend)
    # a generation, whose rows the workers hold: the same
    completion, cache = capture_generation(vllm, vllm.to_tokens(PROMPTS[0]), points, max_tokens=4,
                                           temperature=0.0, stop_at_eos=False)
    want_completion, want = capture_generation(eager, eager.to_tokens(PROMPTS[0]), points, max_tokens=4,
                                               temperature=0.0, stop_at_eos=False)
    assert completion.token_ids == want_completion.token_ids
    assert calls == ["interp_collect_many"] * 2
    _assert_close({a: cache[a] for a in points}, {a: want[a] for a in points})
    assert _whole(vllm.backend)


@pytest.mark.vllm
@pytest.mark.parametrize("max_tokens", [1, 5])
def test_a_cancelled_capture_gives_its_region_back_once_no_worker_can_write_into_it(pair, max_tokens):
    eager, vllm = pair
    points = _points(vllm)

    async def cancel_some():
        tasks = [asyncio.ensure_future(vllm.capture_generation(vllm.to_tokens(p), points, max_tokens=max_tokens,
                                                               temperature=0.0, stop_at_eos=False))
                 for p in PROMPTS]
        await asyncio.sleep(0)  # each request is added (and holds a region) before it is cancelled
        tasks[0].cancel()
        tasks[2].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(cancel_some())
    assert isinstance(results[0], asyncio.CancelledError) and isinstance(results[2], asyncio.CancelledError)
    _, want = capture_generation(eager, eager.to_tokens(PROMPTS[1]), points, max_tokens=max_tokens,
                                 temperature=0.0, stop_at_eos=False)
    _assert_close({a: results[1][1][a] for a in points}, {a: want[a] for a in points})
    assert _whole(vllm.backend)
    assert vllm.backend._board is not None and len(vllm.backend._board._free) == vllm.backend._board.slots
