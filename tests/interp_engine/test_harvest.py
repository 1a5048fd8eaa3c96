"""harvest(): rows equal to the HF modules' own activations on the same windows, the layout
SAELens opens, resume after a kill, refusal of mismatched resumes, bounded memory, the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from interp_engine import CapabilityUnsupported, harvest
from interp_engine._harvest import ManifestMismatch
from interp_engine.cli import main
from tests._reference import reference_points

ARCH = "qwen3"
POINTS = ["resid_post.0", "z.1", "mlp_out.1"]
PROMPTS = [f"Item {i}: the capital of France is Paris, and {i} plus one is {i + 1}." for i in range(40)]
ROOT = Path(__file__).resolve().parents[2]


def _stream(model, prompts):
    ids: list[int] = []
    for text in prompts:
        ids += model.tok.hf(text, add_special_tokens=True)["input_ids"]
    return ids


def test_rows_are_the_windows_of_the_token_stream_with_the_hf_modules_values(eager_models, tmp_path):
    model = eager_models[ARCH]
    report = harvest(model, PROMPTS, POINTS, tmp_path / "h", context_size=16, batch_size=5)
    stream = _stream(model, PROMPTS)
    assert report.rows == len(stream) // 16 and report.tokens_left_out == len(stream) % 16
    got = harvest.load(tmp_path / "h")
    want_ids = torch.tensor(stream[: report.rows * 16]).reshape(-1, 16)
    assert torch.equal(got.token_ids, want_ids)
    ref = reference_points(model, want_ids)  # hooks on the HF modules, one forward per window
    for point in POINTS:
        name, layer = point.split(".")
        torch.testing.assert_close(got[point], ref[(name, int(layer))], rtol=1e-5, atol=1e-5)


def test_the_directory_is_the_dataset_saelens_reads(eager_models, tmp_path):
    datasets = pytest.importorskip("datasets")
    model = eager_models[ARCH]
    harvest(model, PROMPTS[:12], ["resid_post.1", "z.0"], tmp_path / "h", context_size=8, shard_bytes=40_000)
    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) > 1  # written in shards
    ds = datasets.load_from_disk(str(tmp_path / "h"))
    assert isinstance(ds, datasets.Dataset) and len(ds) == manifest["rows"]
    assert ds.features["resid_post.1"] == datasets.Array2D(shape=(8, model.d_model), dtype="float32")
    assert ds.features["z.0"] == datasets.Array2D(shape=(8, model.graph.n_heads * model.graph.d_head),
                                                  dtype="float32")
    assert ds.features["token_ids"] == datasets.Sequence(datasets.Value("int32"), length=8)
    back = harvest.load(tmp_path / "h")
    row = len(ds) - 1  # the last shard's last row
    assert torch.equal(torch.tensor(ds[row]["resid_post.1"]), back["resid_post.1"][row])
    assert torch.equal(torch.tensor(ds[row]["z.0"]), back["z.0"][row].flatten(-2))


def test_max_tokens_rows_end_with_the_greedy_continuation(eager_models, tmp_path):
    from interp_engine import capture_generation

    model = eager_models[ARCH]
    harvest(model, PROMPTS[:6], ["resid_post.1"], tmp_path / "h", context_size=12, max_tokens=4)
    got = harvest.load(tmp_path / "h")
    window = _stream(model, PROMPTS[:6])[:9]  # 12 - 4 + 1 prompt tokens
    completion, cache = capture_generation(model, torch.tensor([window]), ["resid_post.1"], max_tokens=4,
                                           temperature=0.0, stop_at_eos=False)
    assert got.token_ids[0].tolist() == window + list(completion.token_ids[:3])
    torch.testing.assert_close(got["resid_post.1"][0], cache["resid_post.1"][0], rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused_before_any_forward(eager_models, tmp_path):
    model = eager_models[ARCH]
    with pytest.raises(ValueError, match="max_tokens=9 is more than context_size=8"):
        harvest(model, PROMPTS, POINTS, tmp_path / "a", context_size=8, max_tokens=9)
    with pytest.raises(ValueError, match="max_model_len"):
        harvest(model, PROMPTS, POINTS, tmp_path / "a", context_size=model.max_model_len)
    with pytest.raises(CapabilityUnsupported, match="pattern.1.*one row per token"):
        harvest(model, PROMPTS, ["pattern.1"], tmp_path / "a", context_size=8)
    with pytest.raises(ValueError, match="resid_post.9"):
        harvest(model, PROMPTS, ["resid_post.9"], tmp_path / "a", context_size=8)
    with pytest.raises(FileNotFoundError, match="not a file"):
        harvest(model, str(tmp_path / "missing.txt"), POINTS, tmp_path / "a", context_size=8)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("mine")
    with pytest.raises(FileExistsError, match="not a harvest"):
        harvest(model, PROMPTS, POINTS, tmp_path / "busy", context_size=8)
    assert not (tmp_path / "a").exists()


def test_a_resume_with_other_arguments_is_refused_not_mixed_in(eager_models, tmp_path):
    model = eager_models[ARCH]
    harvest(model, PROMPTS[:8], ["resid_post.0"], tmp_path / "h", context_size=8)
    before = (tmp_path / "h" / "manifest.json").read_text()
    for kwargs, field in ((dict(points=["resid_post.1"]), "points"),
                          (dict(context_size=16), "context_size"),
                          (dict(prompts=PROMPTS[:9]), "prompt_sha256")):
        call = dict(prompts=PROMPTS[:8], points=["resid_post.0"], context_size=8) | kwargs
        with pytest.raises(ManifestMismatch, match=field):
            harvest(model, call["prompts"], call["points"], tmp_path / "h", context_size=call["context_size"])
    assert (tmp_path / "h" / "manifest.json").read_text() == before
    again = harvest(model, PROMPTS[:8], ["resid_post.0"], tmp_path / "h", context_size=8)
    assert again.rows_this_run == 0 and again.rows == again.rows_resumed


def test_point_patterns_expand_as_run_with_cache_does_and_the_manifest_names_each_address(eager_models,
                                                                                           tmp_path):
    """``"resid_post.*"`` harvests every layer's resid_post (HF values), one column per address;
    the manifest holds the addresses, so the same run named either way resumes, and a pattern
    naming other addresses (or none) is refused before anything is written."""
    model = eager_models[ARCH]
    every = [f"resid_post.{layer}" for layer in range(model.n_layers)] + ["z.1"]
    report = harvest(model, PROMPTS[:8], ["resid_post.*", "z.1"], tmp_path / "h", context_size=8)
    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert manifest["args"]["points"] == every and list(report.points) == every
    got = harvest.load(tmp_path / "h")
    assert list(got.values) == every
    ref = reference_points(model, got.token_ids)
    for point in every:
        name, layer = point.split(".")
        torch.testing.assert_close(got[point], ref[(name, int(layer))], rtol=1e-5, atol=1e-5)
    again = harvest(model, PROMPTS[:8], every, tmp_path / "h", context_size=8)
    assert again.rows_this_run == 0 and again.rows == report.rows
    with pytest.raises(ManifestMismatch, match="points"):
        harvest(model, PROMPTS[:8], ["resid_post.*"], tmp_path / "h", context_size=8)
    with pytest.raises(ValueError, match="'mlp_out.9\\*' matches no point"):
        harvest(model, PROMPTS[:8], ["mlp_out.9*"], tmp_path / "new", context_size=8)
    assert not (tmp_path / "new").exists()


_KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    from interp_engine import load_model, harvest
    from interp_engine._harvest_store import ShardWriter
    from interp_engine.testing import tiny_model

    out, kill_in = sys.argv[1], int(sys.argv[2])
    write = ShardWriter.write
    seen = []

    def dying_write(self, columns):
        write(self, columns)
        if self.path.name == f"shard-{kill_in:05d}.arrow":
            seen.append(1)
            if len(seen) == 2:  # mid-shard: rows already in the file, the shard unfinished
                os.kill(os.getpid(), signal.SIGKILL)

    ShardWriter.write = dying_write
    prompts = [f"Item {i}: the capital of France is Paris, and {i} plus one is {i + 1}." for i in range(40)]
    model = load_model(tiny_model("qwen3"))
    harvest(model, prompts, ["resid_post.0", "z.1"], out, context_size=8, batch_size=2, shard_bytes=60_000)
""")


