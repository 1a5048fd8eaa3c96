"""The client side of the vLLM bridge: a thin driver on vLLM's public API.

A request's plan travels as plain data in ``SamplingParams.extra_args``; the runtime inside each
worker (``runtime.py``, loaded through ``worker_extension_cls``) applies it; captures come back
through ``collective_rpc`` when the request ends. So the same code serves an in-process engine,
a multiprocess one (vLLM's default), tensor parallelism and Ray workers: nothing here assumes
the worker shares this process or this machine. (A harvest request's plan names a file for its
rows, which the workers write when they can open it and send back otherwise: ``harvest_into``.)

One driver thread per engine pulls outputs (``LLMEngine.step``) while any request is in flight
and hands each to its request's queue; synchronous and asynchronous callers on any event loop
share it, and concurrent requests share engine steps (one batch). Prefix caching is off, so
every position of every request runs through the runtime and a steered request never reuses
unsteered KV; speculative decoding is refused (it would capture rejected draft rows).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

import torch

from interp_engine._address import Address, to_address
from interp_engine._backend import RawStep
from interp_engine._capabilities import CapabilityUnsupported
from interp_engine._graph import GradSupport, ModelGraph
from interp_engine._ops import reshape_point
from interp_engine._plan import Plan
from interp_engine._points import POINTS
from interp_engine._sampling import SamplingConfig
from interp_engine._tokens import TokenBatch
from specs import ArchSpec

from ..outputs import full_output
from .sink import rows_are_values
from .wire import KEY, memo_get, merge_ranks, pack_plan, plan_to_wire, point_width, tensor_from_wire, tensor_to_wire

__all__ = ["VllmBackend", "check_engine_kwargs"]

EXTENSION = "bridge.vllm.worker.InterpWorkerExtension"
VALIDATOR = "bridge.vllm.validator:PlanValidator"
_ids = itertools.count()
_PROCESS = uuid.uuid4().hex[:16]  # this client process's part of every request id


# points vLLM holds only inside a fused projection (or a per-head norm): reads and writes are
# served with tensor_parallel_size=1 (each rank holds only its slice of the projection otherwise)
_FUSED = frozenset({"q", "k", "v", "mlp_pre"})
# points recomputed from router_logits with the spec's routing rule (bridge/vllm/routing.py)
_ROUTED = frozenset({"expert_weights", "expert_indices"})
# points whose rows may leave the worker in another dtype than the model's: never by the inbox
_NOT_INBOX = _ROUTED | {"router_logits", "pattern"}


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


def cpu_kv_bytes(graph: ModelGraph, dtype: torch.dtype, max_model_len: int) -> int:
    """The KV cache a CPU engine gets unless told otherwise: room for 64 sequences of the whole
    context (K and V of every layer's KV heads), between 64 MiB and 1 GiB. A real model gets the
    1 GiB cap; a small one no more than it can use (each GiB is the engine's resident memory)."""
    per_token = 2 * graph.n_layers * graph.n_kv_heads * graph.d_head * torch.empty((), dtype=dtype).element_size()
    return int(min(1 << 30, max(64 << 20, 64 * int(max_model_len) * per_token)))


def _cpu_binding(world: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``world`` CPU ranks: the usable cores split evenly."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < world:
        return None
    per = len(cores) // world
    groups = [cores[i * per:(i + 1) * per] for i in range(world)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


# ---- requests -------------------------------------------------------------------------

IDLE, STEPPED, HANDED = 0, 1, 2  # what one pump did (VllmBackend._pump)
_PUMP_TURN = 0.01  # seconds an in-process engine steps on before its event loop gets a turn

_SETTLE_MAX = 256  # harvest windows answered for in one rpc, at most (workers keep 4096 finished)


@dataclass
class _Capture:
    """Where a request's captures land once it ends, as ``assemble`` returns them: address ->
    ``[1, rows, ...]`` tensors (each point's shape), in plan order."""

    rid: str = ""
    values: dict[Address, torch.Tensor] | None = None


@dataclass(frozen=True, eq=False)
class _Rows:
    """How one set of reads lies in the inbox, worked out once per set (``_inbox_rows``): in
    plan order, each read's address, its name on the wire and its row width in floats;
    ``wire_widths`` is the sink's ``widths`` as sent (one dict every request shares, read only);
    ``plain``: every read's rows are its values as they are (no ``post`` reshape: ``_shaped``)."""

    reads: tuple[Address, ...]
    names: tuple[str, ...]
    widths: tuple[int, ...]
    wire_widths: dict[str, int]
    plain: bool


@dataclass(eq=False)
class _Region:
    """A request's region of the client's inbox file (inbox.py): the rows of ``rows.reads[j]``
    at byte ``at[j]``, ``rows.widths[j]`` floats a row. ``done``: the client read it, or gave
    the request up."""

    start: int
    nbytes: int
    at: tuple[int, ...]
    rows: _Rows
    held: bool = False  # a generation's, held from its first step to its last (Inbox.take)
    done: bool = False
    slab: Any = None  # a one-token capture's rows in a slab it shares (Inbox.rows), not a region of its own


@dataclass(frozen=True)
class _Refused:
    """The engine refused a request when the driver added it: its exception, for the caller."""

    exc: Exception


class _LoopQueue:
    """The sink of a request whose caller waits on an event loop: puts into its asyncio queue
    from the driver thread. The pump hands a step's outputs for one loop over in one wake-up of
    that loop (``_deliver``), not one per request."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue

    def __call__(self, out: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)


def _put_all(items: list) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _deliver(pairs: list) -> None:
    """Each ``(request, output)``'s output to the request's sink, in order: those waited for on
    one event loop in one ``call_soon_threadsafe`` (each wakes the loop with a write to its
    pipe: one per step, not one per request), every other sink called directly."""
    loops: dict = {}
    for request, out in pairs:
        sink = request.sink
        if type(sink) is _LoopQueue:
            loops.setdefault(sink.loop, []).append((sink.queue, out))
        else:
            sink(out)
    for loop, items in loops.items():
        loop.call_soon_threadsafe(_put_all, items)


@dataclass(eq=False)
class _Request:
    external_id: str
    rid: str
    plan: Plan
    prompt_len: int
    capture: _Capture | None
    sink: Callable[[Any], None]
    max_tokens: int = 1 << 30
    finished: bool = False
    generated: int = 0
    released: bool = False
    deferred: bool = False  # its status is collected by its caller, with others (harvest_into)
    slot: int | None = None  # its row of the status board (a plan that only writes): see board.py
    region: _Region | None = None  # where its workers write its rows for it to read (inbox.py)
    # what the workers answered for this request when it finished (collected by the pump, in
    # one rpc for every request that finished in that step), or the exception that rpc raised
    settled: list | BaseException | None = None


class VllmBackend:
    name = "vllm"
    hooks_available = True
    graph_replay = False
    static_points: tuple[Address, ...] = ()
    static_writes: tuple[Address, ...] = ()

    def __init__(self, path, spec: ArchSpec, graph: ModelGraph, *, dtype: torch.dtype, max_model_len: int,
                 enable_prompt_embeds: bool = False, **engine_kwargs: Any) -> None:
        check_engine_kwargs(engine_kwargs)
        if engine_kwargs.get("enforce_eager", True) is not True:
            raise CapabilityUnsupported(
                "static_graph", "vllm", detail="enforce_eager=False",
                why="hooks added to a compiled or graph-captured vLLM model never fire",
                instead="use backend='vllm-static' (taps compiled into the graph) or leave enforce_eager on")
        for key in ("enable_prefix_caching", "speculative_config"):
            if engine_kwargs.get(key):
                raise ValueError(f"{key} is not allowed with backend='vllm': prefix caching skips hooked "
                                 "positions (and reuses unsteered KV); speculative decoding captures "
                                 "rejected draft rows")
        for key in ("worker_extension_cls", "logits_processors"):
            if key in engine_kwargs:
                raise ValueError(f"{key} is set by interp_engine (its worker runtime and plan admission); "
                                 "start your own vllm.LLM to use another")
        self.path, self.spec, self.graph, self.dtype = path, spec, graph, dtype
        self.prompt_embeds = bool(enable_prompt_embeds)
        self.max_model_len = max_model_len
        self.tensor_parallel_size = int(engine_kwargs.get("tensor_parallel_size", 1) or 1)
        self._kwargs = dict(
            model=str(path), dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
            seed=0, max_logprobs=graph.d_vocab, enable_prompt_embeds=self.prompt_embeds,
            max_model_len=max_model_len, worker_extension_cls=EXTENSION, logits_processors=[VALIDATOR],
            **({"model_impl": spec.vllm_model_impl} if spec.vllm_model_impl else {}),
            **engine_kwargs,
        )
        if (not torch.cuda.is_available() and "kv_cache_memory_bytes" not in engine_kwargs
                and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")):
            # vLLM's CPU backend otherwise reserves most of the machine's memory for KV cache
            self._kwargs["kv_cache_memory_bytes"] = cpu_kv_bytes(graph, dtype, max_model_len)
        self._llm = None
        self._board = None  # where the workers report write-only plans (board.py), once started
        self._spill = None  # where multiprocess workers write a collect's rows (spill.py), once started
        self._params: dict[tuple[SamplingConfig, bool], Any] = {}  # vLLM SamplingParams per config (checked once)
        self._inbox_plans: dict[tuple, _Rows | None] = {}  # reads -> their layout, if inboxed (_inbox_rows)
        self._inbox = None  # where multiprocess workers write a capture's rows (inbox.py)
        self._issue: Callable[[str], None] | None = None  # validator.issue, once the engine starts
        self._lock = threading.RLock()  # one caller inside the engine at a time
        self._wake = threading.Condition()
        self._requests: dict[str, _Request] = {}
        # finished requests whose collect waits one step for others about to end (_pump)
        self._held: list[tuple[_Request, Any]] = []
        # requests waiting for the driver to hand them to a multiprocess engine (under _wake):
        # callers never wait for a running step to add theirs, so the next step schedules
        # every request that arrived meanwhile together
        self._incoming: list[tuple[_Request, Any, Any]] = []
        # requests queued from an event loop and not yet released to the driver (_kick): the
        # driver, between two steps or waking from its poll, takes only released ones
        self._queued: list[tuple[_Request, Any, Any]] = []
        self._kicks: set = set()  # event loops with a driver wake-up pending (_kick)
        self._driver: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._stop = False
        self._dead = False  # the engine core died: nothing more is served (see _watch)
        self._fingerprint: str | None = None
        self._in_process: bool | None = None
        self._routing_mismatch: dict[int, str] = {}  # MoE layer -> why vLLM routes otherwise
        self._expert_refusals: dict[int, str] = {}  # MoE layer -> why an experts= write is not served
        self._pattern_mismatch: dict[int, str] = {}  # layer -> why its kernel's pattern cannot be rebuilt

    # ---- engine -----------------------------------------------------------------------
    def warmup(self) -> None:
        self._engine()

    @property
    def in_process(self) -> bool:
        """Whether the engine runs its model in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0
        when it started); fixed at start, whatever the environment says later."""
        if self._in_process is None:
            return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        return self._in_process

    def _engine(self):
        if self._dead:
            raise RuntimeError("this model's vLLM engine core died while serving (its log above says why) "
                               "and serves nothing more: close it and load the model again")
        if self._llm is not None:
            return self._llm
        with self._lock:
            if self._llm is not None:
                return self._llm
            if not torch.cuda.is_available():
                if self.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                    binding = _cpu_binding(self.tensor_parallel_size)
                    if binding:
                        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
            from vllm import LLM, envs

            from .validator import issue, register_graph  # (vLLM's modules load with the engine)

            # vLLM caches its environment variables once an engine has started; this engine's
            # settings (in-process or not, the CPU binding) must be read afresh
            envs.disable_envs_cache()

            self._fingerprint = register_graph(self.graph)
            self._in_process = self.in_process
            if self.in_process and self.graph.n_experts:
                _ensure_expert_group()
            # LLM(seed=...) reseeds the process-wide torch / random / numpy generators; a lazily
            # started engine must not change the caller's random streams.
            import random

            import numpy as np

            states = torch.get_rng_state(), random.getstate(), np.random.get_state()
            try:
                llm = LLM(**self._kwargs)
            finally:
                torch.set_rng_state(states[0])
                random.setstate(states[1])
                np.random.set_state(states[2])
            self._close_engine = _closer(llm)
            infos = llm.collective_rpc("interp_install")
            self.world = len(infos)
            from .board import StatusBoard

            self._board = StatusBoard(self.world)
            self._issue = issue
            if not self._in_process:
                from .spill import SpillFiles

                self._spill = SpillFiles(self.world)
                from .inbox import Inbox

                self._inbox = Inbox()
            self._routing_mismatch = {int(k): v for k, v in (infos[0].get("routing_mismatch") or {}).items()}
            self._pattern_mismatch = {int(k): v for k, v in (infos[0].get("pattern_mismatch") or {}).items()}
            self._expert_refusals = {int(k): v for k, v in (infos[0].get("expert_write_refusals") or {}).items()}
            self._llm = llm
        return self._llm

    def close(self) -> None:
        """Release this engine (its processes, its KV cache); other engines keep working."""
        if self._llm is None:
            return
        import gc

        with self._wake:
            self._stop = True
            self._wake.notify_all()
        for thread in (self._driver, self._watchdog):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=30)
        with self._lock:
            self._fail_all(RuntimeError("the model was closed"))
            self._close_engine()
            self._llm = None
            if self._board is not None:
                self._board.close()
                self._board = None
            self._spill = None
            if self._inbox is not None:
                self._inbox.close()
                self._inbox = None
        self._driver = self._watchdog = None
        self._stop = self._dead = False
        self._in_process = None
        gc.collect()

    def rpc(self, method: str, *args) -> list:
        """``collective_rpc`` on every worker, between engine steps."""
        llm = self._engine()
        with self._lock:
            return llm.collective_rpc(method, args=args)

    def module(self, path: str):
        raise AttributeError(
            f"the vLLM backend's modules live inside vLLM's worker processes: reach them with "
            f"model.backend.rpc(...) through a worker extension, or load the model with backend='eager' "
            f"to get {path!r} as a torch module")

    # ---- capabilities -------------------------------------------------------------------
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
            point = POINTS[address.name]
            if address.name not in self.spec.vllm:
                return CapabilityUnsupported(point.capability or "vllm_architecture", self.name,
                                             detail=f"point {address}",
                                             why=self.spec.vllm_refused.get(address.name))
            if address.name in _ROUTED and point.served_by(self.name):
                found = self._routing_refusal(address)
                if found is not None:
                    return found
            if address.name == "pattern" and self.tensor_parallel_size > 1:
                return CapabilityUnsupported(
                    "attention_pattern", self.name,
                    detail=f"point {address} with tensor_parallel_size={self.tensor_parallel_size}",
                    why="each rank runs attention for its own heads only, and the pattern is rebuilt from "
                        "the queries and keys of the rank that holds them; they are not gathered",
                    instead="load with tensor_parallel_size=1, or use backend='eager'")
            if address.name == "pattern":
                found = self._pattern_refusal(address)
                if found is not None:
                    return found
            if address.name in _FUSED and self.tensor_parallel_size > 1:
                return CapabilityUnsupported(
                    point.capability or "vllm_architecture", self.name,
                    detail=f"point {address} with tensor_parallel_size={self.tensor_parallel_size}",
                    why="each rank computes only its own slice of the fused projection (and per-head "
                        "norm) this point is read from, and the slices are not reassembled",
                    instead="load with tensor_parallel_size=1, or use backend='eager'")
        for op in plan.writes:
            name = op.address.name
            if op.experts is not None:
                found = self._expert_refusal(op)
                if found is not None:
                    return found
                continue
            if name not in self.spec.vllm and name not in self.spec.vllm_writes:
                point = POINTS[name]
                return CapabilityUnsupported(point.capability or "vllm_architecture", self.name,
                                             detail=f"a write at {op.address}")
            if name in _FUSED and self.tensor_parallel_size > 1:
                return CapabilityUnsupported(
                    POINTS[name].capability or "vllm_architecture", self.name,
                    detail=f"a write at {op.address} with tensor_parallel_size={self.tensor_parallel_size}",
                    why="each rank computes only its own slice of the fused projection (and per-head norm) "
                        "this point is written in",
                    instead="load with tensor_parallel_size=1, or use backend='eager'")
            tap = self.spec.vllm_writes.get(name) or self.spec.vllm[name]
            if tap.sharded and self.tensor_parallel_size > 1:
                return CapabilityUnsupported(
                    "vllm_architecture", self.name, detail=f"a write at {op.address} with tensor_parallel_size="
                    f"{self.tensor_parallel_size}", why="each rank holds only its own heads of this point",
                    instead="load with tensor_parallel_size=1 to write heads, or steer a residual-width point")
        return None

    def _expert_refusal(self, op) -> CapabilityUnsupported | None:
        """An experts= write scales the routing weights vLLM's router returns, in the worker:
        refused where the engine (started to find out) said it cannot reach them."""
        self._engine()
        why = self._expert_refusals.get(op.address.layer)
        if why is None:
            return None
        return CapabilityUnsupported("expert_writes", self.name,
                                     detail=f"experts={list(op.experts)} at {op.address}", why=why)

    def _routing_refusal(self, address: Address) -> CapabilityUnsupported | None:
        """The selection is recomputed from router_logits with the spec's rule: refused where
        vLLM's own router (read when the engine starts) routes otherwise."""
        self._engine()
        why = self._routing_mismatch.get(address.layer)
        if why is None:
            return None
        return CapabilityUnsupported("expert_selection", self.name, detail=f"point {address}",
                                     why=why + ", so a selection recomputed with the model's rule "
                                     "would not be the one vLLM applied")

    def _pattern_refusal(self, address: Address) -> CapabilityUnsupported | None:
        """The pattern is rebuilt from the kernel's inputs with its own parameters: refused at a
        layer whose kernel (read when the engine starts) computes something else. Answered once
        the engine runs (asking never starts one: ``points`` reads configuration only); a
        request reading it is checked again when it is added, before its forward."""
        if self._llm is None:
            return None
        why = self._pattern_mismatch.get(address.layer)
        if why is None:
            return None
        return CapabilityUnsupported("attention_pattern", self.name, detail=f"point {address}",
                                     why=why + ", so probabilities rebuilt from its queries and keys "
                                     "would not be the ones vLLM applied", instead="use backend='eager'")

    # ---- requests -----------------------------------------------------------------------
    def _sampling_params(self, config: SamplingConfig, extra: dict | None, streaming: bool = True):
        """vLLM's SamplingParams for one request: built (and checked by vLLM) once per distinct
        ``config``, then copied per request with the request's own plan in ``extra_args``
        (building one costs 15-70 us a request, most of it vLLM walking ``extra_args`` for
        integers past 64 bits, which a plan from ``plan_to_wire`` never holds: its integers are
        byte offsets, positions and sizes). The copy gets its own containers where vLLM's input
        processor edits them in place (the set of stop ids), so no request sees another's."""
        template = memo_get(self._params, (config, streaming),
                            lambda: self._new_sampling_params(config, streaming), limit=64)
        params = copy.copy(template)
        params.extra_args = extra
        params.stop_token_ids = list(template.stop_token_ids)
        params._all_stop_token_ids = set(template._all_stop_token_ids)
        return params

    @staticmethod
    def _new_sampling_params(config: SamplingConfig, streaming: bool):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY
        return SamplingParams(
            max_tokens=config.max_tokens, temperature=float(config.temperature), top_k=int(config.top_k),
            top_p=float(config.top_p), min_p=float(config.min_p), seed=config.seed, logprobs=config.n_logprobs,
            ignore_eos=not config.stop_at_eos, output_kind=kind,
            skip_special_tokens=True, detokenize=False, stop_token_ids=list(config.stop_token_ids),
            min_tokens=config.min_tokens,
            # each copy is made for one request and never touched again: vLLM's input processor
            # may take it as it is instead of deep-copying it (and the plan in extra_args)
            skip_clone=True,
        )

    def _add(self, prompt: list[int] | None, config: SamplingConfig, plan: Plan, capture: _Capture | None,
             sink: Callable[[Any], None], embeds: torch.Tensor | None = None,
             rows_to: dict | None = None, streaming: bool = True) -> _Request:
        """Queue one request; the caller hands it to the driver (``_release`` now, or ``_kick``
        at the end of its event loop's round). ``streaming=False``: its sink gets one output,
        when it ends."""
        self._engine()
        for address in plan.reads:
            if address.name == "pattern" and (refused := self._pattern_refusal(address)) is not None:
                raise refused
        if embeds is not None:
            if not self.prompt_embeds:
                raise ValueError("prompt embeds are off: load_model(..., enable_prompt_embeds=True)")
            engine_prompt: Any = {"prompt_embeds": embeds.detach().to("cpu", self.dtype)}
            prompt_len = int(embeds.shape[0])
        else:
            engine_prompt = {"prompt_token_ids": list(prompt)}
            prompt_len = len(prompt)
        n = next(_ids)
        rid = f"{_PROCESS}{n:x}"  # unique across clients of one worker (os.urandom per request is slow)
        slot = region = None
        if rows_to is None and capture is not None and self._inbox is not None \
                and (layout := self._inbox_rows(plan)) is not None:
            # room for every position it can reach (the final token is never fed); a generation's
            # rows are held in the workers and written at once at its last position (WireSink.hold)
            positions = prompt_len + config.max_tokens - 1
            with self._wake:  # its rows and the board row that says they are in, or neither
                region = self._region(positions, layout, held=config.max_tokens > 1)
                if region is not None:
                    slot = None if self._board is None else self._board.take()  # (it comes with the inbox)
                    if slot is None:  # no board row to say the rows are in: by rpc
                        self._give_region(region)
                        region = None
            if region is not None:
                rows_to = {"path": self._inbox.path, "positions": positions,
                           "offsets": dict(zip(layout.names, region.at)), "widths": layout.wire_widths,
                           "hold": region.held}
        elif self._board is not None and ((plan.writes and not plan.reads)
                                          or (rows_to is not None and self._boards(plan))):
            with self._wake:
                slot = self._board.take()
        extra = None
        if not plan.empty:
            # packed: vLLM checks extra_args value by value in the engine core and in each worker
            packed = pack_plan(plan_to_wire(plan, rid, model=self._fingerprint, sink=rows_to,
                                            board=None if slot is None else self._board.where(slot)))
            extra = {KEY: packed}
            self._issue(packed)  # checked by capture_plan / steer_plan: the validator need not parse it again
        params = self._sampling_params(config, extra, streaming)
        external = f"interp-{n}-{_PROCESS[:8]}"
        request = _Request(external, rid, plan, prompt_len, capture, sink, max_tokens=config.max_tokens, slot=slot,
                           region=region)
        if capture is not None:
            capture.rid = rid
        with self._wake:
            self._queued.append((request, engine_prompt, params))
        return request

    def _inboxes(self, plan: Plan) -> bool:
        """Whether a capture plan's rows can come through the inbox (inbox.py): every read's
        rows are its values, whole on one rank, and in the model's dtype (router logits may be
        float32 in a bfloat16 model; the inbox holds float32 and gives back the model's dtype)."""
        return (bool(plan.reads) and self.sinks(plan) and self._boards(plan)
                and not any(a.name in _NOT_INBOX for a in plan.reads))

    def _inbox_rows(self, plan: Plan) -> _Rows | None:
        """How ``plan``'s reads lie in the inbox, where their rows can come through it (None
        where they cannot: ``_inboxes``); worked out once per set of reads (a running engine's)."""
        def layout() -> _Rows | None:
            if not self._inboxes(plan):
                return None
            names = tuple(str(a) for a in plan.reads)
            widths = tuple(point_width(self.graph, a.name) for a in plan.reads)
            plain = all(self.spec.vllm[a.name].post is None for a in plan.reads)
            return _Rows(plan.reads, names, widths, dict(zip(names, widths)), plain)
        return memo_get(self._inbox_plans, plan.reads, layout, limit=64)

    def _region(self, rows: int, layout: _Rows, held: bool) -> _Region | None:
        """A region of the inbox for ``rows`` rows of each of ``layout``'s reads (None: no
        room); ``held``: a generation's (Inbox.take). Holding _wake."""
        if not held:  # a one-token capture: beside the requests added just before it (Inbox.rows)
            shared = self._inbox.rows(layout.widths, rows)
            if shared is not None:
                slab, at = shared
                return _Region(slab.start, slab.nbytes, at, layout, slab=slab)
        at, size = [], 0
        for width in layout.widths:
            at.append(size)
            size += 4 * rows * width
        start = self._inbox.take(size, held)
        if start is None:
            return None
        return _Region(start, size, tuple(start + o for o in at), layout, held)

    def _give_region(self, region: _Region) -> None:
        """``region`` back to the inbox (holding _wake): its slab's rows, or its own bytes."""
        if region.slab is not None:
            self._inbox.leave(region.slab)
        else:
            self._inbox.give(region.start, region.nbytes, region.held)

    def _region_done(self, request: _Request) -> None:
        """Nobody reads ``request``'s inbox region any more: it is free once no worker can write
        into it either (its board slot is back: see _give_slot)."""
        with self._wake:
            if request.region is not None:
                request.region.done = True
                self._free_region(request)

    def _free_region(self, request: _Request) -> None:
        """``request``'s inbox region back, if nobody reads it and no worker can write into it
        (its board slot is back). Holding _wake."""
        region = request.region
        if region is not None and region.done and request.slot is None:
            request.region = None
            if self._inbox is not None:
                self._give_region(region)

    def _kick(self) -> None:
        """Release the queued requests once, at the end of the running event loop's current
        round: requests that arrive together (``asyncio.gather``) then enter the engine's first
        step together, instead of the first alone while the rest wait for the next step (which
        doubles a batch of short requests' time). Only for callers that await their outputs on
        that loop: a synchronous caller blocks it, and releases at once."""
        loop = asyncio.get_running_loop()
        with self._wake:
            if loop in self._kicks:
                return
            self._kicks.add(loop)

        def kick():
            with self._wake:
                self._kicks.discard(loop)
            self._release()
        loop.call_soon(kick)

    def _release(self) -> None:
        """Hand every queued request to the engine at once, and wake the driver. One request
        alone, released while a multiprocess engine's driver is between steps (not holding
        _lock), goes to the engine from this thread: its engine core starts on it while the
        driver thread wakes (a thread wake-up, about 0.1 ms on a busy machine, is then off the
        request's path). Several at once are the driver's to add: added from here, the engine
        core started its forward before the rest had arrived and split a gathered batch of 16
        prefills into two forwards in 75% of rounds, against 25% when the driver adds them
        (measured on the tiny model). Inside a step, the driver adds them before its next one."""
        with self._wake:
            self._incoming += self._queued
            self._queued = []
            alone = len(self._incoming) == 1
        if alone and not self.in_process and self._lock.acquire(blocking=False):
            try:
                if self._llm is not None and self._incoming:
                    self._admit(self._llm)
            finally:
                self._lock.release()
        self._ensure_driver()

    def _admit(self, llm) -> None:
        """Hand the released requests to the engine (the pump, holding _lock, before a step).
        A request the engine refuses gets the engine's own exception through its sink."""
        with self._wake:
            incoming, self._incoming = self._incoming, []
        for request, prompt, params in incoming:
            try:
                llm.llm_engine.add_request(request.external_id, prompt, params)
            except Exception as exc:  # vLLM's validation of this request: the caller's to see
                request.finished = request.released = True
                self._give_slot(request)
                request.sink(_Refused(exc))
                continue
            self._requests[request.external_id] = request

    def _ensure_driver(self) -> None:
        if self.in_process:
            return  # an in-process engine is stepped by its callers (see _pump)
        with self._wake:
            if self._driver is None or not self._driver.is_alive():
                self._driver = threading.Thread(target=self._drive, name="interp-engine-vllm-driver", daemon=True)
                self._driver.start()
            if self._watchdog is None or not self._watchdog.is_alive():
                self._watchdog = threading.Thread(target=self._watch, name="interp-engine-vllm-watchdog",
                                                  daemon=True)
                self._watchdog.start()
            self._wake.notify_all()

    def _pump(self) -> int:
        """One engine step, each output handed to its request: ``IDLE`` (0, false) if nothing
        was in flight, ``HANDED`` if some request's sink got something, else ``STEPPED``.

        A multiprocess engine is pumped by the driver thread (the model runs in the worker
        processes; this thread only moves outputs). An in-process engine runs the model in the
        thread that steps it, and vLLM's CPU attention insists on the OpenMP setup of the thread
        that built the engine, so there the callers pump it themselves, one at a time."""
        with self._lock:
            llm = self._llm
            if llm is None:
                return IDLE
            if self._incoming:
                self._admit(llm)
            if not llm.llm_engine.has_unfinished_requests():
                if self._held:  # those it waited for were aborted: collect now
                    held, self._held = self._held, []
                    self._settle_and_deliver(llm, held)
                    return HANDED
                return IDLE
            try:
                outputs = llm.llm_engine.step()
            except BaseException as exc:  # a failed step fails every waiting request, loudly
                self._fail_all(exc)
                return HANDED
            delivered, ended = [], []  # ended: (request, its last output), to collect first
            for out in outputs:
                request = self._requests.get(out.request_id)
                if request is None:
                    continue
                request.generated += len(out.outputs[0].token_ids)
                if out.finished:
                    request.finished = True
                    self._requests.pop(out.request_id, None)
                    if not request.plan.empty and not request.released and not request.deferred:
                        if request.slot is not None and self._board.ok(request.slot):
                            # every worker served its writes (board.py): nothing to collect, and
                            # the workers free it themselves
                            request.released, request.settled = True, []
                            self._give_slot(request)
                        else:
                            ended.append((request, out))
                            continue
                delivered.append((request, out))
            held, self._held = self._held, []
            if ended and not held and self._collects_next_step():
                # others end at the next step (a gathered batch the engine split in two, requests
                # a step apart): their collect rpc takes these too, one step later, instead of two
                self._held, ended = ended, []
            if not (held or ended or delivered):
                return STEPPED  # (non-streaming requests get nothing until they end)
            self._settle_and_deliver(llm, held + ended, delivered)
        return HANDED

    def _pump_on(self) -> None:
        """Steps of an in-process engine on an event loop's thread, without a trip through the
        loop after a step that handed nothing to anyone (requests that want only their whole
        result get nothing until they end): nothing on the loop waits for such a step, and the
        trip costs about as much per step as the pump's own bookkeeping. The loop gets its turn
        after an output, or once ``_PUMP_TURN`` seconds have gone by: new requests, cancels and
        other tasks wait no longer than that (plus a step)."""
        if self._pump() != STEPPED:
            return
        until = time.perf_counter() + _PUMP_TURN
        while self._pump() == STEPPED and time.perf_counter() < until:
            pass

    def _collects_next_step(self) -> bool:
        """Whether a request in the engine whose answer is collected ends at the next step."""
        return any(not r.plan.empty and not r.deferred and r.slot is None and r.generated >= r.max_tokens - 1
                   for r in self._requests.values())

    def _settle_and_deliver(self, llm, ended: list[tuple[_Request, Any]], delivered: list = ()) -> None:
        """Collect the workers' answers for these finished requests (one rpc), then hand each
        its last output, and the other ``delivered`` outputs theirs. Holding _lock."""
        if ended:
            self._collect(llm, [request for request, _ in ended])
        _deliver(ended + list(delivered))

    def _collect(self, llm, ended: list[_Request]) -> None:
        """The workers' captures (or status) of every request that finished in this step, in
        one rpc; each request is freed in the workers. Called between steps, holding _lock."""
        items = [(r.rid, r.prompt_len + r.generated - 1 if r.capture is not None else 0) for r in ended]
        spill_to = self._spill_to(ended)
        if self.in_process and self.world == 1:
            args = (items, None, True)  # its one worker answers with tensors: nothing is serialized
        else:
            args = (items,) if spill_to is None else (items, spill_to)
        try:
            answers: list | BaseException = llm.collective_rpc("interp_collect_many", args=args)
        except BaseException as exc:  # reported to each of these requests by _settle
            answers = exc
        if spill_to is not None:
            try:
                self._spill.take(spill_to, answers)
            except Exception as exc:
                answers = exc
        for i, request in enumerate(ended):
            request.released = True
            request.settled = answers if isinstance(answers, BaseException) else [a[i] for a in answers]
            self._give_slot(request)

    def _spill_to(self, ended: list[_Request]) -> str | None:
        """Where the workers may write these requests' rows (spill.py): worth it for a
        multiprocess engine's captures of at least ``MIN_BYTES``; None for an in-process one
        (its answers are not serialized) or smaller captures (the workers would not use it)."""
        if self._spill is None:
            return None
        from .spill import MIN_BYTES

        try:
            size = self.dtype.itemsize * sum((r.prompt_len + r.generated - 1)
                                             * sum(point_width(self.graph, a.name) for a in r.plan.reads)
                                             for r in ended if r.capture is not None)
            return self._spill.make() if size >= MIN_BYTES else None
        except Exception:  # an estimate it cannot make, or no room for an empty file:
            return None  # the rows come in the answers

    def _give_slot(self, request: _Request) -> None:
        """``request``'s board row back, once no worker can write for it any more (it ended and
        was settled or collected, or its release rpc returned); its inbox region too, if read."""
        if request.slot is not None:
            slot, request.slot = request.slot, None
            with self._wake:
                if self._board is not None:
                    self._board.give(slot)
                self._free_region(request)

    def _drive(self) -> None:
        """The driver thread of a multiprocess engine: pump while requests are in flight."""
        while True:
            with self._wake:
                while not self._stop and not self._requests and not self._incoming and not self._held:
                    self._wake.wait()
                if self._stop:
                    return
            if not self._pump():
                with self._wake:
                    self._wake.wait(timeout=0.005)

    def _watch(self) -> None:
        """The watchdog of a multiprocess engine. When its engine core process dies (a crash, the
        OOM killer), vLLM's liveness monitor marks the client dead, but a step already waiting for
        that core's outputs waits forever. This hands that step vLLM's own EngineDeadError, so the
        driver fails every waiting request with it instead of hanging them."""
        while True:
            with self._wake:
                self._wake.wait(timeout=0.5)
                if self._stop:
                    return
            llm = self._llm
            if llm is None or not _core_died(llm):
                continue
            from vllm.v1.engine.exceptions import EngineDeadError

            self._dead = True
            outputs = getattr(llm.llm_engine.engine_core, "outputs_queue", None)
            if outputs is not None:
                outputs.put_nowait(EngineDeadError())  # the driver's step raises it: _fail_all
            else:
                with self._lock:
                    self._fail_all(EngineDeadError())
            with self._wake:
                self._wake.notify_all()
            return

    def _fail_all(self, exc: BaseException) -> None:
        with self._wake:
            waiting = [item[0] for item in self._incoming + self._queued]
            self._incoming, self._queued = [], []
        waiting += list(self._requests.values()) + [request for request, _ in self._held]
        self._requests.clear()
        self._held = []
        for request in waiting:
            request.finished = True
            request.sink(exc)

    def _abort(self, request: _Request) -> None:
        """Leave nothing of ``request`` in the engine or the workers (a cancel, an error)."""
        if request.region is not None:
            self._region_done(request)  # (freed once no worker can write into it)
        if request.finished and (request.released or request.plan.empty):
            # the usual end: nothing left anywhere. Taking _lock here would wait out the step the
            # driver is running, and an async caller would block its event loop for that long.
            return
        with self._wake:
            if any(item[0] is request for item in self._incoming + self._queued):
                self._incoming = [item for item in self._incoming if item[0] is not request]
                self._queued = [item for item in self._queued if item[0] is not request]
                request.finished = True
        with self._lock:
            self._held = [item for item in self._held if item[0] is not request]  # nobody waits for it
            if not request.finished and self._llm is not None:
                request.finished = True
                self._requests.pop(request.external_id, None)
                self._llm.llm_engine.abort_request([request.external_id])
            if not request.released and not request.plan.empty and self._llm is not None and not self._dead:
                request.released = True
                self._llm.collective_rpc("interp_release", args=(request.rid,))
                self._give_slot(request)

    def _step_failed(self) -> RuntimeError:
        if self._dead:
            return RuntimeError("the vLLM engine core died while serving this request (its log above says "
                                "why); this model serves nothing more: close it and load the model again")
        return RuntimeError("the vLLM engine step failed")

    def _settle(self, request: _Request) -> None:
        """A request that ended: fetch its captures (or just its status) and free it in the
        workers; raise if the runtime failed while serving it."""
        if request.plan.empty or (request.settled is None and request.released):
            return
        results = self._answers(request, request.prompt_len + request.generated - 1
                                if request.capture is not None else 0)
        if request.capture is not None:
            self._captured(request, results, request.capture)

    def _captured(self, request: _Request, results: list, capture: _Capture) -> None:
        """An ended request's rows into ``capture``: those the workers answered with, and those
        they wrote into its inbox region (all of them, when the board said so and nothing was
        collected: then, where no read needs reshaping, read straight into their final shape)."""
        region = request.region
        if region is None:
            capture.values = self._shaped(request.plan.reads, merge_ranks(request.plan.reads, results))
            return
        sent = {key for r in results for key in r.get("values", {})}
        rows = request.prompt_len + request.generated - 1
        layout = region.rows
        if not sent and layout.plain:
            capture.values = self._inbox.read_batched(layout.reads, region.at, rows, layout.widths, self.dtype)
        else:
            values = merge_ranks([a for a in layout.reads if str(a) in sent], results) if sent else {}
            for a, name, at, width in zip(layout.reads, layout.names, region.at, layout.widths):
                if name not in sent:
                    values[a] = self._inbox.read(at, rows, width, self.dtype)
            capture.values = self._shaped(layout.reads, values)
        self._region_done(request)

    def _shaped(self, reads: tuple[Address, ...], rows: dict[Address, torch.Tensor]) -> dict[Address, torch.Tensor]:
        """One request's ``[rows, ...]`` of each read, in ``reads`` order, as a capture returns
        them: each point in its own shape (heads split out, a pattern's keys), a batch of one."""
        values = {}
        for address in reads:
            t = rows[address]
            post = self.spec.vllm[address.name].post
            if post is not None:  # (a point whose rows are its values as they are: most, in a capture loop)
                t = reshape_point(t, post, self.graph, (t.shape[0],))
            values[address] = t.unsqueeze(0)
        return values

    def _answers(self, request: _Request, n: int) -> list:
        """The workers' answers for an ended request (collected by the pump, or now, for ``n``
        rows), raising if collecting failed or the runtime failed while serving it."""
        results = request.settled
        if results is None:  # the pump did not collect it: do it now
            results = self.rpc("interp_collect", request.rid, n)
            request.released = True
            self._give_slot(request)
        elif isinstance(results, BaseException):
            raise RuntimeError("collecting this request's captures from the vLLM workers failed") from results
        errors = [r.get("error") for r in results if r.get("found") and r.get("error")]
        if errors:
            raise RuntimeError(f"the interp_engine runtime failed for this request: {errors[0]}")
        return results

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
                 capture: _Capture | None = None, embeds: torch.Tensor | None = None) -> Iterator[RawStep]:
        """Synchronous generation: the driver thread steps the engine; this waits for its outputs."""
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        request = self._add(prompt, config, plan, capture, outputs.put, embeds)
        self._release()
        try:
            while True:
                if self.in_process:
                    while outputs.empty():
                        if not self._pump() and outputs.empty():
                            raise RuntimeError("the vLLM engine holds no work for a request still waiting")
                out = outputs.get()
                if isinstance(out, _Refused):
                    raise out.exc
                if isinstance(out, BaseException):
                    raise self._step_failed() from out
                if out.finished:
                    self._settle(request)
                yield from self._raw_steps(out, config.n_logprobs)
                if out.finished:
                    return
        finally:
            self._abort(request)

    async def agenerate(self, prompt: list[int] | None, config: SamplingConfig, plan: Plan,
                        capture: _Capture | None = None, embeds: torch.Tensor | None = None,
                        streaming: bool = True) -> AsyncIterator[list[RawStep]]:
        """Asynchronous generation on any event loop: concurrent requests share engine steps."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        request = self._add(prompt, config, plan, capture, _LoopQueue(loop, outputs), embeds, streaming=streaming)
        self._kick()
        try:
            while True:
                if self.in_process:
                    while outputs.empty():
                        # yield first: the requests gathered with this one queue theirs, and the
                        # kick releases them all, before this loop's thread steps the engine
                        await asyncio.sleep(0)
                        self._pump_on()
                out = await outputs.get()
                if isinstance(out, _Refused):
                    raise out.exc
                if isinstance(out, BaseException):
                    raise self._step_failed() from out
                if out.finished:
                    if request.settled is None and not request.plan.empty and not request.released:
                        # not collected by the pump: an rpc, off the event loop (an executor
                        # thread: not for requests without a plan, which have nothing to fetch)
                        await loop.run_in_executor(None, self._settle, request)
                    else:
                        self._settle(request)
                raws = list(self._raw_steps(out, config.n_logprobs))
                if raws:
                    yield raws
                if out.finished:
                    return
        finally:
            self._abort(request)

    def sinks(self, plan: Plan) -> bool:
        """The workers write a harvest plan's rows into its file themselves where each point's
        rows are already its row-major values (not a pattern rebuilt from q | k)."""
        return all(rows_are_values(self.spec.vllm[a.name]) for a in plan.reads)

    def _boards(self, plan: Plan) -> bool:
        """Whether a harvest plan's workers can say on the board that it is served: each writes
        every row of every read into the sink itself (no tensor-parallel slices to send back)."""
        return self.world == 1 or not any(self.spec.vllm[a.name].sharded for a in plan.reads)

    def harvest_into(self, windows: list[list[int]], plan: Plan, max_tokens: int, in_flight: int,
                     path: str, offsets: Callable[[int], dict[str, int]], positions: int
                     ) -> Iterator[tuple[int, list[int], dict[Address, torch.Tensor]]]:
        """Harvest's engine: every window as its own greedy request of ``max_tokens`` tokens,
        ``in_flight`` at once, whose workers write its ``positions`` rows of each read straight
        into the file at ``path`` as they read them (made by the caller, ``offsets(i)``: where
        window ``i``'s rows of each read go), so only small answers cross back. Yields ``(i,
        generated token ids, rows)`` as windows finish (any order), each checked by its workers
        first; ``rows`` holds only what the workers could not write whole (the slices of a point
        sharded over tensor-parallel ranks, joined here).

        A finished window's place goes to the next one at once. One whose workers wrote every row
        themselves says so on the status board (board.py) and needs no answer at all; any other's
        answer is fetched later, in one rpc for up to ``_SETTLE_MAX`` finished windows (and for
        the last ones when nothing else is in flight), so the engine never waits between steps on
        an rpc per step."""
        import collections

        config = SamplingConfig(max_tokens=max_tokens, temperature=0.0, stop_at_eos=False)
        done: queue.SimpleQueue = queue.SimpleQueue()
        todo = collections.deque(range(len(windows)))
        live: dict[int, tuple[_Request, list[int]]] = {}
        ended: list[tuple[int, _Request, list[int]]] = []  # finished in the engine, not yet answered for
        batch = max(1, min(in_flight, _SETTLE_MAX))
        try:
            while todo or live or ended:
                while todo and len(live) < in_flight:
                    i = todo.popleft()
                    sink = {"path": path, "offsets": offsets(i), "positions": positions}
                    request = self._add(windows[i], config, plan, _Capture(), lambda out, i=i: done.put((i, out)),
                                        rows_to=sink, streaming=False)
                    request.deferred = True
                    live[i] = (request, [])
                self._release()  # the windows just queued enter one step together
                if ended and (len(ended) >= batch or not live):
                    self._settle_many([request for _, request, _ in ended])
                    for i, request, tokens in ended:
                        yield i, tokens, self._sunk(request)
                    ended = []
                    continue
                if self.in_process:
                    while done.empty():
                        if not self._pump() and done.empty():
                            raise RuntimeError("the vLLM engine holds no work for a request still waiting")
                i, out = done.get()
                if isinstance(out, _Refused):
                    raise out.exc
                if isinstance(out, BaseException):
                    raise self._step_failed() from out
                request, tokens = live[i]
                tokens.extend(out.outputs[0].token_ids)
                if out.finished:
                    del live[i]
                    if request.slot is not None and self._board.ok(request.slot):
                        # every worker wrote every row into the sink (board.py): nothing to
                        # collect, and the workers free it themselves
                        request.released, request.settled = True, []
                        self._give_slot(request)
                        yield i, tokens, {}
                        continue
                    ended.append((i, request, tokens))
        finally:
            for request, _ in live.values():
                self._abort(request)
            for _, request, _ in ended:
                self._abort(request)

    def _settle_many(self, requests: list[_Request]) -> None:
        """The workers' answers for finished requests their caller collects itself, in one rpc
        between engine steps (an rpc that fails is each request's error, raised by _answers)."""
        llm = self._engine()
        with self._lock:
            self._collect(llm, [r for r in requests if not r.released])

    def _sunk(self, request: _Request) -> dict[Address, torch.Tensor]:
        """A finished harvest request: its workers' answers checked, the rows they sent joined."""
        results = self._answers(request, request.prompt_len + request.generated - 1)
        sent = {key for r in results for key in r.get("values", {})}
        return merge_ranks([a for a in request.plan.reads if str(a) in sent], results)

    def new_capture(self) -> _Capture:
        return _Capture()

    def assemble(self, plan: Plan, capture: _Capture) -> dict[Address, torch.Tensor]:
        if capture.values is None:
            raise RuntimeError("the request ended without its captures (it was cancelled or failed)")
        return capture.values  # (shaped when it ended: _captured)

    def request_output(self, prompt_ids: list[int], steps: list, finish: str, n_logprobs: int | None):
        return full_output(prompt_ids, steps, finish, n_logprobs)

    def run_with_cache(self, plan: Plan, batch: TokenBatch, detach: bool = True, want_logits: bool | str = False,
                       stop_at_layer: int | None = None):
        """``stop_at_layer``: vLLM always runs every layer; the captures (all before that layer,
        checked by the core) are the same, only eager's saving is lost."""
        prompt = batch.row(0)
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"the input has {len(prompt)} positions and this model's context holds "
                             f"{self.max_model_len} (max_model_len): vLLM runs a prompt only with room "
                             f"for one token after it, so pass at most {self.max_model_len - 1} positions")
        final = Address("resid_post", self.graph.n_layers - 1)
        if want_logits == "last":  # the final position's logits: vLLM's own head on its last residual
            if self.name != "vllm" and final not in self.static_points:
                raise CapabilityUnsupported("logits_in_stream", self.name, detail=f"return_logits='last' needs "
                                            f"{final}", instead=f"declare {final} in static_points, or use "
                                            "backend='vllm'")
            plan = plan | Plan(reads=(final,))
        capture = _Capture()
        config = SamplingConfig(max_tokens=1, temperature=0.0, stop_at_eos=False)
        for _ in self.generate(prompt, config, plan, capture):
            pass
        values = self.assemble(plan, capture)
        if want_logits != "last":
            return values, None
        return values, self.decode(values[final][:, -1])

    # ---- where the weights are (inside the workers) ---------------------------------------
    def _rank0(self, results: list):
        found = [r for r in results if r is not None]
        return tensor_from_wire(found[0])

    def decode(self, resid: torch.Tensor) -> torch.Tensor:
        return self._rank0(self.rpc("interp_decode", tensor_to_wire(resid)))

    def head_contributions(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        return self._rank0(self.rpc("interp_heads", layer, tensor_to_wire(z)))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The model's own input embeddings (Gemma 2's sqrt(d_model) scale included)."""
        return self._rank0(self.rpc("interp_embed", [int(i) for i in ids.reshape(-1).tolist()]))

    def worker_stats(self) -> list[dict]:
        """What the runtime in each worker holds (requests, hooked modules): for checks."""
        return self.rpc("interp_stats")


def _core_died(llm) -> bool:
    """vLLM's own mark of a dead engine core, set by its liveness monitor (AsyncLLM.errored reads
    the same mark; LLMEngine has no public reader of it)."""
    resources = getattr(llm.llm_engine.engine_core, "resources", None)
    return bool(getattr(resources, "engine_dead", False))


def _ensure_expert_group() -> None:
    """An in-process engine shares vLLM's process-wide parallel groups, and the expert-parallel
    group exists only if the first engine in the process was an MoE model: create it (same
    ranks as the tensor-parallel group) for an MoE engine started after a dense one."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps._EP is not None:
        return
    tp = ps.get_tp_group()
    ps._EP = ps.init_model_parallel_group([list(tp.ranks)], ps.get_world_group().local_rank,
                                          tp.backend if hasattr(tp, "backend") else "gloo", group_name="ep")


def _closer(llm) -> Callable[[], None]:
    """How to close this engine alone. An in-process engine's own shutdown tears down the
    process-wide parallel state every other in-process engine uses (also when the LLM is merely
    garbage-collected): swap its finalizer for a shutdown of its executor and scheduler only."""
    import weakref

    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)  # the in-process client holds the core itself
    original = getattr(client, "_finalizer", None)
    if core is None or original is None or type(client).__name__ != "InprocClient":
        return functools.partial(_shutdown, client)
    original.detach()

    def soft(core=core):
        core.model_executor.shutdown()
        core.scheduler.shutdown()
    return weakref.finalize(llm, soft)


def _shutdown(client) -> None:
    """A multiprocess engine's ``shutdown``, finished when vLLM's own stops half-way: when an
    engine process does not exit in time, vLLM kills its process tree, asking each child for its
    name first, and a child that exits meanwhile raises ``psutil.NoSuchProcess`` out of the
    shutdown, before the engine process is killed or the client's sockets are closed (seen
    under load at a test session's end). Then the engine's processes left alive are killed here
    and the client's resources are released: ``close`` never leaves an engine behind."""
    import psutil

    try:
        client.shutdown()
    except psutil.NoSuchProcess:
        resources = getattr(client, "resources", None)
        manager = getattr(resources, "engine_manager", None)
        for proc in getattr(manager, "processes", None) or ():
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        if resources is not None:
            resources()  # sockets and tasks (the engine manager's own shutdown is done: a no-op)
