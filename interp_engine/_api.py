"""The public functions: capture, steering, generation, lens and MoE helpers.

Each one validates its input against the model graph (before any forward): tensor arguments
by their jaxtyping annotations bound to the model's sizes (``_shapes.entry``), everything else
by the pure transforms that build the Plan. Then the Plan goes to the model's backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import numbers
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Sequence, Union

import torch
from jaxtyping import Float, Int

from ._address import Address, AddressLike, expand_points
from ._cache import Cache, check_shapes
from ._capabilities import CapabilityUnsupported
from ._memo import memo_get
from ._model import Model
from ._plan import Plan, SteerSpec, capture_plan, check_batch, steer_plan
from ._sampling import SamplingConfig, sampling_from_params
from ._shapes import entry
from ._steered import SteeredModel
from ._tokens import TokenBatch, flat_ids

__all__ = [
    "Completion", "GenStep", "active_steering", "capture_generation", "decode_residuals",
    "expert_assignment", "generate_stream", "head_contributions", "run", "run_with_cache", "steer",
]

# What users pass as tokens: ids as an int tensor ([pos] or [batch, pos]), a TokenBatch, or
# lists of ids (checked element by element in as_batch, not sampled by beartype).
Tokens = Union[Int[torch.Tensor, "batch pos"], Int[torch.Tensor, "pos"], TokenBatch, list, tuple]
Residual = Float[torch.Tensor, "*lead d_model"]

# ---- steering context ---------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[tuple[Model, SteerSpec], ...]] = contextvars.ContextVar(
    "interp_engine_steering", default=()
)


@contextlib.contextmanager
def steer(model: Model, spec: SteerSpec) -> Iterator[SteerSpec]:
    """Apply ``spec`` to everything run on ``model`` inside the block, in this thread or task
    (a context variable: asyncio tasks created inside the block inherit it; a thread started
    inside the block does not — run its work with ``contextvars.copy_context().run(fn)``, or
    pass ``steer=spec`` per request). Nested blocks compose (outer ops first). The model itself
    is never modified: hooks exist only during each forward, so leaving the block (or an
    exception in it) leaves the model exactly as it was."""
    if not isinstance(spec, SteerSpec):
        raise TypeError(f"steer takes a SteerSpec, got {type(spec).__name__}: build one with "
                        "SteerSpec.add / .ablate / .set")
    if not isinstance(model, Model):
        raise TypeError(f"steer takes a loaded Model first, got {type(model).__name__}")
    steer_plan(model.graph, spec, model.dtype)  # raise now, before any forward
    _refuse(model, Plan(writes=spec.ops))
    token = _ACTIVE.set(_ACTIVE.get() + ((model, spec),))
    try:
        yield spec
    finally:
        _ACTIVE.reset(token)


def active_steering(model: Model) -> SteerSpec:
    """The steering in force for ``model`` in this context (composed in nesting order): a
    steered view's own spec first, then the ``steer`` blocks entered on it or on the model it
    views."""
    spec, base = (model.view_spec, model.base) if isinstance(model, SteeredModel) else (SteerSpec(), model)
    for owner, entry_spec in _ACTIVE.get():
        if owner is model or owner is base:
            spec = spec | entry_spec
    return spec


def _refuse(model: Model, plan: Plan, batch=None, gradients: bool = False) -> None:
    """Raise the backend's CapabilityUnsupported for this plan, before any forward."""
    check_batch(plan, None if batch is None else len(batch))
    refusal = model.backend.refusal(plan, batch, gradients=gradients)
    if refusal is not None:
        raise refusal


def _plan(model: Model, points: Sequence[AddressLike] | AddressLike | None,
          extra: SteerSpec | None = None) -> Plan:
    plan = capture_plan(model.graph, expand_points(model.graph, points)) if points is not None else Plan()
    spec = active_steering(model)
    if extra is None and not spec.ops:
        return plan
    if extra is not None:
        if not isinstance(extra, SteerSpec):
            raise TypeError(f"steer= takes a SteerSpec, got {type(extra).__name__}")
        spec = spec | extra
    return plan | steer_plan(model.graph, spec, model.dtype)


