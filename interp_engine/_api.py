"""The public functions: capture, steering, generation, lens and MoE helpers.

Each one validates its input against the model graph (before any forward), builds a Plan with
the pure transforms, and hands it to the model's backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Sequence

import torch
from beartype import beartype
from jaxtyping import Float, Int, jaxtyped

from ._address import Address, AddressLike
from ._cache import Cache
from ._capabilities import CapabilityUnsupported
from ._model import Model
from ._plan import Plan, SteerSpec, capture_plan, steer_plan
from ._sampling import SamplingConfig
from ._tokens import TokensLike

__all__ = [
    "Completion", "GenStep", "active_steering", "capture_generation", "decode_residuals",
    "expert_assignment", "generate_stream", "head_contributions", "run_with_cache", "steer",
]

# ---- steering context ---------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[tuple[int, SteerSpec], ...]] = contextvars.ContextVar(
    "interp_engine_steering", default=()
)


@contextlib.contextmanager
def steer(model: Model, spec: SteerSpec) -> Iterator[SteerSpec]:
    """Apply ``spec`` to everything run on ``model`` inside the block. Nested blocks compose
    (outer ops first). The model itself is never modified: hooks exist only during each
    forward, so leaving the block (or an exception in it) leaves the model exactly as it was."""
    if not isinstance(spec, SteerSpec):
        raise TypeError(f"steer takes a SteerSpec, got {type(spec).__name__}: build one with "
                        "SteerSpec.add / .ablate / .set")
    steer_plan(model.graph, spec, model.dtype)  # raise now, before any forward
    _refuse(model, Plan(writes=spec.ops))
    token = _ACTIVE.set(_ACTIVE.get() + ((id(model), spec),))
    try:
        yield spec
    finally:
        _ACTIVE.reset(token)


def active_steering(model: Model) -> SteerSpec:
    """The steering in force for ``model`` in this context (composed in nesting order)."""
    spec = SteerSpec()
    for owner, entry in _ACTIVE.get():
        if owner == id(model):
            spec = spec | entry
    return spec


def _refuse(model: Model, plan: Plan, batch=None, gradients: bool = False) -> None:
    """Raise the backend's CapabilityUnsupported for this plan, before any forward."""
    refusal = model.backend.refusal(plan, batch, gradients=gradients)
    if refusal is not None:
        raise refusal


def _plan(model: Model, points: Sequence[AddressLike] | AddressLike | None,
          extra: SteerSpec | None = None) -> Plan:
    plan = capture_plan(model.graph, points) if points is not None else Plan()
    spec = active_steering(model)
    if extra is None and not spec.ops:
        return plan
    if extra is not None:
        if not isinstance(extra, SteerSpec):
            raise TypeError(f"steer= takes a SteerSpec, got {type(extra).__name__}")
        spec = spec | extra
    return plan | steer_plan(model.graph, spec, model.dtype)


# ---- capture ------------------------------------------------------------------------

def run_with_cache(model: Model, tokens: TokensLike, points: Sequence[AddressLike] | AddressLike,
                   detach: bool = True, *, return_logits: bool = False):
    """Run one forward and capture ``points``; returns a Cache with ``[batch, pos, ...]`` per
    point (only the requested points are kept). With ``return_logits=True`` (eager) returns
    ``(logits, cache)``. ``detach=False`` keeps the autograd graph (eager; see grad_support)."""
    if not isinstance(detach, bool):
        raise TypeError(f"detach must be a bool, got {detach!r}")
    batch = model.batch(tokens)
    plan = _plan(model, points)
    if not detach and not model.grad_support.through_forward:
        raise CapabilityUnsupported("gradients", model.backend_name)
    _refuse(model, plan, batch, gradients=not detach)
    if return_logits and model.backend_name != "eager":
        raise CapabilityUnsupported("logits_in_stream", model.backend_name)
    values, logits = model.backend.run_with_cache(plan, batch, detach, want_logits=return_logits)
    cache = Cache({a: values[a] for a in plan.reads}, batch.attention_mask)
    return (logits, cache) if return_logits else cache


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
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[list[dict], ...] | None = None


