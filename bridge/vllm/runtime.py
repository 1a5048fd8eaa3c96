"""The worker-resident runtime: lives inside each vLLM worker process, next to the model.

Each forward it reads the plans of the requests scheduled in this step (from their
``SamplingParams.extra_args``), maps the flat token rows to requests and absolute positions,
applies the requests' steering and copies their captured rows into per-request buffers
(regions of one arena per point: buffers.py). A hook is installed on a module the first time
any request needs it and stays (no per-step registration); the per-step work is the row map,
and a decode step that holds the same requests at the same rows as the last one reuses the
last one's work (the steering adds in one ``index_add_`` per site, the decode rows of a
point's readers in one ``index_copy_``): only the positions are new. Captures leave through ``collect`` (an rpc the
client calls when its request finished) or are written to the file a request names when it ends;
a harvest request's plan names a sink (a file the client maps, and where its rows go in it): its
rows go there as they are read (sink.py), and ``collect`` answers only whether all of them did.

It holds no client state: only what the requests themselves carry. It never raises into
vLLM's forward: an error while serving one request is recorded against that request (its
client gets it with the captures) and the other requests in the batch go on.

vLLM fuses add + RMSNorm, so a decoder layer returns ``(h, r)`` with resid_post = h + r,
resid_mid = r, mlp_out = h, and takes ``(positions, hidden, residual)`` with
resid_pre = hidden + residual (hidden alone at layer 0).

``pattern`` is never formed by vLLM's kernels: the runtime keeps each request's rows of the
attention kernel's inputs (q | k after rotary embedding) and rebuilds the probabilities from all
of them when the request's captures leave (``attention.pattern_from_rows``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from interp_engine._address import Address
from interp_engine._ops import EVERY_ROW, apply_write, expert_factor, route, select_rows, stored, weight_experts
from specs import ArchSpec, VllmTap

from .board import FAILED, OK, BoardFiles
from .buffers import Arena, Buffer
from .routing import experts_path
from .sink import SinkFiles, SinkWriter, rows_are_values, write_rows
from .wire import WirePlan, plan_from_args, plan_rid, process_registry, tensor_to_wire

__all__ = ["Runtime"]

log = logging.getLogger("interp_engine.vllm")

# what the layer / module hooks read or write, by tap source
_PRE_SOURCES = ("layer_in", "fused_in_sum", "module_in", "attn_qk")
_ROUTE_SOURCES = frozenset({"route_weights", "route_indices"})
_FINISHED_KEEP = 4096  # finished requests whose captures wait for their client, at most


@dataclass(eq=False)
class _Request:
    """One request's plan and state inside this worker."""

    plan: WirePlan
    prompt_len: int
    vectors: list[torch.Tensor] = field(default_factory=list)  # effective vectors on the device
    columns: list[torch.Tensor | None] = field(default_factory=list)  # each write's selected columns
    buffers: dict[Address, Buffer] = field(default_factory=dict)
    error: str | None = None
    capacity: int = 16  # positions it can reach (prompt + max_tokens): each buffer's first size
    # its work at each hooked site, worked out once: (site, before the module?, entry without rows)
    work: list[tuple[_Site, bool, tuple]] | None = None
    # a harvest request's rows, written into its sink as they are read (sink.py); None: not yet
    # opened, False: not writable here (another machine's file: its rows are buffered instead)
    sink: SinkWriter | None | bool = None
    # its status byte on the client's board (board.py): called with OK once served (a write-only
    # plan: admitted; a harvest plan: every row in its sink), FAILED when serving it fails;
    # None: the client collects its status by rpc
    report: Callable[[int], object] | None = None
    served: bool = False  # OK is on the board: nobody collects it, the runtime frees it itself
    sunk: set = field(default_factory=set)  # a harvest plan on the board: reads whose rows are all in
    # its sink asks to hold the rows (WireSink.hold): buffered as they are read, each read's rows
    # written into the sink at once by the forward that reads its last position (flush_held)
    held: bool = False

    def fail(self, error: str) -> None:
        """Serving this request failed (the first error is the one kept): its client's to see."""
        if self.error is None:
            self.error = error
        if self.report is not None:
            self.report(FAILED)

    def drop(self) -> None:
        """Let its captured rows go (and its sink file)."""
        for buffer in self.buffers.values():
            buffer.drop()
        self.buffers.clear()
        if self.sink:
            self.sink.close()


class _Wrapped:
    """A module whose ``forward`` runs ``pre(module, args, kwargs)`` first (its returned
    ``(args, kwargs)``, if any, replace the call's); ``remove`` restores the class's own."""

    def __init__(self, module: nn.Module, pre: Callable) -> None:
        self.module = module
        original = module.forward

        def forward(*args, **kwargs):
            changed = pre(module, args, kwargs)
            if changed is not None:
                args, kwargs = changed
            return original(*args, **kwargs)

        module.forward = forward

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


class _RouterWrapped:
    """vLLM's MoE router of one layer, whose ``select_experts`` returns ``(weights, ids)`` to
    the fused experts: ``post(weights, ids)`` may return new weights. ``remove`` restores it."""

    def __init__(self, router: Any, post: Callable) -> None:
        self.router = router
        original = router.select_experts

        def select_experts(*args, **kwargs):
            weights, ids = original(*args, **kwargs)
            return post(weights, ids), ids

        router.select_experts = select_experts

    def remove(self) -> None:
        self.router.__dict__.pop("select_experts", None)


@dataclass
class _Site:
    """A module the runtime has hooked, and this forward's work at it."""

    module: nn.Module
    handles: list = field(default_factory=list)
    pre: list = field(default_factory=list)  # [(kind, source, request, index, s, e)]
    post: list = field(default_factory=list)


def _next_rows(buffers: list[Buffer], positions: list[int]) -> tuple[list[int], list[Buffer], list[int]]:
    """Of readers' buffers and the position each reads in this decode step: the arena rows of
    those whose position is the next they expect and fits their region, those buffers, and the
    indices of the others (to be read on their own)."""
    at, taken, rest = [], [], []
    for i, (buffer, p) in enumerate(zip(buffers, positions)):
        if p == buffer.covered and p < buffer.size and buffer.start >= 0 and not buffer.gaps:
            at.append(buffer.start + p)
            taken.append(buffer)
        else:
            rest.append(i)
    return at, taken, rest


def _advance(taken: list[Buffer]) -> None:
    """Each of these buffers got its next position's row."""
    for buffer in taken:
        buffer.covered += 1
        if buffer.covered > buffer.filled:
            buffer.filled = buffer.covered