# ---- capture ------------------------------------------------------------------------

@entry
def run_with_cache(model: Model, tokens: Tokens, points: Sequence[AddressLike] | AddressLike,
                   detach: bool = True, *, return_logits: bool | str = False, steer: SteerSpec | None = None,
                   stop_at_layer: int | None = None):
    """Run one forward and capture ``points``; returns a Cache with ``[batch, pos, ...]`` per
    point (only the requested points are kept). With ``return_logits=True`` (eager) returns
    ``(logits, cache)``, logits ``[batch, pos, d_vocab]``; with ``return_logits="last"`` (every
    backend) ``(logits, cache)`` with each row's final position only, ``[batch, d_vocab]``.
    ``detach=False`` keeps the autograd graph (eager; see grad_support): gradients reach every
    captured tensor, also on a model loaded with frozen parameters. ``steer=spec`` applies a
    SteerSpec to this forward only (after any active ``steer`` blocks); captures see the steered
    values. ``stop_at_layer=n`` (TransformerLens's argument) runs only layers ``0..n-1`` (0: the
    embeddings alone): every point and write must be at a layer below ``n`` (or be
    ``resid_pre.n``, the residual it ends with), and there are no logits; eager ends the forward
    there, vLLM runs every layer (the captures are the same)."""
    if not isinstance(detach, bool):
        raise TypeError(f"detach must be a bool, got {detach!r}")
    if not isinstance(return_logits, bool) and return_logits != "last":
        raise TypeError(f"return_logits must be a bool or 'last' (the final position), got {return_logits!r}")
    batch = model.batch(tokens)
    plan = _plan(model, points, steer)
    if not detach and not model.grad_support.through_forward:
        raise CapabilityUnsupported("gradients", model.backend_name)
    _refuse(model, plan, batch, gradients=not detach)
    if return_logits is True and model.backend_name != "eager":
        raise CapabilityUnsupported("logits_in_stream", model.backend_name, detail="logits at every position")
    _check_context(model, batch.shape[1])
    if stop_at_layer is not None:
        stop_at_layer = _check_stop(model, plan, stop_at_layer, return_logits)
    values, logits = model.backend.run_with_cache(plan, batch, detach, want_logits=return_logits,
                                                  stop_at_layer=stop_at_layer)
    cache = Cache({a: values[a] for a in plan.reads}, batch.attention_mask, model.graph)
    return (logits, cache) if return_logits else cache


def _check_stop(model: Model, plan: Plan, layer: object, return_logits: object) -> int:
    layer = _int_in("stop_at_layer", layer, 0, model.n_layers, " (the layer the forward stops before)")
    if return_logits:
        raise ValueError(f"stop_at_layer={layer} ends the forward before the unembedding, so there are no "
                         "logits: drop return_logits, or decode a residual with model.decode_residuals")

    def beyond(a: Address) -> bool:  # resid_pre.n is the residual the stopped forward ends with
        return a.layer > layer or (a.layer == layer and a.name != "resid_pre")
    late = [a for a in plan.reads if beyond(a)] + [op.address for op in plan.writes if beyond(op.address)]
    if late:
        raise ValueError(f"stop_at_layer={layer} runs layers 0..{layer - 1} only (and reads resid_pre.{layer}), "
                         "but the plan touches "
                         f"{', '.join(map(str, late))}: pass stop_at_layer={max(a.layer for a in late) + 1} "
                         "or more, or leave those points out")
    return layer


