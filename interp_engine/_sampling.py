"""Sampling parameters (validated data); the draw itself is vLLM's procedure, in _sampler."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from jaxtyping import Float

from ._shapes import entry

__all__ = ["SAMPLING_FIELDS", "SamplingConfig", "sampling_from_params", "top_logprobs"]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses higher at request time


@dataclass(frozen=True)
class SamplingConfig:
    """What a generation call asked for; every field checked on construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability (0: off)
    stop_at_eos: bool = True
    seed: int | None = None
    n_logprobs: int | None = None
    d_vocab: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # finish ("stop") after generating any of these
    min_tokens: int = 0  # EOS and stop_token_ids cannot be drawn before this many tokens

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) \
                or not math.isfinite(self.temperature) or not (0 <= self.temperature <= _MAX_TEMPERATURE):
            raise ValueError(f"temperature must be a finite number in [0, {_MAX_TEMPERATURE}] (0 is greedy; "
                             f"vLLM refuses more than {_MAX_TEMPERATURE}, so both backends do), "
                             f"got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) \
                or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, numbers.Real) \
                or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if not isinstance(self.stop_at_eos, bool):
            raise TypeError(f"stop_at_eos must be a bool, got {self.stop_at_eos!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {self.seed!r}")
        if self.n_logprobs is not None:
            if not _is_int(self.n_logprobs) or self.n_logprobs < 0:
                raise ValueError(f"n_logprobs must be an int >= 0 or None, got {self.n_logprobs!r}")
            if self.d_vocab is not None and self.n_logprobs > self.d_vocab:
                raise ValueError(
                    f"n_logprobs={self.n_logprobs} is above the vocabulary size {self.d_vocab}"
                )
        if self.d_vocab is not None and self.top_k > self.d_vocab:
            raise ValueError(f"top_k={self.top_k} is above the vocabulary size {self.d_vocab}")
        if self.seed is not None and self.seed >= 2**64:
            raise ValueError(f"seed must be below 2**64 (a torch generator seed), got {self.seed}")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a tuple of non-negative token ids, got {self.stop_token_ids!r}")
        if self.d_vocab is not None and any(t >= self.d_vocab for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids {list(self.stop_token_ids)} holds ids outside the vocabulary "
                             f"[0, {self.d_vocab})")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        """Only 0 is greedy, as in vLLM: a temperature in (0, 0.01) samples at 0.01."""
        return self.temperature == 0.0


# ---- vllm.SamplingParams ------------------------------------------------------------------
#
# The one table of which SamplingParams fields this library honours. Every backend runs a
# request from a SamplingConfig, so a field means the same on each: eager and vLLM alike.
#   honoured : field -> (SamplingConfig field, conversion)
#   free     : fields that do not change the tokens drawn or what is returned (the library
#              streams and detokenises itself)
# Any other field set to something other than its default is refused, by name.

def _top_k(v):
    return 0 if v is None or v < 0 else int(v)


SAMPLING_FIELDS = {
    "honoured": {
        "max_tokens": ("max_tokens", lambda v: v),  # None: up to the end of the context
        "temperature": ("temperature", float),
        "top_k": ("top_k", _top_k),
        "top_p": ("top_p", float),
        "min_p": ("min_p", float),
        "seed": ("seed", lambda v: v),
        "logprobs": ("n_logprobs", lambda v: v),
        "ignore_eos": ("stop_at_eos", lambda v: not bool(v)),
        "stop_token_ids": ("stop_token_ids", lambda v: tuple(v or ())),
        "min_tokens": ("min_tokens", lambda v: v),
    },
    "free": ("output_kind", "detokenize", "stream_interval", "skip_clone", "output_text_buffer_length",
             "skip_reading_prefix_cache"),
}


def sampling_from_params(params: object) -> dict:
    """SamplingConfig keyword arguments from a ``vllm.SamplingParams`` (None: defaults), or
    from a dict of SamplingConfig fields. A SamplingParams field this library does not honour,
    set to anything but its default, raises ValueError naming it."""
    if params is None:
        return {}
    if isinstance(params, dict):
        known = {f for f in SamplingConfig.__dataclass_fields__ if f != "d_vocab"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling fields {unknown}; use {sorted(known)} or a vllm.SamplingParams")
        return dict(params)
    fields = getattr(type(params), "__struct_fields__", None)
    if type(params).__name__ != "SamplingParams" or fields is None:
        raise TypeError(f"sampling_params must be a vllm.SamplingParams (or a dict of SamplingConfig "
                        f"fields, or None), got {type(params).__name__}")
    default = type(params)()
    honoured, free = SAMPLING_FIELDS["honoured"], SAMPLING_FIELDS["free"]
    out = {}
    for name in fields:
        if name.startswith("_") or name in free:
            continue
        value = getattr(params, name)
        if name in honoured:
            target, convert = honoured[name]
            out[target] = convert(value)
        elif value != getattr(default, name):
            raise ValueError(
                f"SamplingParams.{name}={value!r} is not honoured by interp_engine (on any backend), "
                f"and would be dropped silently: leave it at its default ({getattr(default, name)!r}). "
                f"Honoured fields: {', '.join(honoured)}")
    return out


@entry
def top_logprobs(logits: Float[torch.Tensor, "d_vocab"], k: int) -> list[dict]:
    """The k most likely tokens of one position: ``[{"token_id", "logprob"}, ...]``, best first."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 1:
        raise ValueError(f"top_logprobs takes logits of shape [d_vocab], got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if not _is_int(k) or k < 0 or k > logits.shape[0]:
        raise ValueError(f"k must be an int in [0, {logits.shape[0]}], got {k!r}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, k)
    return [{"token_id": int(i), "logprob": float(v)} for v, i in zip(values.tolist(), ids.tolist())]