class _TextDeltas:
    """Incremental detokenisation over a sliding window (the prefix/read-offset scheme vLLM
    uses): each step decodes a few recent tokens, not the whole completion, and holds back an
    incomplete multi-byte character. The deltas join to ``to_string`` of all generated ids."""

    def __init__(self, model: Model) -> None:
        self.decode = model.tok.to_string
        self.ids: list[int] = []
        self.prefix = 0  # window start: text before it is final
        self.read = 0  # tokens whose text has been emitted

    def push(self, token_id: int, last: bool) -> str:
        self.ids.append(token_id)
        seen = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if (not last and text.endswith("\ufffd")) or len(text) <= len(seen) and not last:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(seen):]


def _prompt_ids(model: Model, tokens: TokensLike) -> list[int]:
    batch = model.batch(tokens)
    if len(batch) != 1:
        raise ValueError(f"generation takes one prompt, got a batch of {len(batch)}: call it per prompt")
    return batch.row(0)


def _sampling(model: Model, **kwargs) -> SamplingConfig:
    return SamplingConfig(d_vocab=model.d_vocab, **kwargs)


def _steps(model: Model, prompt: list[int] | None, config: SamplingConfig, plan: Plan,
           capture: Any = None, embeds: torch.Tensor | None = None) -> Iterator[tuple[GenStep, str | None]]:
    _refuse(model, plan)
    deltas = _TextDeltas(model)
    for raw in model.backend.generate(prompt, config, plan, capture, embeds=embeds):
        text = deltas.push(raw.token_id, raw.finish_reason is not None)
        yield GenStep(raw.token_id, text, raw.logprobs, raw.logits, raw.logprob), raw.finish_reason


def generate_stream(model: Model, tokens: TokensLike, max_tokens: int = 16, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, stop_at_eos: bool = True,
                    seed: int | None = None, n_logprobs: int | None = None) -> Iterator[GenStep]:
    """Yield a GenStep per generated token (KV cache on; ``temperature=0.0`` is greedy;
    ``seed`` makes sampling reproducible). Active ``steer`` blocks apply."""
    config = _sampling(model, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, stop_at_eos=stop_at_eos, seed=seed, n_logprobs=n_logprobs)
    prompt = _prompt_ids(model, tokens)
    plan = _plan(model, None)
    return (step for step, _ in _steps(model, prompt, config, plan))


def capture_generation(model: Model, tokens: TokensLike, points: Sequence[AddressLike] | AddressLike,
                       max_tokens: int = 16, temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0, stop_at_eos: bool = True, seed: int | None = None,
                       n_logprobs: int | None = None) -> tuple[Completion, Cache]:
    """Generate and capture ``points`` at prompt and generated positions in one request.
    The cache has ``len(prompt) + len(generated) - 1`` positions: the final token is never fed."""
    config = _sampling(model, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, stop_at_eos=stop_at_eos, seed=seed, n_logprobs=n_logprobs)
    prompt = _prompt_ids(model, tokens)
    plan = _plan(model, points)
    capture = model.backend.new_capture()
    steps, finish = [], "length"
    for step, reason in _steps(model, prompt, config, plan, capture):
        steps.append(step)
        finish = reason or finish
    values = model.backend.assemble(plan, capture)
    completion = Completion(
        text="".join(s.token_str for s in steps),
        token_ids=tuple(s.token_id for s in steps),
        finish_reason=finish,
        logprobs=None if n_logprobs is None else tuple(s.logprobs for s in steps),
    )
    total = len(prompt) + len(steps) - 1
    mask = torch.ones((1, total), dtype=torch.long)
    return completion, Cache({a: values[a] for a in plan.reads}, mask)


# ---- async methods (what a server holds) -------------------------------------------