def run(model: Model, tokens: Tokens, plan: Plan, detach: bool = True, *, return_logits: bool | str = False,
        stop_at_layer: int | None = None):
    """Run a composed Plan in one forward: its writes applied (after any active ``steer``
    blocks), its reads captured (seeing the writes). Returns the Cache (``(logits, cache)``
    with ``return_logits=True``, eager, or ``"last"``, every backend). Plans compose with ``|``; a user transform is a
    function from Plan to Plan. The same as ``run_with_cache(model, tokens, plan.reads,
    steer=plan.steering)``."""
    if not isinstance(plan, Plan):
        raise TypeError(f"run takes a Plan, got {type(plan).__name__}: build one with "
                        "Plan(reads=[...], writes=SteerSpec...) or capture_plan(...) | steer_plan(...)")
    return run_with_cache(model, tokens, list(plan.reads), detach, return_logits=return_logits,
                          steer=plan.steering, stop_at_layer=stop_at_layer)


def _check_context(model: Model, length: int) -> None:
    limit = model.max_model_len
    if length > limit:
        raise ValueError(f"the input has {length} positions, more than this model's context "
                         f"(max_model_len={limit}): shorten it, or load the model with a larger max_model_len")


# ---- generation ---------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class GenStep:
    """One generated token. ``token_str`` is the text this token completes (deltas join to the
    decoded text, multi-byte characters included); ``logits`` is None on vLLM."""

    token_id: int
    token_str: str
    logprobs: list[dict] | None
    logits: torch.Tensor | None
    logprob: float | None = None  # of the sampled token, when n_logprobs was asked


