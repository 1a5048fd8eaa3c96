"""A collect rpc's rows through the client's rows file (bridge/vllm/spill.py), without an engine:
the rows a worker writes come back bit for bit as views of the file; small answers, a file the
worker cannot open, and an empty tensor travel in the answer; a file shorter than its answer
says is an error, never rows made up; and no file outlives the rpc."""

from __future__ import annotations

import os

import pytest
import torch

from bridge.vllm.spill import MIN_BYTES, SpillFiles, as_rows, encode
from bridge.vllm.wire import tensor_from_wire


def _answers(rank: int, rows: int, dtype=torch.float32) -> tuple[list[dict], dict]:
    g = torch.Generator().manual_seed(rank)
    values = {f"resid_post.{i}": torch.randn(rows, 64, generator=g).to(dtype) for i in range(3)}
    values["z.0"] = torch.randn(rows, 2, 32, generator=g).to(dtype)
    values["empty.0"] = torch.empty(0, 64, dtype=dtype)
    answers = [{"found": True, "error": None, "rank": rank,
                "values": {k: as_rows(v[i::2]) for k, v in values.items()}} for i in range(2)]
    expected = [{k: v[i::2].clone() for k, v in values.items()} for i in range(2)]
    return answers, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_written_by_every_rank_come_back_bit_for_bit_and_the_files_go(tmp_path, dtype):
    files = SpillFiles(2, directory=str(tmp_path))
    base = files.make()
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(f"{base}.{r}") for r in range(2))
    per_rank, expected = [], []
    for rank in range(2):
        answers, want = _answers(rank, 400, dtype)
        encode(answers, f"{base}.{rank}")
        assert all(a["spilled"] for a in answers)  # 400 rows of 64 floats: past MIN_BYTES
        assert all(isinstance(a["values"]["resid_post.0"][2], list) for a in answers)
        per_rank.append(answers)
        expected.append(want)
    files.take(base, per_rank)
    assert os.listdir(tmp_path) == []
    for answers, want in zip(per_rank, expected):
        for answer, values in zip(answers, want):
            for key, value in values.items():
                got = tensor_from_wire(answer["values"][key])
                assert got.dtype == value.dtype and got.shape == value.shape
                assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)), key
    got.add_(1)  # a view of the private mapping: writable, and the caller's own


def test_small_answers_and_a_file_the_worker_cannot_open_travel_in_the_answer(tmp_path):
    answers, want = _answers(0, 4)
    assert sum(v.numel() * 4 for a in answers for v in a["values"].values()) < MIN_BYTES
    (tmp_path / "made-by-the-client.0").touch()
    encode(answers, str(tmp_path / "made-by-the-client.0"))
    assert not any(a.get("spilled") for a in answers)
    assert (tmp_path / "made-by-the-client.0").stat().st_size == 0
    (tmp_path / "made-by-the-client.0").unlink()
    assert all(isinstance(a["values"]["resid_post.0"][2], bytes) for a in answers)
    answers, want = _answers(0, 400)
    encode(answers, str(tmp_path / "never-made.0"))  # another machine's client: no such file here
    assert not any(a.get("spilled") for a in answers) and not (tmp_path / "never-made.0").exists()
    files = SpillFiles(1, directory=str(tmp_path))
    base = files.make()
    files.take(base, [answers])
    for answer, values in zip(answers, want):
        for key, value in values.items():
            assert torch.equal(tensor_from_wire(answer["values"][key]), value)
    encode(answers, None)  # already wire: left alone
    assert os.listdir(tmp_path) == []


def test_a_rows_file_shorter_than_its_answer_says_is_an_error_and_still_goes(tmp_path):
    files = SpillFiles(1, directory=str(tmp_path))
    base = files.make()
    answers, _ = _answers(0, 400)
    encode(answers, f"{base}.0")
    os.truncate(f"{base}.0", 1000)
    with pytest.raises(RuntimeError, match="rows file ends at byte 1000"):
        files.take(base, [answers])
    assert os.listdir(tmp_path) == []
    base = files.make()
    files.take(base, RuntimeError("the rpc failed"))  # nothing to read: the files still go
    assert os.listdir(tmp_path) == []


def test_a_short_write_is_finished_piece_by_piece(tmp_path, monkeypatch):
    """A pwritev that writes less than asked (a signal, a slow file system): the rest of its
    pieces still go in, each at its byte."""
    from bridge.vllm import spill as spill_module

    real = os.pwritev
    monkeypatch.setattr(spill_module.os, "pwritev", lambda fd, views, at: real(fd, views[:1], at) - 3)
    files = SpillFiles(1, directory=str(tmp_path))
    base = files.make()
    answers, want = _answers(0, 400)
    encode(answers, f"{base}.0")
    assert all(a["spilled"] for a in answers)
    files.take(base, [answers])
    for answer, values in zip(answers, want):
        for key, value in values.items():
            assert torch.equal(tensor_from_wire(answer["values"][key]), value), key
