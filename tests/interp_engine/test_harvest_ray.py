"""harvest_ray on a local Ray instance: two replicas (each an actor with its own model), one
shard set each, one manifest; the rows equal a single-engine harvest's, and a rerun resumes."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from interp_engine import harvest, harvest_ray

pytest.importorskip("ray.data")

POINTS = ["resid_post.0", "z.1"]
PROMPTS = [f"Item {i}: the capital of France is Paris, and {i} plus one is {i + 1}." for i in range(40)]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_replicas_write_the_rows_of_one_engine(local_ray, eager_models, tiny_dirs, tmp_path):
    datasets = pytest.importorskip("datasets")
    report = harvest_ray(tiny_dirs["qwen3"], PROMPTS, POINTS, tmp_path / "ray", replicas=2, context_size=16,
                         shard_bytes=30_000)
    single = harvest(eager_models["qwen3"], PROMPTS, POINTS, tmp_path / "one", context_size=16)
    assert report.rows == single.rows and report.tokens_left_out == single.tokens_left_out
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["args"]["replicas"] == [[0, single.rows // 2], [single.rows // 2, single.rows]]
    assert {s["file"].split("/")[0] for s in manifest["shards"]} == {"replica-0", "replica-1"}
    a, b = harvest.load(tmp_path / "ray"), harvest.load(tmp_path / "one")
    assert torch.equal(a.token_ids, b.token_ids)
    for point in POINTS:
        torch.testing.assert_close(a[point], b[point], rtol=1e-5, atol=1e-5)
    ds = datasets.load_from_disk(str(tmp_path / "ray"))
    assert len(ds) == single.rows
    again = harvest_ray(tiny_dirs["qwen3"], PROMPTS, POINTS, tmp_path / "ray", replicas=2, context_size=16,
                        shard_bytes=30_000)
    assert again.rows_this_run == 0 and again.rows == report.rows


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_two_vllm_replicas_write_the_rows_of_one_eager_harvest(local_ray, eager_models, tiny_dirs, tmp_path):
    """Each Ray actor starts its own vLLM engine (multiprocess, vLLM's default shape) and
    harvests its range through the worker runtime; the dataset equals eager's row by row."""
    report = harvest_ray(tiny_dirs["qwen3"], PROMPTS, POINTS, tmp_path / "ray", replicas=2, context_size=16,
                         backend="vllm", load_kwargs={"kv_cache_memory_bytes": 64 << 20})
    single = harvest(eager_models["qwen3"], PROMPTS, POINTS, tmp_path / "one", context_size=16)
    assert report.rows == single.rows
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["args"]["backend"] == "vllm"
    a, b = harvest.load(tmp_path / "ray"), harvest.load(tmp_path / "one")
    assert torch.equal(a.token_ids, b.token_ids)
    for point in POINTS:
        torch.testing.assert_close(a[point], b[point], rtol=1e-5, atol=1e-5)