class _DecodeRun:
    """Readers of one point in a steady decode, each taking one row per step into its arena
    region: the step's arena rows are each region's start plus the position read, so the whole
    step is one ``index_copy_`` and one comparison of positions, with no Python per reader but
    the count of rows each buffer holds. Built on a step where every one of them took the next
    row of its region (``_next_rows``), it serves the steps after while its caller's layout holds
    (the same readers at the same rows of the forward) and each reader reads the position after
    last step's, inside its region; ``step`` declines anything else (the caller goes the long way)."""

    __slots__ = ("arena", "buffers", "index", "expect", "at", "room", "which", "n")

    def __init__(self, arena: Arena, buffers: list[Buffer], rows: np.ndarray, positions: list[int],
                 which: torch.Tensor | None) -> None:
        self.arena, self.buffers, self.which, self.n = arena, buffers, which, len(buffers)
        lo = int(rows[0])
        contiguous = bool((rows == np.arange(lo, lo + len(rows))).all())
        self.index = slice(lo, lo + len(rows)) if contiguous else rows  # the forward's rows they read
        pos = np.asarray(positions, dtype=np.int64)
        self.expect = pos + 1
        # the arena rows written last: each step writes the ones after (regions do not move)
        self.at = torch.from_numpy(np.array([b.start for b in buffers], dtype=np.int64) + pos)
        self.room = int((np.array([b.size for b in buffers]) - self.expect).min())  # steps that still fit

    def step(self, positions: np.ndarray, rows: torch.Tensor) -> bool:
        """This step's rows (``which`` of ``rows``, or its first ``n``) into the regions, if the
        readers read the positions after last step's; False (and nothing done) otherwise."""
        if self.room <= 0:
            return False
        pos = positions[self.index]
        # compared as bytes: np.array_equal cost about 16 us a call inside the engine
        if pos.tobytes() != self.expect.tobytes() and (pos.dtype == self.expect.dtype
                                                       or not np.array_equal(pos, self.expect)):
            return False
        self.at.add_(1)
        self.arena.put(self.at, (rows if rows.shape[0] == self.n else rows[:self.n]) if self.which is None
                       else rows.index_select(0, self.which))
        _advance(self.buffers)
        self.expect = pos + 1
        self.room -= 1
        return True