@dataclass(frozen=True, eq=False)
class Completion:
    """A finished generation. ``finish_reason`` is "stop" (EOS or a stop token) or "length"
    (max_tokens reached, or the end of the model's context: max_model_len)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[list[dict], ...] | None = None


class _TextDeltas:
    """Incremental detokenisation, one decode step per token: the tokenizer's own streaming
    decoder where it has one (fast tokenizers), else a sliding window over the last few ids
    (the prefix/read-offset scheme vLLM uses). An incomplete multi-byte character is held back;
    the last token flushes, so the deltas join to ``to_string`` of every generated id."""

    def __init__(self, model: Model) -> None:
        self.tok = model.tok
        self.stream = model.tok.decode_stream()
        self.ids: list[int] = []
        self.n_emitted = 0  # characters emitted so far
        self.prefix = 0  # sliding window (no streaming decoder): text before it is final
        self.read = 0  # tokens whose text has been emitted

    def push(self, token_id: int, last: bool) -> str:
        self.ids.append(token_id)
        if last:
            full = self.tok.to_string(self.ids)
            delta = full[self.n_emitted:]
        elif self.stream is not None:
            delta = self.stream(token_id) or ""
        else:
            seen = self.tok.to_string(self.ids[self.prefix:self.read])
            text = self.tok.to_string(self.ids[self.prefix:])
            if text.endswith("\ufffd") or len(text) <= len(seen):
                return ""
            self.prefix, self.read = self.read, len(self.ids)
            delta = text[len(seen):]
        self.n_emitted += len(delta)
        return delta


def _prompt_ids(model: Model, tokens: Tokens) -> list[int]:
    ids = flat_ids(tokens, model.graph.d_vocab)
    if ids is not None:
        return ids
    batch = model.batch(tokens)
    if len(batch) != 1:
        raise ValueError(f"generation takes one prompt, got a batch of {len(batch)}: call it per prompt")
    return batch.row(0)


def _sampling(model: Model, prompt_len: int, **kwargs) -> SamplingConfig:
    """A SamplingConfig for a prompt of ``prompt_len``: ``max_tokens`` past the end of the
    context is cut to what fits (finish_reason "length" there, as vLLM does); ``None`` means
    up to the end of the context."""
    limit = model.max_model_len
    if prompt_len >= limit:
        raise ValueError(f"the prompt has {prompt_len} tokens and this model's context holds {limit} "
                         f"(max_model_len): nothing fits after it; shorten the prompt")
    room = limit - prompt_len
    max_tokens = kwargs.get("max_tokens", 16)
    if max_tokens is None:
        kwargs["max_tokens"] = room
    elif isinstance(max_tokens, numbers.Integral) and not isinstance(max_tokens, bool) and max_tokens > room:
        kwargs["max_tokens"] = room
    if "stop_token_ids" in kwargs:
        kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"])
    try:  # each value with its type: True == 1 == 1.0, but SamplingConfig takes only some of them
        key = (model.d_vocab, tuple(sorted((k, type(v), v) for k, v in kwargs.items())))
        hash(key)
    except TypeError:  # an unhashable value: SamplingConfig says what is wrong with it
        return SamplingConfig(d_vocab=model.d_vocab, **kwargs)
    # a config is immutable: requests asking the same share one, checked once
    return memo_get(_CONFIGS, key, lambda: SamplingConfig(d_vocab=model.d_vocab, **kwargs))


_CONFIGS: dict[tuple, SamplingConfig] = {}  # _sampling's checked configs, by what was asked


def _steps(model: Model, prompt: list[int] | None, config: SamplingConfig, plan: Plan,
           capture: Any = None, embeds: torch.Tensor | None = None) -> Iterator[tuple[GenStep, str | None]]:
    """The request's generated tokens, one at a time. Its callers have refused ``plan`` already,
    when they were called (a check per request, not two: on vllm-static it looks up every
    captured address in the declared set)."""
    deltas = _TextDeltas(model)
    with contextlib.closing(model.backend.generate(prompt, config, plan, capture, embeds=embeds)) as raws:
        for raw in raws:
            text = deltas.push(raw.token_id, raw.finish_reason is not None)
            yield GenStep(raw.token_id, text, raw.logprobs, raw.logits, raw.logprob), raw.finish_reason


@entry
def generate_stream(model: Model, tokens: Tokens, max_tokens: int = 16, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, stop_at_eos: bool = True,
                    seed: int | None = None, n_logprobs: int | None = None) -> Iterator[GenStep]:
    """Yield a GenStep per generated token (KV cache on; ``temperature=0.0`` is greedy;
    ``seed`` makes sampling reproducible). Active ``steer`` blocks apply. Generation stops at
    EOS, after ``max_tokens``, or at the end of the model's context (max_model_len)."""
    prompt = _prompt_ids(model, tokens)
    config = _sampling(model, len(prompt), max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, min_p=min_p, stop_at_eos=stop_at_eos, seed=seed, n_logprobs=n_logprobs)
    plan = _plan(model, None)
    _refuse(model, plan)
    return _first(_steps(model, prompt, config, plan))


def _first(items):
    """The GenSteps of (step, finish) pairs; closing it closes the request at once."""
    with contextlib.closing(items):
        for step, _ in items:
            yield step


def _completion(steps: list[GenStep], finish: str, n_logprobs: int | None) -> Completion:
    return Completion(text="".join(s.token_str for s in steps), token_ids=tuple(s.token_id for s in steps),
                      finish_reason=finish,
                      logprobs=None if n_logprobs is None else tuple(s.logprobs for s in steps))


@entry
def capture_generation(model: Model, tokens: Tokens, points: Sequence[AddressLike] | AddressLike,
                       max_tokens: int = 16, temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0, min_p: float = 0.0, stop_at_eos: bool = True, seed: int | None = None,
                       n_logprobs: int | None = None) -> tuple[Completion, Cache]:
    """Generate and capture ``points`` at prompt and generated positions in one request.
    The cache has ``len(prompt) + len(generated) - 1`` positions: the final token is never fed."""
    prompt = _prompt_ids(model, tokens)
    config = _sampling(model, len(prompt), max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, min_p=min_p, stop_at_eos=stop_at_eos, seed=seed, n_logprobs=n_logprobs)
    plan = _plan(model, points)
    _refuse(model, plan)
    capture = model.backend.new_capture()
    steps, finish = [], "length"
    for step, reason in _steps(model, prompt, config, plan, capture):
        steps.append(step)
        finish = reason or finish
    values = model.backend.assemble(plan, capture)
    total = len(prompt) + len(steps) - 1
    mask = torch.ones((1, total), dtype=torch.long)
    return _completion(steps, finish, n_logprobs), Cache({a: values[a] for a in plan.reads}, mask, model.graph)