async def _agen_steps(model: Model, prompt: list[int] | None, config: SamplingConfig, plan: Plan,
                      embeds: torch.Tensor | None = None, capture: Any = None
                      ) -> AsyncIterator[tuple[GenStep, str | None]]:
    if hasattr(model.backend, "agenerate"):
        _refuse(model, plan)
        deltas = _TextDeltas(model)
        async for raw in model.backend.agenerate(prompt, config, plan, embeds=embeds, captures=capture):
            text = deltas.push(raw.token_id, raw.finish_reason is not None)
            yield GenStep(raw.token_id, text, raw.logprobs, raw.logits, raw.logprob), raw.finish_reason
        return
    # Eager: one forward per step, yielding to the event loop between steps so concurrent
    # requests interleave; each forward holds its own hooks only while it runs.
    for item in _steps(model, prompt, config, plan, capture, embeds=embeds):
        yield item
        await asyncio.sleep(0)


def _request(model: Model, token_ids, steer_spec: SteerSpec | None, **sampling):
    config = _sampling(model, **sampling)
    prompt = _prompt_ids(model, token_ids)
    return prompt, config, _plan(model, None, steer_spec)


async def _generate_text(self: Model, token_ids: TokensLike, max_tokens: int = 16,
                         temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                         stop_at_eos: bool = True, seed: int | None = None,
                         steer: SteerSpec | None = None) -> str:
    """The generated text. ``steer=`` applies a SteerSpec to this request only."""
    prompt, config, plan = _request(self, token_ids, steer, max_tokens=max_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    stop_at_eos=stop_at_eos, seed=seed)
    parts = [step.token_str async for step, _ in _agen_steps(self, prompt, config, plan)]
    return "".join(parts)


async def _generate_stream(self: Model, token_ids: TokensLike, max_tokens: int = 16,
                           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                           stop_at_eos: bool = True, seed: int | None = None,
                           steer: SteerSpec | None = None) -> AsyncIterator[str]:
    """Text deltas; they concatenate to exactly what ``generate_text`` returns."""
    prompt, config, plan = _request(self, token_ids, steer, max_tokens=max_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    stop_at_eos=stop_at_eos, seed=seed)
    async for step, _ in _agen_steps(self, prompt, config, plan):
        if step.token_str:
            yield step.token_str


async def _generate_full(self: Model, token_ids: TokensLike, max_tokens: int = 16,
                         temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                         stop_at_eos: bool = True, seed: int | None = None,
                         logprobs: int | None = None, steer: SteerSpec | None = None):
    """vLLM's own RequestOutput (where vLLM is installed), with ``.text``, ``.token_ids``,
    ``.logprobs`` and ``.finish_reason`` of its single completion also on the result."""
    from bridge.outputs import full_output

    prompt, config, plan = _request(self, token_ids, steer, max_tokens=max_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    stop_at_eos=stop_at_eos, seed=seed, n_logprobs=logprobs)
    steps, finish = [], "length"
    async for step, reason in _agen_steps(self, prompt, config, plan):
        steps.append(step)
        finish = reason or finish
    return full_output(prompt, steps, finish, logprobs)


