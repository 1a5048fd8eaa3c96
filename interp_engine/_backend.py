"""The one seam between the core and an engine: the ``Backend`` protocol.

The core validates input against the model graph, builds a Plan with the pure transforms and
calls these methods; a bridge (``bridge.eager``, ``bridge.vllm``) lowers the plan onto its engine
and runs it. The core never probes a backend for optional attributes: what varies between
engines is answered by these properties, before any forward.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Iterator, NamedTuple, Protocol, runtime_checkable

import torch

from ._address import Address
from ._capabilities import CapabilityUnsupported
from ._graph import GradSupport
from ._plan import Plan
from ._sampling import SamplingConfig
from ._tokens import TokenBatch

__all__ = ["Backend", "RawStep"]


class RawStep(NamedTuple):
    """One generated token as a backend reports it (a named tuple: a backend makes one per
    token of every request, and a frozen dataclass costs over twice as much to build)."""

    token_id: int
    logprobs: list[dict] | None
    logits: torch.Tensor | None
    finish_reason: str | None  # None while generating; "stop" (EOS / stop token) or "length"
    logprob: float | None = None  # of the sampled token, when logprobs were asked


@runtime_checkable
class Backend(Protocol):
    """What an engine provides to the core."""

    # ---- facts, answerable before any forward --------------------------------------
    name: str
    hooks_available: bool
    graph_replay: bool
    static_points: tuple[Address, ...]
    static_writes: tuple[Address, ...]
    prompt_embeds: bool  # generate_from_embeds is on
    dtype: torch.dtype
    max_model_len: int  # prompt + generated tokens never exceed it

    @property
    def grad_support(self) -> GradSupport: ...

    def refusal(self, plan: Plan, batch: TokenBatch | None, *,
                gradients: bool = False) -> CapabilityUnsupported | None:
        """The refusal this plan meets on this engine, or None: before any forward."""

    # ---- running ------------------------------------------------------------------
    def run_with_cache(self, plan: Plan, batch: TokenBatch, detach: bool, want_logits: bool | str,
                       stop_at_layer: int | None = None) -> tuple[dict[Address, torch.Tensor], torch.Tensor | None]:
        """``want_logits``: False, True (every position, eager) or "last" (each row's final
        position, [batch, d_vocab]). ``stop_at_layer``: the plan touches only earlier layers
        (checked by the core); a backend may end the forward there."""

    def new_capture(self) -> Any:
        """Per-request capture state handed to generate/agenerate, then to assemble."""

    def generate(self, prompt: list[int] | None, config: SamplingConfig, plan: Plan,
                 capture: Any = None, embeds: torch.Tensor | None = None) -> Iterator[RawStep]: ...

    def agenerate(self, prompt: list[int] | None, config: SamplingConfig, plan: Plan,
                  capture: Any = None, embeds: torch.Tensor | None = None,
                  streaming: bool = True) -> AsyncIterator[list[RawStep]]:
        """The generated tokens in lists, one per engine output, none empty. ``streaming=False``:
        the caller wants only the whole result, so the steps may all arrive in one list when the
        request ends (vLLM then sends one output per request, not per step)."""

    def assemble(self, plan: Plan, capture: Any) -> dict[Address, torch.Tensor]:
        """A finished request's captures, ``[1, pos, ...]`` per address read."""

    # ---- harvest ------------------------------------------------------------------
    def sinks(self, plan: Plan) -> bool:
        """Whether ``harvest_into`` serves this read-only plan: the engine's workers write each
        request's rows, as they are, into a file the caller maps (else harvest gathers them)."""

    def harvest_into(self, windows: list[list[int]], plan: Plan, max_tokens: int, in_flight: int, path: str,
                     offsets: Callable[[int], dict[str, int]], positions: int
                     ) -> Iterator[tuple[int, list[int], dict[Address, torch.Tensor]]]:
        """Only where ``sinks(plan)``: every window a greedy request of ``max_tokens`` tokens whose
        rows the workers write into ``path`` (window ``i``'s at ``offsets(i)``); yields ``(i,
        generated ids, rows the workers could not write whole)`` as windows finish."""

    # ---- where the weights are ----------------------------------------------------
    def decode(self, resid: torch.Tensor) -> torch.Tensor: ...

    def head_contributions(self, layer: int, z: torch.Tensor) -> torch.Tensor: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def module(self, path: str) -> torch.nn.Module: ...

    # ---- lifetime -----------------------------------------------------------------
    def warmup(self) -> None: ...

    def close(self) -> None: ...