# ---- async methods (what a server holds) -------------------------------------------

async def _agen_steps(model: Model, prompt: list[int] | None, config: SamplingConfig, plan: Plan,
                      embeds: torch.Tensor | None = None, capture: Any = None, streaming: bool = True
                      ) -> AsyncIterator[list[tuple[GenStep, str | None]]]:
    """The request's generated tokens as the backend hands them over: a list per engine output
    (one token per step when streaming; every token at once at the end when not). Its callers
    have refused ``plan`` already (``_request``), when they were called, before any coroutine
    runs."""
    # streaming: each token's text as it comes; else (a whole result, whose texts are only
    # ever joined) the last token carries the text of them all, decoded once
    deltas = _TextDeltas(model) if streaming else None
    ids: list[int] = []
    # aclosing: a consumer that stops early (aclose, an exception, a cancel) closes the
    # backend's generator at once, so the request is aborted now, not when it is collected
    async with contextlib.aclosing(model.backend.agenerate(prompt, config, plan, capture, embeds=embeds,
                                                                    streaming=streaming)) as chunks:
        async for raws in chunks:
            if deltas is not None:
                yield [(GenStep(raw.token_id, deltas.push(raw.token_id, raw.finish_reason is not None),
                                raw.logprobs, raw.logits, raw.logprob), raw.finish_reason) for raw in raws]
                continue
            ids.extend(raw.token_id for raw in raws)
            yield [(GenStep(raw.token_id, "" if raw.finish_reason is None else model.tok.to_string(ids),
                            raw.logprobs, raw.logits, raw.logprob), raw.finish_reason) for raw in raws]


def _request(model: Model, token_ids: Tokens, steer_spec: SteerSpec | None,
             points: Sequence[AddressLike] | AddressLike | None = None, **sampling):
    """One request's prompt ids, sampling and plan (``points`` captured, ``steer_spec`` and the
    steering in force applied), the plan refused here if the backend cannot serve it."""
    prompt = _prompt_ids(model, token_ids)
    config = _sampling(model, len(prompt), **sampling)
    plan = _plan(model, points, steer_spec)
    _refuse(model, plan)
    return prompt, config, plan


@entry(model="self", name="model.generate_text")
def _generate_text(self: Model, token_ids: Tokens, max_tokens: int = 16,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                   stop_at_eos: bool = True, seed: int | None = None,
                   steer: SteerSpec | None = None):
    """The generated text (a coroutine). ``steer=`` applies a SteerSpec to this request only."""
    prompt, config, plan = _request(self, token_ids, steer, max_tokens=max_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                    stop_at_eos=stop_at_eos, seed=seed)

    async def run() -> str:
        async with contextlib.aclosing(_agen_steps(self, prompt, config, plan, streaming=False)) as chunks:
            return "".join([step.token_str async for chunk in chunks for step, _ in chunk])
    return run()


@entry(model="self", name="model.generate_stream")
def _generate_stream(self: Model, token_ids: Tokens, max_tokens: int = 16,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                     stop_at_eos: bool = True, seed: int | None = None,
                     steer: SteerSpec | None = None) -> AsyncIterator[str]:
    """Text deltas (an async iterator); they concatenate to exactly what ``generate_text`` returns."""
    prompt, config, plan = _request(self, token_ids, steer, max_tokens=max_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                    stop_at_eos=stop_at_eos, seed=seed)

    async def run() -> AsyncIterator[str]:
        async with contextlib.aclosing(_agen_steps(self, prompt, config, plan)) as chunks:
            async for chunk in chunks:
                for step, _ in chunk:
                    if step.token_str:
                        yield step.token_str
    return run()


