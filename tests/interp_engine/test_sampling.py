"""The one table of which vllm.SamplingParams fields this library honours, and the refusal of
every other field set away from its default (nothing dropped silently)."""

from __future__ import annotations

import importlib.util

import pytest

from interp_engine import SAMPLING_FIELDS, SamplingConfig
from interp_engine._sampling import sampling_from_params

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")


@needs_vllm
def test_honoured_fields_map_onto_the_config():
    from vllm import SamplingParams

    got = sampling_from_params(SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=4,
                                              logprobs=2, ignore_eos=True, stop_token_ids=[5, 9],
                                              min_tokens=2, min_p=0.1))
    assert got == dict(max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=4, n_logprobs=2,
                       stop_at_eos=False, stop_token_ids=(5, 9), min_tokens=2, min_p=0.1)
    assert sampling_from_params(SamplingParams(top_k=-1))["top_k"] == 0
    SamplingConfig(**got)


@needs_vllm
@pytest.mark.parametrize("field, value", [
    ("n", 3), ("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("repetition_penalty", 1.2),
    ("stop", ["the"]), ("logit_bias", {5: 1.0}), ("allowed_token_ids", [1, 2]),
    ("bad_words", ["cat"]), ("prompt_logprobs", 1), ("include_stop_str_in_output", True),
    ("skip_special_tokens", False), ("extra_args", {"x": 1}),
])
def test_every_field_not_honoured_is_refused_by_name(field, value):
    from vllm import SamplingParams

    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*not honoured"):
        sampling_from_params(SamplingParams(**{field: value}))


@needs_vllm
def test_the_table_covers_every_samplingparams_field():
    from vllm import SamplingParams

    known = set(SAMPLING_FIELDS["honoured"]) | set(SAMPLING_FIELDS["free"])
    assert known <= set(SamplingParams.__struct_fields__)  # no stale names in the table


def test_other_arguments_are_refused_clearly():
    with pytest.raises(TypeError, match="must be a vllm.SamplingParams"):
        sampling_from_params(object())
    with pytest.raises(ValueError, match=r"unknown sampling fields \['temprature'\]"):
        sampling_from_params({"temprature": 0.0})
    assert sampling_from_params(None) == {}


@pytest.mark.parametrize("kwargs, match", [
    (dict(seed=2**64), r"below 2\*\*64"), (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(stop_token_ids=(600,), d_vocab=512), "outside the vocabulary"),
    (dict(min_tokens=5, max_tokens=4), r"min_tokens must be an int in \[0, max_tokens=4\]"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"), (dict(min_p=-0.1), "min_p"),
])
def test_bad_configs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("t", [2.0000001, 2.5, 10.0])
def test_temperature_above_vllms_limit_is_refused_up_front_on_every_backend(t):
    """vLLM refuses temperature > 2 at request time; the config refuses it before any forward."""
    with pytest.raises(ValueError, match=r"temperature .*\[0, 2.0\]"):
        SamplingConfig(temperature=t)
    assert SamplingConfig(temperature=2.0).temperature == 2.0


def test_a_request_config_is_checked_once_per_distinct_ask_and_a_bad_one_every_time():
    """interp_engine._api._sampling: requests asking the same share one checked SamplingConfig
    (it is immutable); a value of another type that compares equal (True == 1) is its own ask,
    checked (and refused) on its own; the context still cuts max_tokens per prompt."""
    from types import SimpleNamespace

    from interp_engine._api import _sampling

    model = SimpleNamespace(max_model_len=64, d_vocab=100)
    first = _sampling(model, 5, max_tokens=8, temperature=0.0, stop_at_eos=False)
    assert _sampling(model, 7, max_tokens=8, temperature=0.0, stop_at_eos=False) is first
    assert first == SamplingConfig(max_tokens=8, temperature=0.0, stop_at_eos=False, d_vocab=100)
    assert _sampling(model, 60, max_tokens=8, temperature=0.0, stop_at_eos=False).max_tokens == 4
    assert _sampling(model, 5, max_tokens=1).max_tokens == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="max_tokens"):
            _sampling(model, 5, max_tokens=True)  # == 1, but not an int
        with pytest.raises(ValueError, match="temperature"):
            _sampling(model, 5, temperature=float("nan"))
    other = _sampling(SimpleNamespace(max_model_len=64, d_vocab=10), 5, max_tokens=8, temperature=0.0,
                      stop_at_eos=False)
    assert other is not first and other.d_vocab == 10
    with pytest.raises(ValueError, match="stop_token_ids"):
        _sampling(model, 5, stop_token_ids=[3, 200])  # a list: made a tuple, then checked
