"""harvest on vLLM and vllm-static: many requests in flight, the same rows as the eager backend
(1e-5 relative), prompt windows and generated positions alike; the workers write the rows into
the shard's file themselves as they read them (no request's rows come back through the rpc),
and say on the client's status board that every row is in, so a window ends with no rpc at all;
where a worker cannot say so, the client asks for the finished windows' status in a few rpcs,
not one per engine step."""

from __future__ import annotations

import pytest
import torch

from interp_engine import harvest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

ARCH = "qwen3"
POINTS = ["resid_post.0", "z.1", "mlp_out.1"]
PROMPTS = [f"Item {i}: the capital of France is Paris, and {i} plus one is {i + 1}." for i in range(30)]


STATIC_POINTS = ["resid_post.0", "attn_out.1", "mlp_out.1"]
N_LAYERS, NAMES = 3, ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
# test_static's declared set: the pool's engine is shared
DECLARED = tuple(f"{n}.{layer}" for layer in range(N_LAYERS) for n in NAMES)


@pytest.mark.parametrize("backend,max_tokens,board", [("vllm", 0, True), ("vllm", 5, True), ("vllm", 5, False),
                                                     ("vllm-static", 0, True), ("vllm-static", 5, False)])
def test_vllm_rows_equal_the_eager_rows(model_pool, tmp_path, monkeypatch, backend, max_tokens, board):
    """``board=False``: the workers cannot open the client's status board (as on another
    machine), so each window's status comes back by rpc, a few windows per rpc."""
    eager = model_pool.get(ARCH, "eager")
    if backend == "vllm":
        vllm, points = model_pool.get(ARCH, "vllm"), POINTS
    else:
        vllm, points = model_pool.get(ARCH, "vllm-static", static_points=DECLARED, static_writes=DECLARED), STATIC_POINTS
    kwargs = dict(context_size=16, max_tokens=max_tokens, shard_bytes=100_000, max_in_flight=16)
    harvest(eager, PROMPTS, points, tmp_path / "eager", **kwargs)
    answers = []  # what the workers answered per finished request: the rows go to the shard's file
    rpcs = []  # the status rpcs the client made
    backend_type = type(vllm.backend)
    sunk, collect = backend_type._sunk, backend_type._collect
    monkeypatch.setattr(backend_type, "_sunk",
                        lambda self, request: answers.append(request.settled) or sunk(self, request))
    monkeypatch.setattr(backend_type, "_collect",
                        lambda self, llm, ended: rpcs.append(len(ended)) or collect(self, llm, ended))
    status = vllm.backend._engine() and vllm.backend._board
    if not board:
        monkeypatch.setattr(status, "where", lambda slot: {"path": status.path + "-on-another-machine", "at": 0})
    report = harvest(vllm, PROMPTS, points, tmp_path / "vllm", **kwargs)
    assert report.shards > 1 and report.rows > 20
    if board:  # every window settled from the board: no answer, no rpc
        assert answers == [] and rpcs == []
    else:
        assert len(answers) == report.rows and not any(a.get("values") for each in answers for a in each)
        # a finished window's status waits for up to max_in_flight others (and the shard's last ones)
        assert sum(rpcs) == report.rows and len(rpcs) <= report.rows // 16 + report.shards, rpcs
    assert len(status._free) == status.slots  # every slot back
    a, b = harvest.load(tmp_path / "eager"), harvest.load(tmp_path / "vllm")
    assert torch.equal(a.token_ids, b.token_ids)  # same windows, same greedy continuations
    for point in points:
        torch.testing.assert_close(b[point], a[point], rtol=1e-5, atol=1e-5)
    assert b.manifest["args"]["backend"] == backend
    assert all(stats["sink_files"] == 0 for stats in vllm.backend.worker_stats())  # none left open