async def _generate_from_embeds(self: Model, embeds: torch.Tensor, sampling_params: Any = None,
                                steer: SteerSpec | None = None):
    """Generate from ``[num_tokens, d_model]`` prompt embeddings in the model dtype; returns a
    RequestOutput. ``sampling_params`` is a ``vllm.SamplingParams`` (or None for defaults)."""
    from bridge.outputs import full_output, sampling_from_vllm

    if not getattr(self.backend, "prompt_embeds", False):
        raise ValueError("prompt embeds are off for this model: load it with "
                         "load_model(..., enable_prompt_embeds=True)")
    if not isinstance(embeds, torch.Tensor):
        raise TypeError(f"embeds must be a torch.Tensor [num_tokens, {self.d_model}], got {type(embeds).__name__}")
    if embeds.dim() != 2:
        raise ValueError(f"embeds must be [num_tokens, d_model={self.d_model}] (rank 2), got shape "
                         f"{tuple(embeds.shape)}; drop the batch dimension and call once per prompt")
    if embeds.shape[1] != self.d_model:
        raise ValueError(f"embeds have width {embeds.shape[1]}, expected d_model={self.d_model}")
    if embeds.shape[0] == 0:
        raise ValueError("embeds are empty: pass at least one position")
    if embeds.dtype != self.dtype:
        raise TypeError(f"embeds have dtype {embeds.dtype}, the model runs in {self.dtype}: pass embeds.to({self.dtype})")
    kwargs = sampling_from_vllm(sampling_params)
    config = _sampling(self, **kwargs)
    plan = _plan(self, None, steer)
    steps, finish = [], "length"
    async for step, reason in _agen_steps(self, None, config, plan, embeds=embeds):
        steps.append(step)
        finish = reason or finish
    return full_output([], steps, finish, config.n_logprobs)


async def _capture_generation(self: Model, token_ids: TokensLike, points: Sequence[AddressLike] | AddressLike,
                              max_tokens: int = 16, temperature: float = 1.0, top_k: int = 0,
                              top_p: float = 1.0, stop_at_eos: bool = True, seed: int | None = None,
                              n_logprobs: int | None = None, steer: SteerSpec | None = None
                              ) -> tuple[Completion, dict[Address, torch.Tensor]]:
    """The async capture method: generate and capture ``points`` in one request, alongside
    other requests. Returns the Completion and a plain dict keyed by Address (a string key is
    a KeyError), rows ``[1, len(prompt) + len(generated) - 1, ...]``."""
    prompt, config, plan = _request(self, token_ids, steer, max_tokens=max_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    stop_at_eos=stop_at_eos, seed=seed, n_logprobs=n_logprobs)
    plan = capture_plan(self.graph, points) | plan
    _refuse(self, plan)
    capture = self.backend.new_capture()
    steps, finish = [], "length"
    async for step, reason in _agen_steps(self, prompt, config, plan, capture=capture):
        steps.append(step)
        finish = reason or finish
    values = self.backend.assemble(plan, capture)
    completion = Completion(text="".join(s.token_str for s in steps),
                            token_ids=tuple(s.token_id for s in steps), finish_reason=finish,
                            logprobs=None if n_logprobs is None else tuple(s.logprobs for s in steps))
    return completion, {a: values[a] for a in plan.reads}


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


@jaxtyped(typechecker=beartype)
def decode_residuals(model: Model, resid: Float[torch.Tensor, "*batch d_model"]
                     ) -> Float[torch.Tensor, "*batch d_vocab"]:
    """Eager only: final norm then unembedding (with the architecture's soft-cap) on a residual;
    returns raw logits with the residual's leading shape."""
    if model.backend_name != "eager":
        raise CapabilityUnsupported("free_decode_residuals", model.backend_name)
    _lens_check(model)
    if resid.shape[-1] != model.d_model:
        raise ValueError(f"residual has width {resid.shape[-1]}, expected d_model={model.d_model}")
    return model.backend.decode(resid)


def _decode_method(self: Model, cache: Cache | torch.Tensor, top_k: int | None = None,
                   points: Sequence[AddressLike] | None = None, log_probs: bool = True):
    """The portable lens. With a Cache: every ``resid_post`` in it (or ``points``), stacked to
    ``[layer, batch, pos, d_vocab]`` log-probs (logits with ``log_probs=False``); with a tensor
    ``[..., d_model]``: ``[..., d_vocab]``. ``top_k=k`` returns ``(token_ids, logprobs)``, each
    ``[layer, batch, pos, k]``. Runs where the weights are, on every backend."""
    _lens_check(self)
    if isinstance(cache, Cache):
        if points is None:
            addresses = sorted((a for a in cache if a.name == "resid_post"), key=lambda a: a.layer)
            if not addresses:
                raise ValueError("the cache holds no resid_post: capture resid_post at the layers to decode, "
                                 "or pass points=[...]")
        else:
            addresses = [self.graph.check_address(p) for p in points]
        resid = torch.stack([cache[a] for a in addresses])
    elif isinstance(cache, torch.Tensor):
        resid = cache
    else:
        raise TypeError(f"decode_residuals takes a Cache or a tensor, got {type(cache).__name__}")
    if resid.shape[-1] != self.d_model:
        raise ValueError(f"residual has width {resid.shape[-1]}, expected d_model={self.d_model}")
    logits = self.backend.decode(resid)
    out = torch.log_softmax(logits.float(), dim=-1) if log_probs else logits
    if top_k is None:
        return out
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= self.d_vocab:
        raise ValueError(f"top_k must be an int in [1, {self.d_vocab}], got {top_k!r}")
    values, ids = torch.topk(out, top_k, dim=-1)
    return ids, values


