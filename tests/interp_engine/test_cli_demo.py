"""The demo model has learned its facts, its lens shows the answer forming, a mean-difference
steering vector moves the answer, and the demo command writes its pictures (eager and vLLM)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import SteerSpec, generate_stream, load_model, run_with_cache, steer
from interp_engine._demo_model import CAPITALS, demo_corpus, demo_model
from interp_engine.cli import main


@pytest.fixture(scope="module")
def demo():
    return load_model(demo_model(progress=False))


def _id(model, text):
    ids = model.to_tokens(text)[0].tolist()
    assert len(ids) == 1, f"{text!r} is {len(ids)} tokens"
    return ids[0]


def test_the_vocabulary_is_the_tokenizers(demo):
    """vLLM returns logits as wide as the model's embedding: they must be the tokenizer's width."""
    assert demo.d_vocab == len(demo.tok.hf)


def test_the_corpus_and_the_directory_are_fixed():
    assert demo_corpus() == demo_corpus()
    assert demo_model(progress=False) == demo_model(progress=False)


def test_greedy_completion_knows_every_capital(demo):
    for country, city in CAPITALS:
        steps = list(generate_stream(demo, demo.to_tokens(f"The capital of {country} is"),
                                     max_tokens=1, temperature=0.0))
        assert steps[0].token_id == _id(demo, f" {city}"), country


def test_the_lens_shows_the_answer_forming(demo):
    tokens = demo.to_tokens("The opposite of hot is")
    points = ["resid_pre.0"] + [f"resid_post.{i}" for i in range(demo.n_layers)]
    cold = _id(demo, " cold")
    p = demo.decode_residuals(run_with_cache(demo, tokens, points), points=points)[:, 0, -1, cold].exp()
    assert p[0] < 0.05 and p[-1] > 0.9
    assert bool((p[1:] >= p[:-1] - 0.02).all()), p  # it grows layer by layer


def test_a_mean_difference_vector_moves_the_answer(demo):
    from interp_engine._cli_generate import mean_difference

    vector = mean_difference(demo, ["The capital of Germany is", "People in Germany visit"],
                             ["The capital of France is", "People in France visit"], "resid_post.2")
    tokens = demo.to_tokens("The capital of France is")
    with steer(demo, SteerSpec.add("resid_post.2", vector)):
        first = next(iter(generate_stream(demo, tokens, max_tokens=1, temperature=0.0)))
    assert first.token_id == _id(demo, " Berlin")


def test_the_demo_writes_its_pictures_and_says_where(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("lens.png", "attention.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
        assert str(tmp_path / name) in out


@pytest.mark.vllm
def test_the_demo_model_on_vllm_gives_the_eager_answers(demo):
    pytest.importorskip("vllm")
    model = load_model(demo.path, backend="vllm")
    try:
        tokens = demo.to_tokens("The capital of France is")
        steps = list(generate_stream(model, tokens, max_tokens=1, temperature=0.0, n_logprobs=1))
        assert steps[0].token_id == _id(demo, " Paris")
        eager = list(generate_stream(demo, tokens, max_tokens=1, temperature=0.0, n_logprobs=1))
        assert abs(steps[0].logprobs[0]["logprob"] - eager[0].logprobs[0]["logprob"]) < 1e-4
        assert torch.equal(torch.tensor(model.d_vocab), torch.tensor(demo.d_vocab))
    finally:
        model.close()


def test_training_is_deterministic_and_keyed_by_its_recipe(tmp_path):
    """Two trainings of the same (shortened) recipe write the same bytes; another recipe
    gets another directory."""
    import dataclasses

    from interp_engine._demo_model import _RECIPE

    short = dataclasses.replace(_RECIPE, steps=3)
    a = demo_model(root=tmp_path / "a", progress=False, _recipe=short)
    b = demo_model(root=tmp_path / "b", progress=False, _recipe=short)
    assert a.name == b.name
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    other = demo_model(root=tmp_path / "a", progress=False, _recipe=dataclasses.replace(short, seed=8))
    assert other.name != a.name
    assert (other / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
