"""The status board (bridge/vllm/board.py): a steering-only request ends without a collect rpc
when every worker reported it served, and falls back to the rpc (which brings the error back)
when any did not: a failure, or a worker that cannot open the client's file."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from bridge.vllm.board import FAILED, OK, BoardFiles, StatusBoard
from interp_engine import SteerSpec, generate_stream, steer

PROMPT = "Once upon a time, in a land far away, there lived"


def test_a_client_that_exits_without_closing_leaves_no_board_file(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from bridge.vllm.board import StatusBoard; "
            f"print(StatusBoard(world=1, directory={str(tmp_path)!r}).path)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert out.stdout.strip().startswith(str(tmp_path)) and os.listdir(tmp_path) == []


def test_a_row_is_ok_only_when_every_rank_says_so_and_is_zeroed_when_taken_again(tmp_path):
    board = StatusBoard(world=2, slots=2, directory=str(tmp_path))
    files = BoardFiles()
    try:
        a, b = board.take(), board.take()
        assert {a, b} == {0, 1} and board.take() is None  # all taken: the request collects by rpc
        where = board.where(a)
        assert files.mark(where["path"], where["at"] + 0, OK)
        assert not board.ok(a)  # rank 1 has not said anything yet
        assert files.mark(where["path"], where["at"] + 1, OK)
        assert board.ok(a) and not board.ok(b)  # b's row is its own
        assert files.mark(where["path"], where["at"] + 1, FAILED)
        assert not board.ok(a)
        board.give(a)
        again = board.take()
        assert again == a and not board.ok(again)  # the last occupant's bytes are gone
        # a byte past the board (a plan naming a row of some other file): refused, not raised
        assert not files.mark(where["path"], board.world * board.slots, OK)
        assert not files.mark(where["path"], -1, OK) and not board.ok(again)
        # a worker on another machine cannot open the file: it says so, and remembers
        assert not files.mark(str(tmp_path / "elsewhere"), 0, OK)
        assert files.open[str(tmp_path / "elsewhere")] is None
    finally:
        files.close_all()
        board.close()
    assert not os.path.exists(board.path)


def _rpcs(backend, monkeypatch) -> list[str]:
    """The collect / release rpcs ``backend`` makes from now on."""
    calls = []
    llm = backend._engine()
    real = llm.collective_rpc

    def counting(method, *args, **kwargs):
        if method.startswith(("interp_collect", "interp_release")):
            calls.append(method)
        return real(method, *args, **kwargs)

    monkeypatch.setattr(llm, "collective_rpc", counting)
    return calls


@pytest.mark.vllm
def test_steering_ends_without_a_collect_rpc_and_equals_eager(model_pool, monkeypatch):
    pytest.importorskip("vllm")
    eager, vllm = model_pool.get("qwen3"), model_pool.get("qwen3", "vllm")
    tokens = vllm.to_tokens(PROMPT)
    v = torch.randn(vllm.d_model, generator=torch.Generator().manual_seed(7))
    specs = [SteerSpec.add("resid_post.1", v, scale=s) for s in (3.0, -3.0)]
    calls = _rpcs(vllm.backend, monkeypatch)

    async def both():
        return await asyncio.gather(*(vllm.generate_text(tokens, max_tokens=6, temperature=0.0, steer=s)
                                      for s in specs))

    texts = asyncio.run(both())
    assert calls == []  # settled from the board
    for spec, text in zip(specs, texts):
        with steer(eager, spec):
            expected = eager.to_string([s.token_id for s in generate_stream(eager, tokens, max_tokens=6,
                                                                            temperature=0.0)])
        assert text == expected
    assert vllm.backend._board is not None and len(vllm.backend._board._free) == vllm.backend._board.slots


@pytest.mark.vllm
def test_a_worker_that_cannot_open_the_board_falls_back_to_the_rpc(model_pool, monkeypatch):
    """As a worker on another machine: it writes nothing, and the client asks by rpc instead of
    taking silence for success."""
    pytest.importorskip("vllm")
    vllm = model_pool.get("qwen3", "vllm")
    tokens = vllm.to_tokens(PROMPT)
    spec = SteerSpec.add("resid_post.1", torch.ones(vllm.d_model), scale=2.0)
    with steer(vllm, spec):
        expected = [s.token_id for s in generate_stream(vllm, tokens, max_tokens=4, temperature=0.0)]
    board = vllm.backend._engine() and vllm.backend._board
    monkeypatch.setattr(board, "where", lambda slot: {"path": board.path + "-on-another-machine", "at": 0})
    calls = _rpcs(vllm.backend, monkeypatch)
    with steer(vllm, spec):
        got = [s.token_id for s in generate_stream(vllm, tokens, max_tokens=4, temperature=0.0)]
    assert got == expected
    assert calls == ["interp_collect_many"]
