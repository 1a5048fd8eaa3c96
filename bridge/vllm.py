"""The vLLM bridge: lower Plans onto hooks inside a real vLLM engine (the V1 engine, in
process, eager mode), drive the engine step by step, and map flat token rows back to
requests and absolute positions.

vLLM fuses add + RMSNorm, so decoder layers return ``(h, r)``: resid_post = h + r,
resid_mid = r, mlp_out = h; a layer takes ``(positions, hidden, residual)`` with
resid_pre = hidden + residual (hidden alone at layer 0). Hooks exist only while one engine
step runs and are removed in ``finally``; each request carries its own plan, so concurrent
requests with different steering share a batch without seeing each other's writes.
Prefix caching is off, so every position of every request runs through the hooks and a
steered request never reuses unsteered KV.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

import torch
from torch import nn

from interp_engine._address import Address
from interp_engine._backend import RawStep
from interp_engine._capabilities import CapabilityUnsupported
from interp_engine._graph import GradSupport, ModelGraph
from interp_engine._ops import apply_write, reshape_point, select_rows, stored
from interp_engine._plan import Plan, SteerOp
from interp_engine._points import POINTS
from interp_engine._sampling import SamplingConfig
from interp_engine._tokens import TokenBatch
from specs import ArchSpec, VllmTap

from .outputs import full_output

__all__ = ["VllmBackend"]

_ids = itertools.count()


def _ensure_expert_group() -> None:
    """vLLM keeps its parallel groups per process and creates the expert-parallel group only
    when the first engine in the process is an MoE model; an MoE engine started after a dense
    one would find none. Create it (same ranks as the tensor-parallel group) if it is missing."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps._EP is not None:
        return
    tp = ps.get_tp_group()
    ps._EP = ps.init_model_parallel_group([list(tp.ranks)], ps.get_world_group().local_rank,
                                          tp.backend if hasattr(tp, "backend") else "gloo", group_name="ep")


def check_engine_kwargs(kwargs: dict) -> None:
    """Refuse, before any engine starts, an engine argument vLLM does not have or a value of
    the wrong type, naming the argument (vLLM itself fails late and elsewhere)."""
    import dataclasses
    import difflib

    from beartype.door import is_bearable
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    for key, value in kwargs.items():
        field_ = fields.get(key)
        if field_ is None:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"unknown vLLM engine argument {key!r}{hint} (engine arguments are the fields "
                            "of vllm.EngineArgs)")
        try:
            ok = is_bearable(value, field_.type)
        except Exception:  # a hint beartype cannot check: leave it to vLLM
            ok = True
        if not ok:
            raise TypeError(f"vLLM engine argument {key}={value!r} has the wrong type: expected {field_.type}")


def _soft_shutdown(core) -> None:
    core.model_executor.shutdown()
    core.scheduler.shutdown()


def _replace_finalizer(llm):
    """vLLM's in-process client shuts down with ``cleanup_dist_env_and_memory()``, which tears
    down the process-wide parallel state and so breaks every other engine in the process, also
    when an LLM is merely garbage-collected. Swap it for a shutdown of this engine's executor
    and scheduler only; returns the finalizer (call it to close the engine now)."""
    import weakref

    client = llm.llm_engine.engine_core
    original = getattr(client, "_finalizer", None)
    core = getattr(client, "engine_core", None)
    if original is None or core is None:  # another client type: keep vLLM's own behaviour
        return getattr(original, "__call__", lambda: None)
    original.detach()
    return weakref.finalize(llm, _soft_shutdown, core)


# ---- per-request state ----------------------------------------------------------------

@dataclass
class _Capture:
    """Rows captured for one request: per (source key), chunks of (positions, rows)."""

    chunks: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


@dataclass(eq=False)  # identity: requests are compared with `is` / `in` in hooks
class _Request:
    internal_id: str
    plan: Plan
    prompt_len: int
    capture: _Capture | None
    sink: Callable[[Any], None]
    vectors: tuple[torch.Tensor, ...] = ()
    finished: bool = False