async def _collect(model: Model, prompt, config, plan, embeds=None, capture=None):
    steps, finish = [], "length"
    async with contextlib.aclosing(_agen_steps(model, prompt, config, plan, embeds=embeds, capture=capture,
                                               streaming=False)) as chunks:
        async for chunk in chunks:
            for step, reason in chunk:
                steps.append(step)
                finish = reason or finish
    return steps, finish


@entry(model="self", name="model.generate_full")
def _generate_full(self: Model, token_ids: Tokens, max_tokens: int = 16,
                   temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                   stop_at_eos: bool = True, seed: int | None = None,
                   logprobs: int | None = None, steer: SteerSpec | None = None):
    """vLLM's own RequestOutput (where vLLM is installed), with ``.text``, ``.token_ids``,
    ``.logprobs`` and ``.finish_reason`` of its single completion also on the result (a coroutine)."""
    prompt, config, plan = _request(self, token_ids, steer, max_tokens=max_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                    stop_at_eos=stop_at_eos, seed=seed, n_logprobs=logprobs)

    async def run():
        steps, finish = await _collect(self, prompt, config, plan)
        return self.backend.request_output(prompt, steps, finish, logprobs)
    return run()


@entry(model="self", name="model.generate_from_embeds")
def _generate_from_embeds(self: Model, embeds: Float[torch.Tensor, "pos d_model"],
                          sampling_params: Any = None, steer: SteerSpec | None = None):
    """Generate from ``[num_tokens, d_model]`` prompt embeddings in the model dtype; returns a
    RequestOutput (a coroutine). ``sampling_params`` is a ``vllm.SamplingParams`` (or a dict of
    SamplingConfig fields, or None for defaults); a field this library does not honour, set
    away from its default, raises ValueError naming it (see ``SAMPLING_FIELDS``)."""
    if not self.backend.prompt_embeds:
        raise ValueError("prompt embeds are off for this model: load it with "
                         "load_model(..., enable_prompt_embeds=True)")
    if embeds.shape[0] == 0:
        raise ValueError("embeds are empty: pass at least one position")
    if embeds.dtype != self.dtype:
        raise TypeError(f"embeds have dtype {embeds.dtype}, the model runs in {self.dtype}: pass embeds.to({self.dtype})")
    config = _sampling(self, int(embeds.shape[0]), **sampling_from_params(sampling_params))
    plan = _plan(self, None, steer)
    _refuse(self, plan)
    embeds = embeds.detach().clone()  # the request holds its own copy

    async def run():
        steps, finish = await _collect(self, None, config, plan, embeds=embeds)
        return self.backend.request_output([], steps, finish, config.n_logprobs)
    return run()


@entry(model="self", name="model.capture_generation")
def _capture_generation(self: Model, token_ids: Tokens, points: Sequence[AddressLike] | AddressLike,
                        max_tokens: int = 16, temperature: float = 1.0, top_k: int = 0,
                        top_p: float = 1.0, min_p: float = 0.0, stop_at_eos: bool = True, seed: int | None = None,
                        n_logprobs: int | None = None, steer: SteerSpec | None = None):
    """The async capture method (a coroutine): generate and capture ``points`` in one request,
    alongside other requests. Returns the Completion and a plain dict keyed by Address (a string
    key is a KeyError), rows ``[1, len(prompt) + len(generated) - 1, ...]``."""
    prompt, config, plan = _request(self, token_ids, steer, points, max_tokens=max_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                    stop_at_eos=stop_at_eos, seed=seed, n_logprobs=n_logprobs)

    async def run() -> tuple[Completion, dict[Address, torch.Tensor]]:
        capture = self.backend.new_capture()
        steps, finish = await _collect(self, prompt, config, plan, capture=capture)
        values = self.backend.assemble(plan, capture)
        check_shapes(values, self.graph, 1, len(prompt) + len(steps) - 1)
        return _completion(steps, finish, n_logprobs), {a: values[a] for a in plan.reads}
    return run()


