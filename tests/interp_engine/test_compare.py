"""compare: zero divergence for identical engines, a planted difference (steering on one
engine only) flagged at the right point and position, readable failures, tokens, the plot,
the CLI, and eager against vLLM."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from interp_engine import (Address, GenStep, SteerSpec, assert_backends_agree, compare, default_tolerance,
                           generate_stream, load_model, run_with_cache, steer)
from interp_engine.cli import main as cli_main
from interp_engine.testing import tiny_model

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
PROMPT = [5, 17, 42, 9, 100, 3]


@pytest.fixture(scope="module")
def twins():
    """Two eager loads of the same weights: the same engine twice."""
    path = tiny_model("qwen3")
    return load_model(path), load_model(path)


def _points(model):
    return [Address("resid_post", layer) for layer in range(model.n_layers)]


def _pipeline(steered_model=None, spec=None, gen_tokens=0):
    def fn(model):
        def run():
            out = {"cache": run_with_cache(model, PROMPT, _points(model))}
            if gen_tokens:
                out["greedy"] = list(generate_stream(model, PROMPT, max_tokens=gen_tokens, temperature=0.0,
                                                     n_logprobs=3, stop_at_eos=False))
            return out
        if model is steered_model:
            with steer(model, spec):
                return run()
        return run()
    return fn


def test_identical_engines_show_zero_divergence(twins):
    report = compare(_pipeline(gen_tokens=4), twins)
    assert report.passed and report.engines == ("eager", "eager#2")
    tensors = [d for d in report.diffs if d.kind == "tensor"]
    assert {d.output for d in tensors} >= {"cache/resid_post.0", "greedy/logprob"}
    assert all(d.max_abs == 0.0 and d.rel == 0.0 for d in tensors)
    assert report["greedy/tokens"].first_divergence is None


def test_steering_on_one_engine_is_flagged_at_its_point_and_position(twins):
    a, b = twins
    layer, pos = 1, 3
    spec = SteerSpec.add(f"resid_post.{layer}", torch.randn(a.d_model, generator=torch.Generator().manual_seed(0)),
                         scale=4.0, positions=(pos,))
    report = compare(_pipeline(b, spec), twins)
    assert not report.passed
    assert report["cache/resid_post.0"].passed and report["cache/resid_post.0"].rel == 0.0
    hit = report[f"cache/resid_post.{layer}"]
    assert not hit.passed and hit.position == pos and hit.layer == layer
    assert hit.where[1] == pos and hit.rel > 0.01
    assert [d.output for d in report.failures()][0] == f"cache/resid_post.{layer}"  # first failure in layer order


def test_generated_tokens_report_the_first_divergence(twins):
    a, b = twins
    spec = SteerSpec.add("resid_post.2", torch.ones(a.d_model) * 50.0, positions="generated")
    report = compare(_pipeline(b, spec, gen_tokens=6), twins)
    tokens = report["greedy/tokens"]
    assert tokens.first_divergence is not None and tokens.near_tie is False and not tokens.passed
    assert "first diverging token at step" in tokens.describe()
    # logprobs are compared only up to the divergence (after it the prefixes differ)
    assert report["greedy/logprob"].where is None or report["greedy/logprob"].where[0] < tokens.first_divergence + 1


def test_a_divergence_at_a_near_tie_passes_and_says_so(twins):
    steps = {0: [GenStep(7, "", [{"token_id": 7, "logprob": -0.69310}, {"token_id": 8, "logprob": -0.69316}], None)],
             1: [GenStep(8, "", [{"token_id": 8, "logprob": -0.69312}, {"token_id": 7, "logprob": -0.69314}], None)]}
    report = compare(lambda m: steps[twins.index(m)], twins, tolerance=1e-3)
    d = report["tokens"]
    assert d.first_divergence == 0 and d.tokens == (7, 8) and d.near_tie is True and d.passed
    wide = {0: [GenStep(7, "", [{"token_id": 7, "logprob": -0.1}, {"token_id": 8, "logprob": -2.5}], None)],
            1: steps[1]}
    assert compare(lambda m: wide[twins.index(m)], twins)["tokens"].near_tie is False


def test_the_pytest_helper_fails_with_a_readable_message(twins):
    a, b = twins
    spec = SteerSpec.add("resid_post.1", torch.ones(a.d_model), scale=3.0, positions=(2,))
    assert_backends_agree(_pipeline(), twins)  # passes, returns the report
    with pytest.raises(AssertionError) as err:
        assert_backends_agree(_pipeline(b, spec), twins)
    message = str(err.value)
    assert "backends disagree on 2 output(s)" in message
    assert "cache/resid_post.1 on eager#2: max |diff|" in message and "at [0, 2, " in message
    assert "FAIL" in message and "cache/resid_post.0" in message  # the full table follows


def test_bad_input_is_refused_before_running(twins):
    calls = []
    with pytest.raises(ValueError, match="two or more models"):
        compare(lambda m: calls.append(m), twins[:1])
    with pytest.raises(ValueError, match="is not the same model"):
        compare(lambda m: calls.append(m), [twins[0], load_model(tiny_model("llama"))])
    with pytest.raises(TypeError, match="function of a model"):
        compare("resid_post.0", twins)
    assert calls == []
    with pytest.raises(TypeError, match="cannot compare str"):
        compare(lambda m: {"x": "text"}, twins)
    with pytest.raises(ValueError, match="tolerance must be"):
        compare(lambda m: 1.0, twins, tolerance=-1)


def test_the_table_and_the_plot(twins, tmp_path):
    a, b = twins
    spec = SteerSpec.add("resid_post.1", torch.ones(a.d_model), positions=(2,))
    report = compare(_pipeline(b, spec), twins)
    table = str(report)
    assert table.splitlines()[0].startswith("compare: reference eager vs eager#2; dtype float32")
    assert "FAIL" in table and "cache/resid_post.2" in table
    png = report.plot(tmp_path / "layers.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tolerance_grows_with_depth_and_with_coarser_dtypes():
    t32, t16, tbf = (default_tolerance(d, 4, 256) for d in (torch.float32, torch.float16, torch.bfloat16))
    assert t32 < t16 < tbf
    assert default_tolerance(torch.float32, 8, 256) > t32


def test_the_cli_prints_the_report_and_exits_by_its_verdict(capsys, tmp_path):
    assert cli_main(["compare", "--model", "tiny:qwen3", "--backends", "eager,eager",
                     "--points", "resid_post,attn_out.1", "--max-tokens", "3",
                     "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "cache/attn_out.1" in out and "greedy/tokens" in out
    assert (tmp_path / "p.png").exists()


@needs_vllm
@pytest.mark.vllm
def test_eager_and_vllm_agree_in_fp32(model_pool):
    eager, vllm = model_pool.get("qwen3"), model_pool.get("qwen3", "vllm", enable_prompt_embeds=True)
    report = assert_backends_agree(_pipeline(gen_tokens=6), {"eager": eager, "vllm": vllm})
    assert report["cache/resid_post.2"].rel < report.tolerance


def test_the_demo_comparison_prints_the_report(capsys):
    from interp_engine._compare_cli import print_backend_comparison

    assert print_backend_comparison(tiny_model("qwen3"), [[1, 2, 3]], ["resid_post.0"], 2, backends=("eager", "eager"))
    assert "cache/resid_post.0" in capsys.readouterr().out
