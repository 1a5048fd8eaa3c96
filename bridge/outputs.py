"""vLLM-shaped results. Built from vLLM's own output types where vLLM is installed, so code
written against ``RequestOutput`` works on every backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
import itertools

_ids = itertools.count()


def _vllm_outputs():
    try:
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput
    except Exception:  # vLLM missing or unimportable here: use the plain shapes below
        return None
    return Logprob, CompletionOutput, RequestOutput


@dataclass
class _Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class _CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Any]] | None
    finish_reason: str | None = None
    stop_reason: Any = None


@dataclass
class _RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[_CompletionOutput]
    finished: bool
    metrics: Any = None
    lora_request: Any = None
    extra: dict = field(default_factory=dict)


def _with_completion_view(cls):
    """A RequestOutput whose single completion's fields are also on the result itself."""

    class FullOutput(cls):  # type: ignore[misc, valid-type]
        @property
        def text(self) -> str:
            return self.outputs[0].text

        @property
        def token_ids(self):
            return self.outputs[0].token_ids

        @property
        def logprobs(self):
            return self.outputs[0].logprobs

        @property
        def finish_reason(self):
            return self.outputs[0].finish_reason

    FullOutput.__name__ = FullOutput.__qualname__ = "FullOutput"
    return FullOutput


_FULL_CACHE: dict[str, type] = {}


def _full_cls(base: type) -> type:
    key = f"{base.__module__}.{base.__qualname__}"
    if key not in _FULL_CACHE:
        _FULL_CACHE[key] = _with_completion_view(base)
    return _FULL_CACHE[key]


def full_output(prompt_ids: list[int], steps: list, finish: str, n_logprobs: int | None):
    """Build a RequestOutput from GenSteps (``steps[i].logprobs``: ``[{"token_id", "logprob"}]``)."""
    found = _vllm_outputs()
    Logprob, Completion, Request = found if found else (_Logprob, _CompletionOutput, _RequestOutput)
    logprobs = None
    cumulative = None
    if n_logprobs is not None:
        logprobs, cumulative = [], 0.0
        for step in steps:
            entry = {}
            for rank, item in enumerate(step.logprobs or [], start=1):
                entry[item["token_id"]] = Logprob(logprob=item["logprob"], rank=rank, decoded_token=None)
            if step.logprob is not None:
                if step.token_id not in entry:
                    entry = {step.token_id: Logprob(logprob=step.logprob, rank=None, decoded_token=None), **entry}
                cumulative += step.logprob
            logprobs.append(entry)
    completion = Completion(
        index=0, text="".join(s.token_str for s in steps), token_ids=[s.token_id for s in steps],
        cumulative_logprob=cumulative, logprobs=logprobs, finish_reason=finish,
    )
    cls = _full_cls(Request)
    return cls(request_id=f"interp-{next(_ids)}", prompt=None, prompt_token_ids=list(prompt_ids),
               prompt_logprobs=None, outputs=[completion], finished=True)