Model.capture_generation = _capture_generation  # type: ignore[attr-defined]
Model.generate_text = _generate_text  # type: ignore[attr-defined]
Model.generate_stream = _generate_stream  # type: ignore[attr-defined]
Model.generate_full = _generate_full  # type: ignore[attr-defined]
Model.generate_from_embeds = _generate_from_embeds  # type: ignore[attr-defined]


# ---- logit lens ---------------------------------------------------------------------

def _lens_check(model: Model) -> None:
    if not model.residual_basis.lens_valid:
        raise CapabilityUnsupported("logit_lens", model.backend_name,
                                    detail=f"{model.graph.arch}: {model.residual_basis.describe()}")


@entry
def decode_residuals(model: Model, resid: Residual) -> Float[torch.Tensor, "*lead d_vocab"]:
    """Eager only: final norm then unembedding (with the architecture's soft-cap) on a residual;
    returns raw logits with the residual's leading shape."""
    if model.backend_name != "eager":
        raise CapabilityUnsupported("free_decode_residuals", model.backend_name)
    _lens_check(model)
    return model.backend.decode(resid)


@entry(model="self", name="model.decode_residuals")
def _decode_method(self: Model, cache: Union[Cache, Residual], top_k: int | None = None,
                   points: Sequence[AddressLike] | None = None, log_probs: bool = True):
    """The portable lens. With a Cache: every ``resid_post`` in it (or ``points``), stacked to
    ``[layer, batch, pos, d_vocab]`` log-probs (logits with ``log_probs=False``); with a tensor
    ``[..., d_model]``: ``[..., d_vocab]``. ``top_k=k`` returns ``(token_ids, logprobs)``, each
    ``[layer, batch, pos, k]``. Runs where the weights are, on every backend."""
    _lens_check(self)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)
                              or not 1 <= top_k <= self.d_vocab):
        raise ValueError(f"top_k must be an int in [1, {self.d_vocab}] (or None for every token), got {top_k!r}")
    if not isinstance(log_probs, bool):
        raise TypeError(f"log_probs must be a bool, got {log_probs!r}")
    if isinstance(cache, Cache):
        if points is None:
            addresses = sorted((a for a in cache if a.name == "resid_post"), key=lambda a: a.layer)
            if not addresses:
                raise ValueError("the cache holds no resid_post: capture resid_post at the layers to decode, "
                                 "or pass points=[...]")
        else:
            addresses = [self.graph.check_address(p) for p in points]
            wide = [str(a) for a in addresses if self.graph.point(a.name).dims[-1] != "d_model"]
            if wide:
                raise ValueError(f"points {wide} are not d_model-wide residuals: the lens decodes "
                                 "resid_pre / resid_mid / resid_post / attn_out / mlp_out")
        resid = torch.stack([cache[a] for a in addresses])
    elif isinstance(cache, torch.Tensor):
        resid = cache
    else:
        raise TypeError(f"decode_residuals takes a Cache or a tensor [..., d_model], got {type(cache).__name__}")
    logits = self.backend.decode(resid)
    out = torch.log_softmax(logits.float(), dim=-1) if log_probs else logits
    if top_k is None:
        return out
    values, ids = torch.topk(out, int(top_k), dim=-1)
    return ids, values


Model.decode_residuals = _decode_method  # type: ignore[attr-defined]


# ---- helpers on a cache -------------------------------------------------------------