Model.decode_residuals = _decode_method  # type: ignore[attr-defined]


# ---- helpers on a cache -------------------------------------------------------------

@jaxtyped(typechecker=beartype)
def _checked_contributions(z: Float[torch.Tensor, "batch pos n_heads d_head"],
                           out: Float[torch.Tensor, "batch pos n_heads d_model"]) -> Float[torch.Tensor, "batch pos n_heads d_model"]:
    return out


def head_contributions(model: Model, cache: Cache, layer: int) -> torch.Tensor:
    """Per-head writes of attention at ``layer``: ``[batch, pos, n_heads, d_model]``. Summed
    over heads (plus the o_proj bias, if any) they give the output projection, which is
    ``attn_out`` on every architecture without a post-attention norm (on Gemma 2 it is the
    input of that norm). Needs ``z.{layer}`` in the cache; runs where the weights are."""
    address = model.graph.check_address(Address("z", layer))
    if address not in cache:
        raise KeyError(f"head_contributions needs {address} in the cache: capture it with "
                       f"run_with_cache(model, tokens, ['{address}'])")
    z = cache[address]
    return _checked_contributions(z, model.backend.head_contributions(layer, z))


def expert_assignment(cache: Cache, layer: int, n_experts: int, *, top_k: int | None = None,
                      normalize: bool = True) -> torch.Tensor:
    """Dense routing ``[batch, pos, n_experts]``: the weight each expert gets at each position
    (zero for unselected experts). Uses ``expert_indices``/``expert_weights`` when captured;
    otherwise the top-k of ``softmax(router_logits)`` (pass ``top_k``; ``normalize`` renormalises
    the selected weights, as Qwen3-MoE's norm_topk_prob does)."""
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts must be a positive int, got {n_experts!r}")
    idx_a, w_a, log_a = (Address(n, layer) for n in ("expert_indices", "expert_weights", "router_logits"))
    if idx_a in cache and w_a in cache:
        indices, weights = cache[idx_a], cache[w_a]
    elif log_a in cache:
        if top_k is None:
            raise ValueError(f"the cache has {log_a} but not {idx_a}/{w_a}: pass top_k= to select from "
                             "the router's softmax, or capture expert_indices and expert_weights (eager)")
        logits = cache[log_a]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, indices = torch.topk(probs, top_k, dim=-1)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
    else:
        raise KeyError(f"expert_assignment needs {idx_a} and {w_a} (or {log_a}) in the cache")
    return _dense(indices, weights, n_experts)


@jaxtyped(typechecker=beartype)
def _dense(indices: Int[torch.Tensor, "batch pos top_k"], weights: Float[torch.Tensor, "batch pos top_k"],
           n_experts: int) -> Float[torch.Tensor, "batch pos n_experts"]:
    if indices.numel() and int(indices.max()) >= n_experts:
        raise ValueError(f"expert index {int(indices.max())} >= n_experts={n_experts}")
    dense = torch.zeros(indices.shape[:-1] + (n_experts,), dtype=weights.dtype, device=weights.device)
    return dense.scatter_add(-1, indices.long(), weights)
