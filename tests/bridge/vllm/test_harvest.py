"""harvest on vLLM: many requests in flight, the same rows as the eager backend (1e-5 relative),
prompt windows and generated positions alike; the workers write the rows into the shard's file
themselves (no request's rows come back through the rpc)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import harvest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

ARCH = "qwen3"
POINTS = ["resid_post.0", "z.1", "mlp_out.1"]
PROMPTS = [f"Item {i}: the capital of France is Paris, and {i} plus one is {i + 1}." for i in range(30)]


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_vllm_rows_equal_the_eager_rows(model_pool, tmp_path, monkeypatch, max_tokens):
    eager, vllm = model_pool.get(ARCH, "eager"), model_pool.get(ARCH, "vllm")
    kwargs = dict(context_size=16, max_tokens=max_tokens, shard_bytes=100_000, max_in_flight=16)
    harvest(eager, PROMPTS, POINTS, tmp_path / "eager", **kwargs)
    answers = []  # what the workers answered per finished request: the rows go to the shard's file
    sunk = type(vllm.backend)._sunk
    monkeypatch.setattr(type(vllm.backend), "_sunk",
                        lambda self, request: answers.append(request.settled) or sunk(self, request))
    report = harvest(vllm, PROMPTS, POINTS, tmp_path / "vllm", **kwargs)
    assert report.shards > 1 and report.rows > 20
    assert len(answers) == report.rows and not any(a.get("values") for each in answers for a in each)
    a, b = harvest.load(tmp_path / "eager"), harvest.load(tmp_path / "vllm")
    assert torch.equal(a.token_ids, b.token_ids)  # same windows, same greedy continuations
    for point in POINTS:
        torch.testing.assert_close(b[point], a[point], rtol=1e-5, atol=1e-5)
    assert b.manifest["args"]["backend"] == "vllm"
