"""The command line: every subcommand has --help, user mistakes are one line and exit 2, and
each subcommand does its job on a tiny model (lens, attention, generate, points)."""

from __future__ import annotations

import pytest

from interp_engine import cli
from interp_engine.cli import COMMANDS, main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"interp-engine {name}" in capsys.readouterr().out


def test_register_adds_one_row_and_refuses_a_taken_name(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", list(COMMANDS))
    cli.register("lens-again", "the lens under another name", "interp_engine._cli_lens")
    assert "lens-again" in cli.build_parser()._subparsers._group_actions[0].choices
    with pytest.raises(ValueError, match="already registered"):
        cli.register("lens", "twice", "interp_engine._cli_lens")


@pytest.mark.parametrize("argv, says", [
    (["lens", "--model", "tiny:qwen3", "--prompt", "x", "--png", "out.jpg"], "must end in .png"),
    (["lens", "--model", "tiny:gpt5", "--prompt", "x"], "unknown tiny architecture"),
    (["lens", "--model", "/no/such/model", "--prompt", "x"], "not found"),
    (["generate", "--model", "tiny:qwen3", "--prompt", "x", "--steer", "/no/such.pt"], "no such file"),
    (["generate", "--model", "tiny:qwen3", "--prompt", "x", "--at", "resid_post.99",
      "--steer-from", "a", "b"], "layer 99 out of range"),
    (["generate", "--model", "tiny:qwen3", "--prompt", "x", "--steer-from", "a | ", "b"], "separated by '|'"),
    (["generate", "--model", "tiny:qwen3", "--prompt", "x", "--save-steer", "v.pt"], "--steer-from"),
    (["attention", "--model", "tiny:qwen3", "--prompt", "x y", "--layer", "7", "--png", "a.png"], "layers 0..2"),
])
def test_a_user_mistake_is_one_line_and_exit_2(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"interp-engine {argv[0]}: error: "), err
    assert says in err[0]


def test_a_bug_is_not_dressed_as_a_user_mistake(monkeypatch):
    """Only the library's user-facing errors become one line; a TypeError from our own code
    keeps its traceback."""
    import interp_engine._cli_points as points

    def broken(args):
        raise TypeError("a bug")

    monkeypatch.setattr(points, "run", broken)
    with pytest.raises(TypeError, match="a bug"):
        main(["points", "--model", "tiny:qwen3"])


def test_lens_prints_every_layer_and_draws_the_grid(capsys, tmp_path):
    out = tmp_path / "lens.png"
    assert main(["lens", "--model", "tiny:qwen3", "--prompt", "The capital of France is", "--png", str(out)]) == 0
    text = capsys.readouterr().out
    assert all(f"layer {layer}" in text for layer in range(3)) and "embed" in text
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_lens_rows_are_the_library_lens(eager_models):
    """The CLI's table is decode_residuals of resid_pre.0 then each resid_post, nothing else."""
    import torch

    from interp_engine import run_with_cache
    from interp_engine._cli_lens import lens

    model = eager_models["qwen3"]
    result = lens(model, "The cat sat")
    points = ["resid_pre.0"] + [f"resid_post.{i}" for i in range(model.n_layers)]
    expected = model.decode_residuals(run_with_cache(model, model.to_tokens("The cat sat"), points), points=points)[:, 0]
    assert torch.equal(result.top_ids, expected.argmax(-1))
    torch.testing.assert_close(result.top_probs, expected.max(-1).values.exp())


def test_attention_draws_one_panel_per_head(capsys, tmp_path):
    out = tmp_path / "attention.png"
    assert main(["attention", "--model", "tiny:qwen3", "--prompt", "a b c", "--layer", "1", "--png", str(out)]) == 0
    assert capsys.readouterr().out.count("head ") == 4
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_a_saved_steering_vector_steers_as_when_it_was_built(capsys, tmp_path):
    vector = tmp_path / "v.pt"
    base = ["generate", "--model", "tiny:qwen3", "--prompt", "The cat", "--max-tokens", "6"]
    assert main(base) == 0
    plain = capsys.readouterr().out.splitlines()[-1]
    assert main(base + ["--steer-from", "Water boils | The sea", "The cat sat | A dog", "--scale", "4",
                        "--save-steer", str(vector)]) == 0
    built = capsys.readouterr().out.splitlines()[-1]
    assert main(base + ["--steer", str(vector), "--scale", "4"]) == 0
    loaded = capsys.readouterr().out.splitlines()[-1]
    assert built == loaded and built != plain


def test_mean_difference_is_the_difference_of_the_means(eager_models):
    import torch

    from interp_engine import run_with_cache
    from interp_engine._cli_generate import mean_difference

    model = eager_models["qwen3"]
    pos, neg = ["The cat", "A dog sat"], ["Water"]

    def last(p):
        return run_with_cache(model, model.to_tokens(p), ["resid_post.1"])["resid_post.1"][0, -1]

    expected = (last(pos[0]) + last(pos[1])) / 2 - last(neg[0])
    torch.testing.assert_close(mean_difference(model, pos, neg, "resid_post.1"), expected)


def test_generate_prints_n_logprobs_per_step(capsys):
    assert main(["generate", "--model", "tiny:qwen3", "--prompt", "The cat", "--max-tokens", "3",
                 "--n-logprobs", "2"]) == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("step ")]
    assert len(steps) == 3


def test_points_names_what_each_backend_refuses(capsys):
    assert main(["points", "--model", "tiny:qwen3"]) == 0
    eager = capsys.readouterr().out
    assert "refused" not in eager and "pattern" in eager
    pytest.importorskip("vllm")
    assert main(["points", "--model", "tiny:qwen3", "--backend", "vllm"]) == 0
    vllm = capsys.readouterr().out
    line = next(x for x in vllm.splitlines() if x.strip().startswith("pattern "))
    assert line.rstrip().endswith("served")  # rebuilt in the worker from the kernel's q and k
    assert main(["points", "--model", "tiny:qwen3", "--backend", "vllm-static"]) == 0
    static = capsys.readouterr().out
    line = next(x for x in static.splitlines() if x.strip().startswith("pattern "))
    assert "refused: static_point" in line and "Instead" in line


def test_serve_prints_vllms_server_with_the_runtime_and_passes_options_after_the_separator(capsys, tmp_path):
    pytest.importorskip("vllm")
    from interp_engine.testing import tiny_model

    vectors = tmp_path / "v.safetensors"
    vectors.write_bytes(b"")
    assert main(["serve", "tiny:qwen3", "--port", "8123", "--vectors", str(vectors), "--print-command",
                 "--", "--dtype", "float32"]) == 0
    line = capsys.readouterr().out.strip()
    assert "vllm.entrypoints.openai.api_server" in line and str(tiny_model("qwen3")) in line
    assert "--worker-extension-cls bridge.vllm.worker.InterpWorkerExtension" in line
    assert "--port 8123" in line and line.endswith("--dtype float32")


def test_serve_and_points_refuse_what_they_cannot_take(capsys, tmp_path):
    pytest.importorskip("vllm")
    assert main(["serve", "tiny:qwen3", "--vectors", str(tmp_path / "none.safetensors"), "--print-command"]) == 2
    assert "--vectors" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["points", "--model", "tiny:qwen3", "--", "x"])


def test_compare_refuses_one_backend(capsys):
    assert main(["compare", "--model", "tiny:qwen3", "--backends", "eager"]) == 2
    assert "two or more" in capsys.readouterr().err