def test_a_run_killed_mid_shard_resumes_to_exactly_the_clean_rows(eager_models, tmp_path):
    model = eager_models[ARCH]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _KILLED_RUN, str(tmp_path / "h"), "2"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["shard-00000.arrow", "shard-00001.arrow"]
    assert (tmp_path / "h" / "shard-00002.arrow.partial").exists() and not manifest["complete"]
    with pytest.raises(ValueError, match="unfinished"):
        harvest.load(tmp_path / "h")
    report = harvest(model, PROMPTS, ["resid_post.0", "z.1"], tmp_path / "h", context_size=8, batch_size=2,
                     shard_bytes=60_000)
    assert report.rows_resumed == manifest["rows"] and report.rows_this_run == report.rows - manifest["rows"]
    assert not list((tmp_path / "h").glob("*.partial"))
    clean = harvest(model, PROMPTS, ["resid_post.0", "z.1"], tmp_path / "clean", context_size=8,
                    batch_size=2, shard_bytes=60_000)
    a, b = harvest.load(tmp_path / "h"), harvest.load(tmp_path / "clean")
    assert clean.rows == report.rows and torch.equal(a.token_ids, b.token_ids)
    for point in ("resid_post.0", "z.1"):
        assert torch.equal(a[point], b[point])


_PEAK = textwrap.dedent("""
    import resource, sys
    from interp_engine import load_model, harvest
    from interp_engine.testing import tiny_model

    rows, out = int(sys.argv[1]), sys.argv[2]
    model = load_model(tiny_model("qwen3"))
    points = [f"resid_post.{layer}" for layer in range(model.n_layers)] + ["z.0", "z.1"]
    prompts = [f"Item {i}: the capital of France is Paris, and {i} plus one is {i + 1}." for i in range(rows)]
    harvest(model, prompts[:4], points, out + "-warm", context_size=16)  # first-forward allocations
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = harvest(model, prompts, points, out, context_size=16, batch_size=32, shard_bytes=2_000_000)
    print(report.rows, report.shards, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
""")


