"""Eager's sampler against vLLM's own CPU Sampler module, called in-process on the same logits:
the same seed and parameters must give the same token at every step (no engine needed)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from interp_engine._sampler import GREEDY_BELOW, filter_logits, new_generator, sample_token

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")


def _vllm_draws(logits: torch.Tensor, steps: int, temperature: float, top_k: int, top_p: float,
                min_p: float, seed: int) -> list[int]:
    """``steps`` draws by vLLM's Sampler for one seeded request (the generator carries over)."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4))
    min_p_proc = MinPLogitsProcessor(config, torch.device("cpu"), False)
    min_p_proc.update_state(BatchUpdate(batch_size=1, removed=[], moved=[],
                                        added=[(0, SamplingParams(min_p=min_p), None, [])]))
    d_vocab = logits.shape[-1]
    temperature = SamplingParams(temperature=temperature).temperature  # (0, 0.01) becomes 0.01
    greedy = temperature < GREEDY_BELOW
    generator = torch.Generator(device="cpu").manual_seed(seed)  # as the model runner seeds it
    zeros = torch.zeros(1)
    sampler = Sampler()
    out = []
    for step in range(steps):
        meta = SamplingMetadata(
            temperature=None if greedy else torch.tensor([temperature], dtype=torch.float32),
            all_greedy=greedy, all_random=not greedy,
            top_p=None if top_p >= 1.0 else torch.tensor([top_p], dtype=torch.float32),
            top_k=None if not 0 < top_k < d_vocab else torch.tensor([top_k], dtype=torch.int32),
            generators={} if greedy else {0: generator}, max_num_logprobs=None, no_penalties=True,
            prompt_token_ids=None, frequency_penalties=zeros, presence_penalties=zeros,
            repetition_penalties=zeros, output_token_ids=[[]], allowed_token_ids_mask=None,
            bad_words_token_ids={}, logitsprocs=LogitsProcessors([min_p_proc]))
        row = logits[step % logits.shape[0]].clone()[None]
        out.append(int(sampler(row, meta).sampled_token_ids[0, 0]))
    return out


def _eager_draws(logits, steps, temperature, top_k, top_p, min_p, seed, sample=sample_token):
    generator = new_generator(seed)
    return [sample(logits[step % logits.shape[0]], temperature, generator, top_k, top_p, min_p)
            for step in range(steps)]


params = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 1e-6, 0.005, 0.3, 0.7, 1.0, 1.5, 2.0]),
    "top_k": st.sampled_from([0, 1, 2, 5, 40, 500]),
    "top_p": st.sampled_from([1.0, 0.95, 0.8, 0.3, 0.01]),
    "min_p": st.sampled_from([0.0, 0.05, 0.3]),
    "seed": st.integers(0, 2**40),
    "d_vocab": st.sampled_from([7, 151, 1000]),
    "scale": st.sampled_from([0.5, 3.0, 10.0]),
})


@needs_vllm
@settings(max_examples=60, deadline=None, derandomize=True)
@given(p=params)
def test_eager_draws_what_vllms_cpu_sampler_draws(p):
    logits = torch.randn(3, p["d_vocab"], generator=torch.Generator().manual_seed(p["seed"] % 997)) * p["scale"]
    args = (6, p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["seed"])
    assert _eager_draws(logits, *args) == _vllm_draws(logits, *args)


def test_seeded_draws_repeat_and_seeds_differ():
    logits = torch.zeros(1, 500)
    a = _eager_draws(logits, 8, 1.0, 0, 1.0, 0.0, seed=3)
    assert a == _eager_draws(logits, 8, 1.0, 0, 1.0, 0.0, seed=3)
    assert a != _eager_draws(logits, 8, 1.0, 0, 1.0, 0.0, seed=4)


def test_filters_keep_what_they_promise():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert torch.isfinite(filter_logits(logits, 1.0, top_k=2)).tolist() == [True, True, False, False, False]
    kept = torch.isfinite(filter_logits(logits, 1.0, top_p=0.7)).tolist()
    assert kept == [True, True, False, False, False]  # 0.64 + 0.23: the smallest set past 0.7
    assert torch.isfinite(filter_logits(logits, 1.0, top_p=0.01)).sum() == 1
    assert torch.isfinite(filter_logits(logits, 1.0, min_p=0.3)).tolist() == [True, True, False, False, False]
    assert sample_token(logits, 0.0, None) == 0


@needs_vllm
def test_a_sampler_that_ignores_the_seed_is_caught():
    """The planted bug: the race key from a fresh, unseeded generator."""
    def unseeded(row, temperature, generator, top_k, top_p, min_p):
        return sample_token(row, temperature, new_generator(None), top_k, top_p, min_p)

    logits = torch.zeros(2, 1000)
    args = (6, 1.0, 0, 1.0, 0.0, 11)
    assert _eager_draws(logits, *args, sample=unseeded) != _vllm_draws(logits, *args)