@entry
def head_contributions(model: Model, cache: Cache, layer: int
                       ) -> Float[torch.Tensor, "batch pos n_heads d_model"]:
    """Per-head writes of attention at ``layer``: ``[batch, pos, n_heads, d_model]``. Summed
    over heads (plus the o_proj bias, if any) they give the output projection, which is
    ``attn_out`` on every architecture without a post-attention norm (on Gemma 2 it is the
    input of that norm). Needs ``z.{layer}`` in the cache; runs where the weights are."""
    if not isinstance(cache, Cache):
        raise TypeError(f"head_contributions takes a Cache, got {type(cache).__name__}")
    address = model.graph.check_address(Address("z", layer))
    if address not in cache:
        raise KeyError(f"head_contributions needs {address} in the cache: capture it with "
                       f"run_with_cache(model, tokens, ['{address}'])")
    z = cache[address]
    out = model.backend.head_contributions(layer, z)
    expected = (*z.shape[:3], model.d_model)
    if tuple(out.shape) != expected:  # a backend bug, never the caller's
        raise RuntimeError(f"head_contributions: the {model.backend_name} backend returned {list(out.shape)}, "
                           f"expected {list(expected)}")
    return out


def _int_in(name: str, value: object, low: int, high: int, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}]{hint}, got {value!r}")
    return int(value)


def expert_assignment(cache: Cache, layer: int, n_experts: int, *, top_k: int | None = None,
                      normalize: bool = True) -> Float[torch.Tensor, "batch pos n_experts"]:
    """Dense routing ``[batch, pos, n_experts]``: the weight each expert gets at each position
    (zero for unselected experts). Uses ``expert_indices``/``expert_weights`` when captured;
    otherwise the top-k of ``softmax(router_logits)`` (pass ``top_k``; ``normalize`` renormalises
    the selected weights, as Qwen3-MoE's norm_topk_prob does). ``n_experts`` must be the
    router's width (the model's ``n_experts``)."""
    if not isinstance(cache, Cache):
        raise TypeError(f"expert_assignment takes a Cache, got {type(cache).__name__}")
    if isinstance(n_experts, bool) or not isinstance(n_experts, numbers.Integral) or n_experts < 1:
        raise ValueError(f"n_experts must be a positive int, got {n_experts!r}")
    n_experts = int(n_experts)
    graph = cache.graph
    if graph is not None and graph.n_experts and n_experts != graph.n_experts:
        raise ValueError(f"n_experts={n_experts}, but this {graph.arch} model's router has "
                         f"{graph.n_experts} experts: pass n_experts={graph.n_experts}")
    idx_a, w_a, log_a = (Address(n, layer) for n in ("expert_indices", "expert_weights", "router_logits"))
    if log_a in cache and cache[log_a].shape[-1] != n_experts:
        raise ValueError(f"n_experts={n_experts}, but {log_a} has {cache[log_a].shape[-1]} experts: "
                         f"pass n_experts={cache[log_a].shape[-1]}")
    if idx_a in cache and w_a in cache:
        indices, weights = cache[idx_a], cache[w_a]
        if indices.numel() and int(indices.max()) >= n_experts:
            raise ValueError(f"{idx_a} selects expert {int(indices.max())}, past n_experts={n_experts}: "
                             "pass the router's width")
    elif log_a in cache:
        if top_k is None:
            raise ValueError(f"the cache has {log_a} but not {idx_a}/{w_a}: pass top_k= to select from "
                             "the router's softmax, or capture expert_indices and expert_weights (eager)")
        top_k = _int_in("top_k", top_k, 1, n_experts, " (experts selected per token)")
        logits = cache[log_a]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, indices = torch.topk(probs, top_k, dim=-1)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
    else:
        raise KeyError(f"expert_assignment needs {idx_a} and {w_a} (or {log_a}) in the cache")
    dense = torch.zeros(indices.shape[:-1] + (n_experts,), dtype=weights.dtype, device=weights.device)
    return dense.scatter_add(-1, indices.long(), weights)