def test_peak_memory_does_not_grow_with_the_number_of_shards(tiny_dirs, tmp_path):
    tiny_dirs[ARCH]  # built before the subprocesses start
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    growth = {}
    for n in (300, 1500):
        proc = subprocess.run([sys.executable, "-c", _PEAK, str(n), str(tmp_path / f"h{n}")], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows, shards, kib = map(int, proc.stdout.split()[-3:])
        growth[n] = (rows, shards, kib)
    (small_rows, small_shards, small_kib), (big_rows, big_shards, big_kib) = growth[300], growth[1500]
    assert big_shards >= 4 * small_shards and big_rows > 3000 // 1  # a few thousand rows
    data_kib = big_rows * 16 * 4 * (4 * 128 + 2 * 128) // 1024  # what holding every row would take
    assert big_kib - small_kib < data_kib / 4, (growth, data_kib)


def test_the_cli_harvests_and_names_mistakes_in_one_line(tiny_dirs, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS[:10]))
    out = tmp_path / "h"
    assert main(["harvest", "--model", "tiny:qwen3", "--points", "resid_post.0,mlp_out.1", "--prompts",
                 str(prompts), "--out", str(out), "--context-size", "8"]) == 0
    assert "rows x 8 positions of resid_post.0, mlp_out.1" in capsys.readouterr().out
    assert set(harvest.load(out).values) == {"resid_post.0", "mlp_out.1"}
    assert main(["harvest", "--model", "tiny:qwen3", "--points", "mlp_out.*", "--prompts",
                 str(prompts), "--out", str(tmp_path / "p"), "--context-size", "8"]) == 0
    assert "positions of mlp_out.0, mlp_out.1, mlp_out.2 in" in capsys.readouterr().out
    assert set(harvest.load(tmp_path / "p").values) == {"mlp_out.0", "mlp_out.1", "mlp_out.2"}
    assert main(["harvest", "--model", "tiny:qwen3", "--points", "resid_post.1", "--prompts",
                 str(prompts), "--out", str(out), "--context-size", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "other arguments" in err and "points" in err
    assert main(["harvest", "--model", "tiny:qwen3", "--points", "resid_post.0", "--prompts",
                 str(tmp_path / "none.txt"), "--out", str(tmp_path / "x")]) == 2
    assert "no such file" in capsys.readouterr().err