class Runtime:
    """Per worker process. ``install`` once after the model is loaded."""

    def __init__(self, runner: Any, spec: ArchSpec, store_captures: bool = True, rank: int = 0,
                 rank_shards: frozenset[str] = frozenset()) -> None:
        self.runner = runner
        self.rank = rank  # this worker's tensor-parallel rank: its byte of a status board row
        self.root: nn.Module = runner.model
        self.spec = spec
        self.store_captures = store_captures  # False on tensor-parallel ranks > 0 for replicated points
        self.rank_shards = rank_shards  # point names stored on every rank (sharded taps)
        self._sinks_by_name: dict[str, bool] = {}  # _sinks, per point name (fixed for a worker)
        self.registry = process_registry()
        self.decoded: dict = {}  # steering ops decoded from plans, by content (wire.plan_from_args)
        self.requests: dict[str, _Request | None] = {}  # vLLM req id -> state (None: no plan)
        self.by_rid: dict[str, _Request] = {}  # the plan's own rid -> state
        self.finished: collections.OrderedDict[str, _Request] = collections.OrderedDict()
        self.released: collections.OrderedDict[str, None] = collections.OrderedDict()  # never admit again
        self.sites: dict[str, _Site] = {}
        self.positions: torch.Tensor | None = None
        self.pos_np = None  # the same positions as a numpy view (cheap ints in the hooks)
        self.active: list[tuple[_Request, int, int]] = []
        self._layout: tuple | None = None  # the last forward's (request ids, row starts)
        self._stale = True  # lay the next forward out afresh even if its layout is the last one's
        self.quiet = False  # between steps, running vLLM's modules for the client (off_step)
        self._reading = False  # some request of the laid-out forward captures
        self._worked: dict[tuple[int, str], tuple] = {}  # each site's work, worked out (_apply)
        self.arenas: dict[Address, Arena] = {}  # each point's rows, for all its readers (buffers.py)
        # each compiled tap's steady decode: (the readers it was built for, the run, the others)
        self._runs: dict[Address, tuple[list, _DecodeRun, list]] = {}
        self.sink_files = SinkFiles()  # harvest sink files open for writing (sink.py)
        self.boards = BoardFiles()  # the clients' status boards (board.py)
        self.lock = threading.Lock()
        self.device = next(self.root.parameters()).device
        self.dtype = next(self.root.parameters()).dtype
        self.steps = 0
        self.forward_rows: collections.deque[int] = collections.deque(maxlen=1024)  # for checks
        self.static = None  # vllm-static: the declared taps compiled into the graph (static_taps)
        self.routing: tuple[int, bool] | None = None  # MoE (top_k, renormalize): bridge/vllm/routing.py
        self._graph = None  # the model's sizes, for the parts of fused outputs (see ``graph``)
        self._holding = False  # some request of the laid-out forward holds its rows (flush_held)
        self._handle = self.root.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        self._after = self.root.register_forward_hook(self._after_forward)

    @property
    def graph(self):
        """The model's graph (its sizes), built from vLLM's HF config on first use: the widths of
        the parts of a fused output (q | k | v of qkv_proj, gate | up of gate_up_proj)."""
        if self._graph is None:
            self._graph = self.spec.graph_from_config(self.runner.model_config.hf_config)
        return self._graph

    @contextlib.contextmanager
    def off_step(self):
        """A computation between engine steps through vLLM's own modules (the lens's final norm
        and head, one layer's o_proj per head, the embeddings): the hooked sites and compiled
        taps and steering sites on those modules still hold the last step's rows, and must not
        take this computation's rows for some request's (nor steer them)."""
        self.quiet = True
        if self.static is not None:
            self.static.fill([], None)  # (the next step fills its own maps again)
            self._stale = True
        try:
            yield
        finally:
            self.quiet = False

    # ---- per forward: which rows belong to which request --------------------------------
    def _on_forward(self, module, args, kwargs):
        try:
            self._map_rows(kwargs.get("positions", args[1] if len(args) > 1 else None))
        except Exception as exc:  # never into vLLM's forward
            log.exception("interp_engine runtime: row map failed")
            for request, _, _ in self.active:
                request.fail(f"row map failed: {exc!r}")
            self._clear_sites()
            self.active = []
            self._stale = True
            if self.static is not None:
                self.static.fill([], None)
        return None

    def _map_rows(self, positions: torch.Tensor | None) -> None:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        ids = batch.req_ids[:num_reqs]
        self.steps += 1
        if positions is not None:
            self.forward_rows.append(int(positions.shape[0]))
        if self.requests:
            self._sweep()
        starts = runner.query_start_loc.np[: num_reqs + 1].tolist()
        layout = (tuple(ids), tuple(starts))
        # a decode step usually holds the same requests' rows where the last one did: then the
        # sites' work (and each site's worked-out writes and reads) carries over, and only the
        # positions are new
        if layout != self._layout or self._stale or any(r.error is not None for r, _, _ in self.active):
            self._lay_out(ids, starts)
            self._layout, self._stale = layout, False
        if not self.active:
            self.positions = None
            if self.static is not None:
                self.static.fill([], None)
            return
        if self.static is not None and not self._reading and self.static.keeps(self.active):
            # compiled writes on rows the maps already hold, and nothing read: no positions needed
            self.positions = self.pos_np = None
            self.static.fill(self.active, None)
            return
        # positions is a persistent buffer vLLM rewrites every step: copy it
        self.positions = positions.detach().to("cpu", copy=True) if positions is not None else None
        self.pos_np = self.positions.numpy() if self.positions is not None else None
        if self.static is not None:  # row maps for the compiled taps instead of hook work
            self.static.fill(self.active, self.positions)

    def _lay_out(self, ids: list[str], starts: list[int]) -> None:
        """Which requests' rows this forward holds, and each hooked site's work for them."""
        self._clear_sites()
        self._worked = {}
        self._runs = {}
        self.active = []
        for j, req_id in enumerate(ids):
            request = self.requests.get(req_id, False)
            if request is False:
                request = self.requests[req_id] = self._admit(req_id)
            if request is None or request.error is not None:
                continue
            self.active.append((request, starts[j], starts[j + 1]))
        self._reading = any(request.plan.reads for request, _, _ in self.active)
        self._holding = any(request.held for request, _, _ in self.active)
        if self.static is None:
            for request, s, e in self.active:
                self._plan_rows(request, s, e)

    def _admit(self, req_id: str) -> _Request | None:
        state = self.runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) if params is not None else None
        if not extra:
            return None
        try:
            plan = plan_from_args(extra, registry=self.registry, rid=req_id, memo=self.decoded)
        except Exception as exc:
            plan = WirePlan(plan_rid(extra, req_id), (), ())
            request = _Request(plan, 0, error=f"bad plan: {exc}")
            self.by_rid[plan.rid] = request
            return request
        if plan is None or plan.empty or plan.rid in self.released:
            return None  # no plan, or its client already let it go (a cancel racing the scheduler)
        request = _Request(plan, int(state.num_prompt_tokens))
        # buffers start at the request's full length (a long one grows by doubling past 256 more)
        request.capacity = max(16, request.prompt_len + min(256, int(getattr(params, "max_tokens", 0) or 0)))
        try:
            request.vectors = [op.vector.to(self.device, self.dtype) for op in plan.writes]
            request.columns = [self._columns(op) for op in plan.writes]
            if self.static is not None:
                self.static.admit(request)  # (compiled in: no hooked sites)
            else:
                for address in plan.reads:
                    tap = self._tap(address.name, False)
                    self._site(tap.module_path(address.layer), wrap=tap.source == "attn_qk")
                for op in plan.writes:
                    if op.experts is not None:
                        self._router_site(op.address.layer)
                    else:
                        self._site(self._tap(op.address.name, True).module_path(op.address.layer))
        except Exception as exc:
            request.error = f"cannot serve this plan here: {exc!r}"
        if request.error is None and request.plan.board is not None:
            path, at = request.plan.board
            mark = functools.partial(self.boards.mark, path, at + self.rank)
            reads = request.plan.reads
            if request.plan.sink is None or (not self.store_captures and not any(a.name in self.rank_shards
                                                                                 for a in reads)):
                # write-only, or a harvest plan on a tensor-parallel rank > 0 (rank 0 writes the rows
                # every rank holds whole): served once admitted
                if mark(OK):
                    request.report, request.served = mark, True
            elif all(self._sinks(a) for a in reads) and mark(0):
                request.report = mark  # a harvest plan: OK once its last rows are in the sink
                request.held = request.plan.sink.hold
        self.by_rid[plan.rid] = request
        return request

    def _columns(self, op) -> torch.Tensor | None:
        """The columns of the hooked tensor ``op`` writes: its selected heads or neurons (every
        column with no selector), placed inside their part of a fused output (q of qkv_proj)."""
        if op.experts is not None:  # the experts whose routing weights it zeroes or scales
            return torch.tensor(op.experts, device=self.device)
        split = self._tap(op.address.name, True).split
        if split is None:
            return None if op.columns is None else torch.tensor(op.columns, device=self.device)
        return torch.tensor(split.columns(self.graph, op.columns), device=self.device)

    def _tap(self, name: str, writing: bool) -> VllmTap:
        if writing and name in self.spec.vllm_writes:
            return self.spec.vllm_writes[name]
        return self.spec.vllm[name]

    def _plan_rows(self, request: _Request, s: int, e: int) -> None:
        work = request.work
        if work is None:
            work = request.work = self._work(request)
        for site, pre, entry in work:
            (site.pre if pre else site.post).append(entry + (s, e))

    def _work(self, request: _Request) -> list[tuple[_Site, bool, tuple]]:
        """What ``request`` asks of each hooked site, in plan order: writes, then reads."""
        work = []
        for i, op in enumerate(request.plan.writes):
            if op.experts is not None:
                work.append((self._router_site(op.address.layer), False, ("w", "route_write", request, i)))
                continue
            tap = self._tap(op.address.name, True)
            site = self.sites[tap.module_path(op.address.layer)]
            work.append((site, tap.source in _PRE_SOURCES, ("w", tap.source, request, i)))
        if not self.store_captures:
            reads = [a for a in request.plan.reads if a.name in self.rank_shards]
        else:
            reads = request.plan.reads
        for address in reads:
            tap = self._tap(address.name, False)
            site = self.sites[tap.module_path(address.layer)]
            work.append((site, tap.source in _PRE_SOURCES, ("r", tap.source, request, address)))
        return work

    def _clear_sites(self) -> None:
        for site in self.sites.values():
            if site.pre:
                site.pre = []
            if site.post:
                site.post = []

    # ---- hooks: installed once per module, on first use ---------------------------------
    def _site(self, path: str, wrap: bool = False) -> _Site:
        """``wrap``: run the site's pre work from a wrapper of the module's ``forward`` instead of
        hooks (vLLM's Transformers backend calls its Attention modules' ``forward`` directly, past
        any hook)."""
        site = self.sites.get(path)
        if site is None:
            module = self.root.get_submodule(path)
            site = self.sites[path] = _Site(module)
            if wrap:
                site.handles.append(_Wrapped(module, self._pre_hook(site)))
            else:
                site.handles.append(module.register_forward_pre_hook(self._pre_hook(site), with_kwargs=True))
                site.handles.append(module.register_forward_hook(self._post_hook(site)))
        return site

    def _router_site(self, layer: int) -> _Site:
        """The MoE layer whose router's selection an experts= write scales (routing.py checked
        at start-up that the fused experts weight each expert's output by it)."""
        path = experts_path(self.spec, layer)
        site = self.sites.get(path + "#router")  # its own site: hooks on the module are another's
        if site is None:
            module = self.root.get_submodule(path)
            site = self.sites[path + "#router"] = _Site(module)

            def post(weights, ids):
                return self._run_route(site, weights, ids) if site.post else weights
            site.handles.append(_RouterWrapped(module.router, post))
        return site

    def _run_route(self, site: _Site, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The requests' experts= writes on the routing weights ``[rows, top_k]`` of this step."""
        writes = [w for w in site.post if w[2].error is None]
        if not writes:
            return weights
        if self.positions is None or weights.shape[0] != self.positions.shape[0]:
            for w in writes:  # rows that are not this forward's tokens: never guess which is whose
                self._failed(w[2], RuntimeError(
                    f"the MoE router saw {weights.shape[0]} rows, the forward "
                    f"{None if self.positions is None else self.positions.shape[0]}"))
            return weights
        new = weights.clone()
        for _, _, request, i, s, e in writes:
            self._guard(request, self._write_experts, request, i, new, ids, s, e)
        return new

    def _write_experts(self, request: _Request, i: int, weights: torch.Tensor, ids: torch.Tensor,
                       s: int, e: int) -> None:
        op = request.plan.writes[i]
        sel = select_rows(op.positions, op.per_position, self.positions[s:e], request.prompt_len)
        if sel.empty:
            return
        weights[s:e] = weight_experts(weights[s:e], ids[s:e], request.columns[i],
                                      expert_factor(op.op, op.scale), sel)

    def _pre_hook(self, site: _Site) -> Callable:
        def hook(module, args, kwargs):
            if not site.pre or self.quiet:
                return None
            return self._run_pre(site, args, kwargs)
        return hook

    def _post_hook(self, site: _Site) -> Callable:
        def hook(module, args, out):
            if not site.post or self.quiet:
                return None
            return self._run_post(site, out)
        return hook

    def _guard(self, request: _Request, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self._failed(request, exc)

    @staticmethod
    def _failed(request: _Request, exc: Exception) -> None:
        log.exception("interp_engine runtime: request %s failed", request.plan.rid)
        request.fail(f"{type(exc).__name__}: {exc}")

    def _write(self, request: _Request, i: int, x: torch.Tensor, s: int, e: int,
               base: torch.Tensor | None) -> None:
        op = request.plan.writes[i]
        sel = select_rows(op.positions, op.per_position, self.positions[s:e], request.prompt_len)
        if sel.empty:
            return
        x[s:e] = apply_write(op.op, x[s:e], request.vectors[i], sel, None if base is None else base[s:e],
                             cols=request.columns[i])

    def _together(self, writes: list) -> tuple[list, list, list] | None:
        """The writes that add a vector at every position of their request (steering's usual
        op), each the only write of its request here, to be done as one add per run of
        consecutive rows (the same sums the one-by-one writes make; ``index_add_`` on a CPU
        tensor adds row by row, and a write on its own selects its positions every step):
        ``(runs: [(first row, end row, vectors per row)], those writes, the other writes)``;
        None if there is no such write."""
        mine = collections.Counter(id(w[2]) for w in writes)
        together, rest = [], []
        for w in writes:
            op = w[2].plan.writes[w[3]]
            simple = (op.op == "add" and op.positions == "all" and op.columns is None and not op.per_position
                      and mine[id(w[2])] == 1)
            (together if simple else rest).append(w)
        if not together:
            return None
        spans = sorted(((s, e, request.vectors[i]) for _, _, request, i, s, e in together), key=lambda t: t[0])
        runs: list[tuple[int, int, list]] = []
        for s, e, vector in spans:
            if runs and runs[-1][1] == s:
                runs[-1] = (runs[-1][0], e, runs[-1][2] + [(e - s, vector)])
            else:
                runs.append((s, e, [(e - s, vector)]))
        return [(s, e, torch.cat([v.expand(n, -1) for n, v in parts])) for s, e, parts in runs], together, rest

    def _worked_out(self, work: list, source: str) -> tuple:
        """``work``'s writes and reads of ``source``, in the form ``_apply`` runs them: kept
        while the forward's layout holds (``_lay_out`` starts afresh)."""
        writes = [w for w in work if w[0] == "w" and w[1] == source and w[2].error is None]
        together = None
        if writes:
            try:
                together = self._together(writes)
            except Exception:  # each write on its own, where a failure is its request's
                log.exception("interp_engine runtime: gathering the steering vectors failed")
        reads = [(request, address, s, e, self._tap(address.name, False).split)
                 for kind, src, request, address, s, e in work if kind == "r" and src == source
                 and request.error is None]
        span = (min(r[2] for r in reads), max(r[3] for r in reads)) if reads else (0, 0)
        return writes, together, reads, span, self._decode_reads(reads, span[0])

    def _decode_reads(self, reads: list, lo: int) -> tuple | None:
        """Readers of one point with one row each in this forward (a decode step), whole rows:
        ``(arena, which of the copied rows go in, in order (None: all), buffers, their rows)`` for
        one ``index_copy_`` per step; None if the reads are not like that."""
        if len(reads) < 2 or len({r[1] for r in reads}) != 1 or any(r[3] - r[2] != 1 or r[4] is not None
                                                                       for r in reads):
            return None
        address = reads[0][1]
        buffers = []
        for request, _, _, _, _ in reads:
            buffer = request.buffers.get(address) or self._buffer(request, address)
            if buffer.arena is not self.arenas[address]:
                return None
            buffers.append(buffer)
        rows = [r[2] for r in reads]
        offsets = [s - lo for s in rows]
        which = None if offsets == list(range(len(offsets))) else torch.tensor(offsets)
        return [self.arenas[address], which, buffers, np.array(rows), None]  # the last: its _DecodeRun

    def _read_decode(self, decode: list, rows: torch.Tensor) -> list[int]:
        """One decode step's rows of its readers into their arena regions, in one copy; the
        readers left out (by index), to be read on their own: those whose row is not the next
        position they expect, or would not fit their region (or have none yet). A step after
        one where every reader took its row goes through that step's _DecodeRun."""
        arena, which, buffers, at_rows, run = decode
        if run is not None and run.step(self.pos_np, rows):
            return []
        decode[4] = None
        positions = self.pos_np[at_rows].tolist()
        at, taken, rest = _next_rows(buffers, positions)
        if rest:
            keep = sorted(set(range(len(buffers))) - set(rest))
            which = (torch.arange(rows.shape[0]) if which is None else which)[keep]
        if at:
            arena.put(torch.tensor(at), rows if which is None else rows.index_select(0, which))
            _advance(taken)
            if not rest:
                decode[4] = _DecodeRun(arena, taken, at_rows, positions, which)
        return rest

    def _read_tap(self, address: Address, rows: torch.Tensor, readers: list) -> None:
        """A compiled tap's rows of this step to its readers (``(request, s, e, offset)``: rows
        ``offset .. offset + e - s`` of ``rows`` are the request's rows s:e of the forward). In a
        decode step, the readers whose one row is the next their arena region expects take it in
        one copy (as a hooked site's do, _read_decode); the others each on their own."""
        rest = readers
        arena = self.arenas.get(address)
        cached = self._runs.pop(address, None)
        if cached is not None and cached[0] is readers:  # the layout held: last step's readers
            try:
                if cached[1].step(self.pos_np, rows):
                    self._runs[address] = cached
                    rest = cached[2]
                    arena = None  # done together
            except Exception:  # each on its own below, where a failure is its request's
                log.exception("interp_engine runtime: copying a decode step's tap rows together failed")
                arena = None
        if len(readers) > 1 and arena is not None and arena.data is not None:
            try:
                ones = [r for r in readers if r[2] - r[1] == 1 and (b := r[0].buffers.get(address)) is not None
                        and b.arena is arena]
                if len(ones) > 1:
                    positions = self.pos_np[[r[1] for r in ones]].tolist()
                    at, taken, left = _next_rows([r[0].buffers[address] for r in ones], positions)
                    if len(at) > 1:
                        skip = set(left)
                        used = [r for j, r in enumerate(ones) if j not in skip]
                        offsets = [r[3] for r in used]
                        which = None if offsets == list(range(len(used))) else torch.tensor(offsets)
                        arena.put(torch.tensor(at), rows.narrow(0, 0, len(used)) if which is None
                                  else rows.index_select(0, which))
                        _advance(taken)
                        done = {id(r) for r in used}
                        rest = [r for r in readers if id(r) not in done]
                        run = _DecodeRun(arena, taken, np.array([r[1] for r in used]),
                                         [p for j, p in enumerate(positions) if j not in skip], which)
                        self._runs[address] = (readers, run, rest)
            except Exception:  # each on its own below, where a failure is its request's
                log.exception("interp_engine runtime: copying a decode step's tap rows together failed")
                rest = readers
        if len(rest) > 1 and self._sinks(address):
            rest = self._sink_together(address, rows, rest)
        if len(rest) > 1:
            rest = self._read_together(address, rows, rest)
        for request, s, e, offset in rest:
            try:
                self._read(request, address, rows[offset:offset + e - s], s, e)
            except Exception as exc:  # this request's failure; the others read on
                self._failed(request, exc)

    def _read_together(self, address: Address, rows: torch.Tensor, readers: list) -> list:
        """Readers of one point (``(request, s, e, offset)``: rows ``offset .. offset + e - s``
        of ``rows`` are the request's rows s:e of the forward) whose rows are consecutive
        positions that fit their arena regions (a prefill step's requests): into the regions
        with one ``index_copy_``, instead of a copy per request. Returns the readers left to be
        read on their own (all of them if fewer than two go together)."""
        pos = self.pos_np
        starts, offsets, counts, done, rest = [], [], [], [], []
        try:
            arena = self.arenas.get(address)
            if arena is None:
                arena = self.arenas[address] = Arena()
            for reader in readers:
                request, s, e, offset = reader
                k = e - s
                if k < 1 or request.error is not None or self._into_sink(request, address):
                    rest.append(reader)
                    continue
                first = int(pos[s])
                buffer = request.buffers.get(address)
                if (k > 1 and int(pos[e - 1]) - first + 1 != k) or (buffer is not None and buffer.arena is not arena):
                    rest.append(reader)
                    continue
                if buffer is None:
                    buffer = self._buffer(request, address)
                if not buffer.in_arena(first + k, rows):
                    rest.append(reader)
                    continue
                starts.append(buffer.start + first)
                offsets.append(offset)
                counts.append(k)
                done.append((buffer, first, first + k))
            if len(done) < 2:
                return readers
            k = np.asarray(counts)
            total = int(k.sum())
            lead = np.cumsum(k) - k  # where each reader's rows start among the copied ones
            at = torch.from_numpy(np.arange(total) + np.repeat(np.asarray(starts) - lead, k))
            if offsets[0] == 0 and offsets == lead.tolist():  # the first rows of ``rows``, in order
                taken = rows if rows.shape[0] == total else rows[:total]
            else:
                taken = rows.index_select(0, torch.from_numpy(np.arange(total) + np.repeat(np.asarray(offsets) - lead, k)))
            arena.put(at, taken)
        except Exception:  # each on its own, where a failure is its request's
            log.exception("interp_engine runtime: copying a step's rows together failed")
            return readers
        for buffer, first, top in done:
            buffer.mark(first, top)
        return rest

    def _buffer(self, request: _Request, address: Address) -> Buffer:
        arena = self.arenas.get(address)
        if arena is None:
            arena = self.arenas[address] = Arena()
        buffer = request.buffers[address] = Buffer(request.capacity, arena)
        return buffer

    def _read(self, request: _Request, address: Address, rows: torch.Tensor, s: int, e: int) -> None:
        """``rows`` (already copied to the CPU) are rows s:e of this forward."""
        if e <= s:
            return
        if self._into_sink(request, address):
            self._sink_rows(request, address, rows, s, e)
            return
        buffer = request.buffers.get(address)
        if buffer is None:
            buffer = self._buffer(request, address)
        pos = self.pos_np
        first = int(pos[s])
        if e - s == 1 or int(pos[e - 1]) - first + 1 == e - s:  # one forward's rows of a request: always, bar drafts
            buffer.put(first, rows)
        else:
            buffer.put_at(self.positions[s:e], rows)

    def _into_sink(self, request: _Request, address: Address) -> bool:
        """Whether ``request``'s rows of ``address`` go into its sink as they are read (a
        harvest request whose file opens here), not into a buffer: the one rule every read
        path follows, so collect finds them where they went."""
        return (request.plan.sink is not None and request.sink is not False and not request.held
                and self._sinks(address))

    def _sinks(self, address: Address) -> bool:
        """Whether this worker writes a harvest request's rows of ``address`` into its sink
        itself: whole rows (not a tensor-parallel rank's slice) that leave as they are read.
        (Fixed for a worker: worked out once per point name.)"""
        known = self._sinks_by_name.get(address.name)
        if known is None:
            known = self._sinks_by_name[address.name] = bool(
                self.store_captures and address.name not in self.rank_shards
                and rows_are_values(self.spec.vllm[address.name]))
        return known

    def _sink_rows(self, request: _Request, address: Address, rows: torch.Tensor, s: int, e: int) -> None:
        try:
            if request.sink is None:
                try:
                    request.sink = SinkWriter(request.plan.sink, self.sink_files)
                except FileNotFoundError:  # the client's file is on another machine: buffer, send back
                    request.sink = False
                    self._read(request, address, rows, s, e)
                    return
            request.sink.write(address, rows, self.pos_np[s:e])
            self._sunk(request, address, int(self.pos_np[e - 1]))
        except Exception as exc:  # this request's error; the others in the forward go on
            self._failed(request, exc)

    def _sunk(self, request: _Request, address: Address, last: int) -> None:
        """After ``request``'s rows up to position ``last`` of ``address`` went into its sink: if
        that was its last position and every one is in, and so for every read, it is served."""
        n = request.plan.sink.positions
        if request.report is not None and last == n - 1 and request.sink.complete(address, n):
            request.sunk.add(address)
            if len(request.sunk) == len(request.plan.reads) and request.error is None:
                request.served = True
                request.sink.close()  # its file is the client's again: no more rows come
                request.report(OK)  # inside the forward: before this step's outputs leave

    def _after_forward(self, module, args, out):
        if self._holding:
            self.flush_held()
        return None

    def use_static(self, taps) -> None:
        """Serve through compiled taps (vllm-static, static_worker.py): their drain, after the
        forward, calls ``flush_held`` once the taps' rows are in, so this runtime's own hook
        after the forward goes."""
        self.static = taps
        self._after.remove()

    def flush_held(self) -> None:
        """Each held request (``_Request.held``) whose last position this forward read: every
        read's rows from its buffer into its sink, one write each, then OK on the board. Inside
        the forward, so before this step's outputs leave: its client reads the rows from the
        file without a collect rpc. A request that ends sooner (a stop token) never gets here
        and is collected by rpc, from the same buffers."""
        if not self._holding or self.pos_np is None:
            return
        for request, s, e in self.active:
            if not request.held or request.served or request.sink is False or request.error is not None or e <= s:
                continue
            n = request.plan.sink.positions
            if int(self.pos_np[e - 1]) != n - 1:
                continue
            try:
                self._flush(request, n)
            except Exception as exc:  # this request's failure (its client collects the error)
                self._failed(request, exc)

    def _flush(self, request: _Request, n: int) -> None:
        buffers = [request.buffers.get(address) for address in request.plan.reads]
        if any(buffer is None or not buffer.complete(n) for buffer in buffers):
            return  # a position never seen (prefix caching): collect says so
        if request.sink is None:
            try:
                request.sink = SinkWriter(request.plan.sink, self.sink_files)
            except FileNotFoundError:  # the client's file is on another machine: collected by rpc
                request.sink = False
                return
        positions = np.arange(n)
        for address, buffer in zip(request.plan.reads, buffers):
            request.sink.write(address, buffer.data[:n], positions)
            self._sunk(request, address, n - 1)

    def _sink_together(self, address: Address, rows: torch.Tensor, readers: list) -> list:
        """Harvest readers of a compiled tap (``(request, s, e, offset)``) whose rows follow one
        another both in ``rows`` and in one sink file (the client lays each point's rows out in
        window order, and a prefill step holds consecutive windows): one write per such run
        instead of one per request. Returns the readers left to be read on their own."""
        rest, runs = [], []  # runs: [fd, byte, first row of rows, end row, [(request, first, k, written)]]
        width = rows[0].numel() if rows.shape[0] else 0
        row_bytes = 4 * width
        pos = self.pos_np.tolist()  # (one conversion, not two numpy scalars per reader)
        for reader in readers:
            request, s, e, offset = reader
            sink = request.sink
            if request.plan.sink is None or sink is False or request.held or e <= s or request.error is not None:
                rest.append(reader)
                continue
            k = e - s
            first = pos[s]
            if pos[e - 1] - first != k - 1:  # not consecutive positions (drafts): its own way below
                rest.append(reader)
                continue
            try:
                if sink is None:
                    sink = request.sink = SinkWriter(request.plan.sink, self.sink_files)
                placed = sink.place(address, width, first, k)
            except Exception:  # its own way below: where a failure is its request's alone
                rest.append(reader)
                continue
            if placed is None:
                rest.append(reader)
                continue
            where, written = placed
            run = runs[-1] if runs else None
            if run is not None and run[0] == sink.fd and run[1] + (run[3] - run[2]) * row_bytes == where \
                    and run[3] == offset:
                run[3] = offset + k
                run[4].append((request, first, k, written))
            else:
                runs.append([sink.fd, where, offset, offset + k, [(request, first, k, written)]])
        for fd, where, lo, hi, members in runs:
            try:
                data = rows[lo:hi].reshape(hi - lo, -1)
                write_rows(fd, (data if data.dtype == torch.float32 else data.to(torch.float32)).numpy(), where)
            except Exception as exc:  # every request of this run failed; the others go on
                for request, _, _, _ in members:
                    self._failed(request, exc)
                continue
            for request, first, k, written in members:
                try:
                    written.mark(first, first + k)
                    if request.report is not None:  # (else nothing to say when its last rows are in)
                        self._sunk(request, address, first + k - 1)
                except Exception as exc:
                    self._failed(request, exc)
        return rest

    def _apply(self, work: list, source: str, x: torch.Tensor, base: torch.Tensor | None,
               read_value: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Writes of ``source`` on a fresh copy of ``x`` (in plan order), then its reads."""
        key = (id(work), source)
        worked = self._worked.get(key)
        if worked is None:
            worked = self._worked[key] = self._worked_out(work, source)
        writes, together, reads, (lo, hi), decode = worked
        if writes:
            given, x = x, x.clone()
            if together is not None:
                runs, _, rest = together
                try:
                    for s, e, delta in runs:  # the one add math (interp_engine._ops), on each run's rows
                        x[s:e] = apply_write("add", x[s:e], delta, EVERY_ROW)
                    writes = rest
                except Exception:  # each write on its own below, where a failure is its request's
                    log.exception("interp_engine runtime: adding the steering vectors together failed")
                    x = given.clone()  # none of those adds, not some
            for _, _, request, i, s, e in writes:
                self._guard(request, self._write, request, i, x, s, e, base)
        if reads:
            value = read_value(x)
            # one copy of the rows every reader needs (requests' rows are contiguous spans of
            # the forward: copy from the first to the last), then views of it per reader
            rows = stored(value[lo:hi])
            if decode is not None:
                try:
                    reads = [reads[i] for i in self._read_decode(decode, rows)]
                except Exception:  # each on its own below, where a failure is its request's
                    log.exception("interp_engine runtime: copying a decode step's rows together failed")
            for request, address, s, e, split in reads:
                try:
                    part = rows[s - lo:e - lo]
                    if split is not None:  # one part of a fused output (q of qkv_proj, gate of gate_up_proj)
                        part = split.take(part, self.graph)
                    self._read(request, address, part, s, e)
                except Exception as exc:  # this request's failure; the others read on
                    self._failed(request, exc)
        return x

    def _run_pre(self, site: _Site, args, kwargs):
        work = site.pre
        sources = {w[1] for w in work}
        args = list(args)
        if "layer_in" in sources:  # decoder layer (positions, hidden, residual) or (hidden, positions, residual)
            in_kw = "hidden_states" in kwargs
            at = self.spec.vllm_layer_hidden_arg
            hidden = kwargs["hidden_states"] if in_kw else args[at]
            residual = kwargs.get("residual", args[2] if len(args) > 2 else None)
            new = self._apply(work, "layer_in", hidden, residual,
                              lambda h: h if residual is None else h + residual)
            if new is not hidden:
                if in_kw:
                    kwargs = dict(kwargs, hidden_states=new)
                else:
                    args[at] = new
        if "fused_in_sum" in sources:  # norm(x, residual): the point is x + residual
            x, residual = args[0], args[1] if len(args) > 1 else kwargs.get("residual")
            args[0] = self._apply(work, "fused_in_sum", x, residual, lambda v: v + residual)
        if "attn_qk" in sources:  # read only: the attention kernel's (query, key, value), flat per token
            q = args[0] if args else kwargs["query"]
            k = args[1] if len(args) > 1 else kwargs["key"]
            qk = torch.cat([q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1)], dim=-1)
            self._apply(work, "attn_qk", qk, None, lambda v: v)
        if "module_in" in sources:
            first = args[0] if args else next(iter(kwargs.values()))
            flat = first.reshape(-1, first.shape[-1])  # rows (the Transformers backend adds a batch dim)
            new = self._apply(work, "module_in", flat, None, lambda v: v)
            if new is not flat:  # a write: edit the input in place, so that every holder of
                first.copy_(new.view_as(first))  # it sees it (GPT-2's block keeps ln_2's input as its residual)
        return tuple(args), kwargs

    def _run_post(self, site: _Site, out):
        work = site.post
        sources = {w[1] for w in work}
        if sources & {"layer_sum", "layer_h", "layer_r"}:
            h, r = out
            # eager order: the MLP's output (h) is written and read before resid_post = h + r
            h = self._apply(work, "layer_h", h, None, lambda v: v)
            self._apply(work, "layer_r", r, None, lambda v: v)
            h = self._apply(work, "layer_sum", h, r, lambda v: v + r)
            return h, r
        if sources & _ROUTE_SOURCES:  # the selection vLLM's fused MoE makes from these logits
            logits = out[0] if isinstance(out, tuple) else out
            logits = logits.reshape(-1, logits.shape[-1])
            weights, indices = route(logits, *self.routing)
            self._apply(work, "route_weights", weights.to(logits.dtype), None, lambda v: v)
            self._apply(work, "route_indices", indices, None, lambda v: v)
        if "heads_out" in sources:  # a per-head module's [tokens, heads, d_head] output
            first = out[0] if isinstance(out, tuple) else out
            flat = first.flatten(-2)
            new = self._apply(work, "heads_out", flat, None, lambda v: v)
            if new is not flat:
                new = new.view_as(first)
                return (new,) + tuple(out[1:]) if isinstance(out, tuple) else new
        if "module_out" in sources:
            first = out[0] if isinstance(out, tuple) else out
            flat = first.reshape(-1, first.shape[-1])
            new = self._apply(work, "module_out", flat, None, lambda v: v)
            if new is not flat:
                new = new.view_as(first)
                return (new,) + tuple(out[1:]) if isinstance(out, tuple) else new
        return None

    # ---- request lifetime ---------------------------------------------------------------
    def _sweep(self) -> None:
        """Requests vLLM no longer holds (finished, aborted): hand their captures over."""
        live = self.runner.requests
        for req_id in [r for r in self.requests if r not in live]:
            request = self.requests.pop(req_id)
            if request is not None:
                self._finish(request)

    def _finish(self, request: _Request) -> None:
        if self.static is not None:
            self.static.forget(request)
        if request.sink:
            request.sink.close()  # its rows are all in (collect checks they are)
        if request.plan.capture_path or (request.served and request.error is None):
            # a capture file written, or a plan its client settles from the board:
            # nobody collects it
            if request.plan.capture_path:
                self._write_file(request)
            self.by_rid.pop(request.plan.rid, None)
            request.drop()
            return
        self.finished[request.plan.rid] = request
        while len(self.finished) > _FINISHED_KEEP:  # a client that never came back
            rid, gone = self.finished.popitem(last=False)
            self.by_rid.pop(rid, None)
            gone.drop()

    def _write_file(self, request: _Request, n: int | None = None) -> None:
        if not self.store_captures or not request.plan.reads:
            return
        from safetensors.torch import save_file

        tensors, meta = {}, {"rid": request.plan.rid}
        if request.error:
            meta["error"] = request.error
        for address in request.plan.reads:
            buffer = request.buffers.get(address)
            rows = buffer.filled if n is None else n
            value = torch.empty(0)
            if buffer is not None and buffer.data is not None:
                try:
                    value = self._value(address, buffer.data[:rows])
                except Exception as exc:  # named in the file, never raised into vLLM's step
                    log.exception("interp_engine runtime: %s of request %s", address, request.plan.rid)
                    meta["error"] = meta.get("error") or f"{address}: {type(exc).__name__}: {exc}"
            tensors[str(address)] = value.contiguous()
        path = request.plan.capture_path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)

    def collect(self, rid: str, n_positions: int | None, release: bool = True,
                encode: Callable[[torch.Tensor], Any] = tensor_to_wire) -> dict:
        """The rows of request ``rid`` at positions < ``n_positions`` (all with None), per
        address, as wire tensors (or what ``encode`` makes of them); ``error`` if serving it
        failed. Frees it when ``release``."""
        request = self.by_rid.get(rid)
        if request is None:
            return {"found": False}
        out: dict[str, Any] = {"found": True, "error": request.error, "values": {}}
        # a held request collected here ended before its last position (flush_held never wrote
        # it): its rows are all in its buffers, and go back by value, not into its sink
        sink = None if request.held else request.plan.sink
        if request.error is None:
            for address in request.plan.reads:
                if not self.store_captures and address.name not in self.rank_shards:
                    continue
                if sink is not None and request.sink and self._sinks(address):  # written as they were read
                    rows = n_positions if n_positions is not None else request.sink.written(address)
                    if not request.sink.complete(address, rows):
                        out["error"] = (f"{address}: the worker did not write every one of the request's {rows} "
                                        "positions into its sink (prefix caching or speculative decoding may be on)")
                        break
                    continue
                buffer = request.buffers.get(address)
                have = 0 if buffer is None else buffer.filled
                rows = have if n_positions is None else n_positions
                if rows and (buffer is None or not buffer.complete(rows)):
                    out["error"] = (f"{address}: the worker did not see every one of the request's {rows} "
                                    "positions (prefix caching or speculative decoding may be on)")
                    break
                try:
                    value = self._value(address, buffer.data[:rows])
                except Exception as exc:  # this request's error, not the rpc's (others collect on)
                    log.exception("interp_engine runtime: %s of request %s", address, rid)
                    out["error"] = f"{address}: {type(exc).__name__}: {exc}"
                    break
                if sink is not None and address.name not in self.rank_shards:
                    # whole rows (rank 0 of a replicated point): straight into the client's file
                    try:
                        self._sink(sink, address, value)
                        continue
                    except FileNotFoundError:
                        pass  # a worker on another machine: the rows go back through the rpc
                    except Exception as exc:
                        out["error"] = f"writing {address} to {sink.path} failed: {exc!r}"
                        break
                # a rank's slice of a sharded point (the client joins the slices) or no sink
                out["values"][str(address)] = encode(value)
        if release:
            self.release(rid)
        return out

    def _value(self, address: Address, rows: torch.Tensor) -> torch.Tensor:
        """What leaves the worker of a request's rows at ``address``: the rows themselves, or the
        pattern rebuilt from the attention kernel's q | k rows (``[n_heads, pos, key_pos]``)."""
        tap = self.spec.vllm[address.name]
        if tap.source != "attn_qk":
            return rows
        from .attention import pattern_from_rows

        return pattern_from_rows(self.sites[tap.module_path(address.layer)].module, rows)

    @staticmethod
    def _sink(sink, address: Address, rows: torch.Tensor) -> None:
        """A harvest request's rows of ``address`` into its sink file, as float32, at its offset."""
        if rows.shape[0] != sink.positions:
            raise ValueError(f"the request has {rows.shape[0]} positions, its sink row holds {sink.positions}")
        if sink.widths is not None and rows[0].numel() != sink.widths[str(address)]:
            raise ValueError(f"{address}: rows of {rows[0].numel()} floats, but the client sized its sink for "
                             f"{sink.widths[str(address)]}")
        data = rows.to(torch.float32).contiguous().view(-1).numpy()
        fd = os.open(sink.path, os.O_WRONLY)  # the client made it at its full size: never create
        try:
            view, at = memoryview(data).cast("B"), sink.offsets[str(address)]
            if at + view.nbytes > os.fstat(fd).st_size:
                raise ValueError(f"the rows would end at byte {at + view.nbytes}, past the file's end")
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
        finally:
            os.close(fd)

    def flush(self, rid: str) -> bool:
        """Write the captures of ``rid`` to its capture_path now (the server calls this once the
        response is complete, so the file exists when the client reads the path)."""
        request = self.by_rid.get(rid)
        if request is None or not request.plan.capture_path:
            return False
        self._write_file(request)
        self.release(rid)
        return True

    def release(self, rid: str) -> None:
        """Forget ``rid`` (captures included): after collect, or when its client cancelled."""
        request = self.by_rid.pop(rid, None)
        self.finished.pop(rid, None)
        self._stale = True  # a request still scheduled loses its work
        self.released[rid] = None
        while len(self.released) > _FINISHED_KEEP:
            self.released.popitem(last=False)
        if request is not None:
            if self.static is not None:
                self.static.forget(request)
            for req_id, state in list(self.requests.items()):
                if state is request:
                    self.requests[req_id] = None  # still scheduled (a cancel in flight): no plan now
            request.drop()

    def stats(self) -> dict:
        return {"live": sum(1 for r in self.requests.values() if r is not None),
                "finished": len(self.finished), "by_rid": len(self.by_rid), "sites": len(self.sites),
                "hooks": sum(len(s.handles) for s in self.sites.values()) + 1,
                "forwards": self.steps, "forward_rows": list(self.forward_rows),
                "scheduled": len(self.runner.requests), "sink_files": len(self.sink_files.open)}

    def uninstall(self) -> None:
        self._handle.remove()
        self._after.remove()
        self.sink_files.close_all()
        self.boards.close_all()
        for site in self.sites.values():
            for handle in site.handles:
                handle.remove()
        self.sites.clear()