def _read_key(tap: VllmTap, layer: int) -> tuple:
    return (tap.source, tap.module_path(layer))


class VllmBackend:
    name = "vllm"
    hooks_available = True
    graph_replay = False
    static_points: tuple[Address, ...] = ()
    static_writes: tuple[Address, ...] = ()

    def __init__(self, path, spec: ArchSpec, graph: ModelGraph, *, dtype: torch.dtype, max_model_len: int,
                 enable_prompt_embeds: bool = False, **engine_kwargs: Any) -> None:
        check_engine_kwargs(engine_kwargs)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise CapabilityUnsupported(
                "vllm_architecture", "vllm",
                why="capture and steering reach the model through hooks in this process, and "
                    "VLLM_ENABLE_V1_MULTIPROCESSING=1 moves the worker to another process",
                instead="unset VLLM_ENABLE_V1_MULTIPROCESSING (or set it to 0)")
        if engine_kwargs.get("enforce_eager", True) is not True:
            raise CapabilityUnsupported(
                "static_graph", "vllm", detail="enforce_eager=False",
                why="hooks added to a compiled or graph-captured vLLM model never fire")
        for key in ("enable_prefix_caching", "speculative_config"):
            if engine_kwargs.get(key):
                raise ValueError(f"{key} is not allowed with backend='vllm': prefix caching skips hooked "
                                 "positions (and reuses unsteered KV); speculative decoding captures "
                                 "rejected draft rows")
        self.path, self.spec, self.graph, self.dtype = path, spec, graph, dtype
        self.prompt_embeds = bool(enable_prompt_embeds)
        self.requires_grad = False
        self.max_model_len = max_model_len
        self._kwargs = dict(
            model=str(path), dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
            seed=0, max_logprobs=graph.d_vocab, enable_prompt_embeds=self.prompt_embeds,
            max_model_len=max_model_len, **engine_kwargs,
        )
        self._llm = None
        self._lock = threading.RLock()
        self._requests: dict[str, _Request] = {}
        self._external: dict[str, str] = {}
        self._driver: asyncio.Task | None = None
        self._modules: dict[str, nn.Module] = {}
        self._forward_rows: list[tuple[_Request, int, int]] = []
        self._forward_positions: torch.Tensor | None = None
        self._selections: dict[tuple[int, int], Any] = {}

    # ---- engine -------------------------------------------------------------------
    def warmup(self) -> None:
        self._engine()

    def _engine(self):
        if self._llm is None:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            if not torch.cuda.is_available():
                os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            from vllm import LLM

            if self.graph.n_experts:
                _ensure_expert_group()
            # LLM(seed=...) reseeds the process-wide torch / random / numpy generators; a lazily
            # started engine must not change the caller's random streams.
            import random

            import numpy as np

            states = torch.get_rng_state(), random.getstate(), np.random.get_state()
            try:
                self._llm = LLM(**self._kwargs)
            finally:
                torch.set_rng_state(states[0])
                random.setstate(states[1])
                np.random.set_state(states[2])
            self._finalizer = _replace_finalizer(self._llm)
            worker = self._llm.llm_engine.model_executor.driver_worker.worker
            self._runner = worker.model_runner
            self._root: nn.Module = self._runner.model
        return self._llm

    def close(self) -> None:
        """Release this engine and its KV cache, leaving other engines in the process working.
        (vLLM's own shutdown tears down the process-wide parallel state every engine uses.)"""
        if self._llm is None:
            return
        import gc

        self._finalizer()
        self._llm = self._root = self._runner = None
        self._modules.clear()
        gc.collect()

    def module(self, path: str) -> nn.Module:
        module = self._modules.get(path)
        if module is None:
            self._engine()
            module = self._root.get_submodule(path)
            self._modules[path] = module
        return module

    # ---- capabilities -------------------------------------------------------------
    @property
    def grad_support(self) -> GradSupport:
        return GradSupport(False, False, "vllm", "vLLM runs under inference mode with fused kernels "
                                                  "that have no backward; use backend='eager'")

    def refusal(self, plan: Plan, batch: TokenBatch | None, *, gradients: bool = False):
        if gradients:
            return CapabilityUnsupported("gradients", self.name)
        if batch is not None and len(batch) != 1:
            return CapabilityUnsupported("batched_prompts", self.name, detail=f"a batch of {len(batch)}")
        for address in plan.reads:
            if address.name not in self.spec.vllm:
                point = POINTS[address.name]
                return CapabilityUnsupported(point.capability or "vllm_architecture", self.name,
                                             detail=f"point {address}")
        return None

    # ---- requests -----------------------------------------------------------------
    def _sampling_params(self, config: SamplingConfig):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=config.max_tokens, temperature=float(config.temperature), top_k=int(config.top_k),
            top_p=float(config.top_p), seed=config.seed, logprobs=config.n_logprobs,
            ignore_eos=not config.stop_at_eos, output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=True, detokenize=False, stop_token_ids=list(config.stop_token_ids),
            min_tokens=config.min_tokens,
        )

    def _add(self, prompt: list[int] | None, config: SamplingConfig, plan: Plan, capture: _Capture | None,
             sink: Callable[[Any], None], embeds: torch.Tensor | None = None) -> _Request:
        llm = self._engine()
        if embeds is not None:
            if not self.prompt_embeds:
                raise ValueError("prompt embeds are off: load_model(..., enable_prompt_embeds=True)")
            engine_prompt: Any = {"prompt_embeds": embeds.detach().to("cpu", self.dtype)}
            prompt_len = int(embeds.shape[0])
        else:
            engine_prompt = {"prompt_token_ids": list(prompt)}
            prompt_len = len(prompt)
        device = next(self._root.parameters()).device  # moved once, not in every hook call
        vectors = tuple(op.placed(device, self.dtype) for op in plan.writes)
        with self._lock:
            external = f"interp-{next(_ids)}"
            internal = llm.llm_engine.add_request(external, engine_prompt, self._sampling_params(config))
            request = _Request(internal, plan, prompt_len, capture, sink, vectors)
            self._requests[internal] = request
            self._external[external] = internal
        return request

    def _abort(self, request: _Request) -> None:
        with self._lock:
            if not request.finished:
                request.finished = True
                self._llm.llm_engine.abort_request([request.internal_id])
            self._requests.pop(request.internal_id, None)

    def _step(self) -> None:
        """One engine step with the active requests' hooks installed for its duration."""
        with self._lock:
            engine = self._llm.llm_engine
            if not engine.has_unfinished_requests():
                return
            handles = self._install()
            try:
                outputs = engine.step()
            finally:
                for handle in handles:
                    handle.remove()
                self._forward_rows = []
                self._selections = {}
            for out in outputs:
                internal = self._external.get(out.request_id, out.request_id)
                request = self._requests.get(internal)
                if request is None:
                    continue
                if out.finished:
                    request.finished = True
                    self._requests.pop(internal, None)
                    self._external.pop(out.request_id, None)
                request.sink(out)

    # ---- hooks ----------------------------------------------------------------------
    def _install(self) -> list:
        active = [r for r in self._requests.values() if not r.plan.empty]
        if not active:
            return []
        handles = [self._root.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        try:
            writes: dict[tuple, list[tuple[_Request, int]]] = {}
            reads: dict[tuple, list[_Request]] = {}
            for request in active:
                for i, op in enumerate(request.plan.writes):
                    tap = self.spec.vllm_writes.get(op.address.name) or self.spec.vllm[op.address.name]
                    writes.setdefault((op.address.name, tap.source, tap.module_path(op.address.layer)),
                                      []).append((request, i))
                if request.capture is not None:
                    for address in request.plan.reads:
                        tap = self.spec.vllm[address.name]
                        subs = reads.setdefault(_read_key(tap, address.layer), [])
                        if request not in subs:
                            subs.append(request)
            for (name, source, path), subs in writes.items():
                handles.append(self._write_hook(name, source, path, subs))
            for (source, path), subs in reads.items():
                handles.append(self._read_hook(source, path, subs))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def _on_forward(self, module, args, kwargs):
        """Before each model forward: which rows belong to which request, at which positions."""
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        runner = self._runner
        num_reqs = runner.input_batch.num_reqs
        req_ids = runner.input_batch.req_ids[:num_reqs]
        starts = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        rows = []
        for j, internal in enumerate(req_ids):
            request = self._requests.get(internal)
            if request is not None and not request.plan.empty:
                rows.append((request, starts[j], starts[j + 1]))
        self._forward_rows = rows
        # positions is a persistent buffer vLLM rewrites every step: copy it
        self._forward_positions = positions.detach().to("cpu", copy=True) if positions is not None else None
        self._selections = {}

    def _rows_of(self, request: _Request):
        for r, s, e in self._forward_rows:
            if r is request:
                return s, e
        return None

    def _selection(self, request: _Request, i: int, s: int, e: int):
        """Which rows of s:e op i writes in this forward (computed once per forward)."""
        key = (id(request), i)
        sel = self._selections.get(key)
        if sel is None:
            op = request.plan.writes[i]
            sel = select_rows(op.positions, op.per_position, self._forward_positions[s:e], request.prompt_len)
            self._selections[key] = sel
        return sel

    def _apply(self, request: _Request, i: int, x: torch.Tensor, s: int, e: int,
               base: torch.Tensor | None) -> None:
        """Rows s:e of ``x`` (a fresh copy) get op i; ``base`` is what x is offset by (the value
        the op reads is x + base, and the result is written back minus base)."""
        sel = self._selection(request, i, s, e)
        if sel.empty:
            return
        op: SteerOp = request.plan.writes[i]
        x[s:e] = apply_write(op.op, x[s:e], request.vectors[i], sel, None if base is None else base[s:e])

    def _write_hook(self, name: str, source: str, path: str, subs: list[tuple[_Request, int]]):
        module = self.module(path)
        apply, rows_of = self._apply, self._rows_of

        def each(x: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
            spans = [(request, i, span) for request, i in subs if (span := rows_of(request)) is not None]
            if not spans:  # none of this site's requests is in this forward
                return x
            x = x.clone()
            for request, i, (s, e) in spans:
                apply(request, i, x, s, e, base)
            return x

        if source == "layer_in":  # resid_pre: (positions, hidden, residual)
            def pre(mod, args, kwargs):
                args, kwargs = list(args), dict(kwargs)
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
                residual = kwargs["residual"] if "residual" in kwargs else (args[2] if len(args) > 2 else None)
                new = each(hidden, residual)
                if "hidden_states" in kwargs:
                    kwargs["hidden_states"] = new
                else:
                    args[1] = new
                return tuple(args), kwargs
            return module.register_forward_pre_hook(pre, with_kwargs=True)
        if source == "fused_in_sum":  # resid_mid: norm(x, residual) with mid = x + residual
            def pre(mod, args, kwargs):
                args = list(args)
                args[0] = each(args[0], args[1])
                return tuple(args), kwargs
            return module.register_forward_pre_hook(pre, with_kwargs=True)
        if source in ("layer_sum", "layer_h"):  # write h; resid_post reads h + r
            offset = source == "layer_sum"

            def hook(mod, args, out):
                h, r = out
                return each(h, r if offset else None), r
            return module.register_forward_hook(hook)
        if source == "module_out":
            def hook(mod, args, out):
                if isinstance(out, tuple):
                    return (each(out[0], None),) + tuple(out[1:])
                return each(out, None)
            return module.register_forward_hook(hook)
        raise CapabilityUnsupported("static_graph", self.name, detail=f"no vLLM write path for {name}")

    def _read_hook(self, source: str, path: str, subs: list[_Request]):
        module = self.module(path)
        key = (source, path)
        forward_rows = lambda: self._forward_rows  # noqa: E731
        positions = lambda: self._forward_positions  # noqa: E731

        def store(value: torch.Tensor) -> None:
            pos = positions()
            for request, s, e in forward_rows():
                if request in subs:
                    request.capture.chunks.setdefault(key, []).append((pos[s:e], stored(value[s:e])))

        if source in ("layer_in", "module_in"):
            def pre(mod, args, kwargs):
                if source == "module_in":
                    store(args[0] if args else next(iter(kwargs.values())))
                    return None
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
                residual = kwargs["residual"] if "residual" in kwargs else (args[2] if len(args) > 2 else None)
                store(hidden if residual is None else hidden + residual)
                return None
            return module.register_forward_pre_hook(pre, with_kwargs=True)

        def hook(mod, args, out):
            if source == "layer_sum":
                store(out[0] + out[1])
            elif source == "layer_r":
                store(out[1])
            elif source == "layer_h":
                store(out[0])
            else:
                store(out[0] if isinstance(out, tuple) else out)
        return module.register_forward_hook(hook)

    # ---- results ----------------------------------------------------------------------
    def new_capture(self) -> _Capture:
        return _Capture()

    def assemble(self, plan: Plan, capture: _Capture, expected: int | None = None) -> dict[Address, torch.Tensor]:
        graph = self.graph
        values: dict[Address, torch.Tensor] = {}
        for address in plan.reads:
            tap = self.spec.vllm[address.name]
            chunks = capture.chunks.get(_read_key(tap, address.layer), [])
            by_pos: dict[int, torch.Tensor] = {}
            for pos, rows in chunks:  # a recomputed position (preemption) keeps its last value
                for p, row in zip(pos.tolist(), rows):
                    by_pos[p] = row
            n = len(by_pos)
            if sorted(by_pos) != list(range(n)) or (expected is not None and n != expected):
                raise RuntimeError(f"vLLM capture of {address} saw positions {sorted(by_pos)[:8]}... "
                                   f"({n}), expected 0..{(expected or n) - 1}; prefix caching or "
                                   "speculative decoding may be on")
            t = torch.stack([by_pos[p] for p in range(n)])
            values[address] = reshape_point(t, tap.post, graph, (n,)).unsqueeze(0)
        return values

    @staticmethod
    def _raw_steps(out, k: int | None) -> Iterator[RawStep]:
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        for n, token in enumerate(ids):
            logprobs = sampled = None
            if k is not None and completion.logprobs is not None:
                entry = completion.logprobs[n]  # the top-k, plus the sampled token if outside them
                top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items()
                             if lp.rank is not None and lp.rank <= k)
                logprobs = [{"token_id": int(tid), "logprob": float(lp)} for _, tid, lp in top]
                sampled = float(entry[token].logprob) if token in entry else None
            last = out.finished and n == len(ids) - 1
            yield RawStep(int(token), logprobs, None, completion.finish_reason if last else None, sampled)

    def generate(self, prompt: list[int] | None, config: SamplingConfig, plan: Plan,
                 captures: _Capture | None = None, embeds: torch.Tensor | None = None) -> Iterator[RawStep]:
        """Synchronous generation: drive engine steps until this request finishes."""
        pending: list = []
        request = self._add(prompt, config, plan, captures, pending.append, embeds)
        try:
            while True:
                if not pending:
                    if request.finished:
                        return
                    self._step()
                    continue
                out = pending.pop(0)
                yield from self._raw_steps(out, config.n_logprobs)
                if out.finished:
                    return
        finally:
            self._abort(request)

    async def agenerate(self, prompt: list[int] | None, config: SamplingConfig, plan: Plan,
                        captures: _Capture | None = None, embeds: torch.Tensor | None = None
                        ) -> AsyncIterator[RawStep]:
        """Asynchronous generation: concurrent requests share engine steps (one batch)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request = self._add(prompt, config, plan, captures,
                            lambda out: loop.call_soon_threadsafe(queue.put_nowait, out), embeds)
        self._ensure_driver(loop)
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise RuntimeError("the vLLM engine step failed") from out
                for raw in self._raw_steps(out, config.n_logprobs):
                    yield raw
                if out.finished:
                    return
        finally:
            self._abort(request)

    def _ensure_driver(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._driver is not None and not self._driver.done() and self._driver.get_loop() is loop:
            return

        async def drive() -> None:
            try:
                while True:
                    with self._lock:
                        busy = bool(self._requests)
                    if not busy:
                        return
                    # Step in this thread: vLLM's CPU attention kernel checks that a batch runs
                    # with the OpenMP thread count it was planned with, which a worker thread
                    # does not share. A step takes milliseconds; consumers run in between.
                    self._step()
                    await asyncio.sleep(0)
            except BaseException as exc:  # a failed step fails every waiting request, loudly
                with self._lock:
                    waiting = list(self._requests.values())
                for request in waiting:
                    request.sink(exc)
                raise

        self._driver = loop.create_task(drive())

    def request_output(self, prompt_ids: list[int], steps: list, finish: str, n_logprobs: int | None):
        return full_output(prompt_ids, steps, finish, n_logprobs)

    def run_with_cache(self, plan: Plan, batch: TokenBatch, detach: bool = True, want_logits: bool = False):
        prompt = batch.row(0)
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"the input has {len(prompt)} positions and this model's context holds "
                             f"{self.max_model_len} (max_model_len): vLLM runs a prompt only with room "
                             f"for one token after it, so pass at most {self.max_model_len - 1} positions")
        capture = _Capture()
        config = SamplingConfig(max_tokens=1, temperature=0.0, stop_at_eos=False)
        for _ in self.generate(prompt, config, plan, capture):
            pass
        return self.assemble(plan, capture, expected=len(prompt)), None

    # ---- weights (in process) -----------------------------------------------------------
    def decode(self, resid: torch.Tensor) -> torch.Tensor:
        norm = self.module(self.spec.vllm_final_norm_path)
        head = self.module(self.spec.vllm_unembed_path)
        shape = resid.shape
        with torch.inference_mode():
            flat = resid.reshape(-1, shape[-1]).to(head.weight.device, self.dtype)
            logits = torch.nn.functional.linear(norm(flat), head.weight)
            cap = self.graph.final_logit_softcap
            if cap:
                logits = torch.tanh(logits / cap) * cap
        return logits.reshape(*shape[:-1], logits.shape[-1]).cpu()

    def head_contributions(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """Each head's write through vLLM's own o_proj module, one head at a time (vLLM's CPU
        kernels may repack the weight, so it is not read as a matrix): o_proj(z with only head h
        kept) - o_proj(0), which removes any bias."""
        o_proj = self.module(self.spec.vllm["z"].module_path(layer))
        device = next(self._root.parameters()).device
        b, p, h, d = z.shape
        flat = z.reshape(b * p, h * d).to(device, self.dtype)

        def run(x):
            out = o_proj(x)
            return out[0] if isinstance(out, tuple) else out

        with torch.inference_mode():
            base = run(torch.zeros_like(flat[:1]))
            heads = []
            for head in range(h):
                masked = torch.zeros_like(flat)
                masked[:, head * d:(head + 1) * d] = flat[:, head * d:(head + 1) * d]
                heads.append(run(masked) - base)
        return torch.stack(heads, dim=1).reshape(b, p, h, -1).cpu()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The model's own input embeddings (Gemma 2's sqrt(d_model) scale included)."""
        self._engine()
        with torch.inference_mode():
            return self._root.embed_input_ids(ids.to(next(self._root.parameters()).device)).cpu()
