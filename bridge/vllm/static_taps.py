"""vllm-static inside a worker: the declared taps and steering sites, patched into the decoder
layers before vLLM compiles them, and the per-step row maps the runtime fills outside the graph.

``StaticTaps.patch`` replaces each decoder layer's ``forward`` (and, where a point lives on a
submodule, that submodule's ``forward``) on the instances of this engine only, before the first
forward: Dynamo traces the wrappers with the layer, so the ``tap`` / ``steer`` custom ops
(``static_ops``) sit inside the compiled graph. What they read is persistent tensors allocated
here once; every step ``fill`` writes which rows each request owns into them (before the
forward, from the runtime's row map) and ``drain`` moves the captured rows into the requests'
buffers (after it), so nothing stays in the capture buffers between steps.

Memory (allocated once, on the model's device, in the model's dtype):
  per declared tap:        (max_num_batched_tokens + 1) x d_model   (+ 3 int64 row maps)
  per declared write site: 2 x (slots + 1) x d_model + (slots + 1) x 2  (+ 3 int64 row maps)
"""

from __future__ import annotations

import collections
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from interp_engine._address import Address
from interp_engine._ops import EVERY_ROW, affine, select_rows, stored
from interp_engine._plan import VECTORLESS

from . import static_ops  # noqa: F401  (registers the ops before any graph is traced)

__all__ = ["StaticTaps", "compilation_counts"]

log = logging.getLogger("interp_engine.vllm")



@dataclass(eq=False)
class _Tap:
    """One declared capture point: its buffer and this step's rows."""

    address: Address
    source: str
    buf: torch.Tensor
    rows: torch.Tensor
    count: torch.Tensor
    dest: torch.Tensor
    readers: list = field(default_factory=list)  # this step: [(request, s, e, offset)]
    last_readers: list = field(default_factory=list)  # the readers of the last fill's layout
    spans: tuple = ()  # the (s, e) row spans the maps hold (what count, rows and dest say)
    k: int = 0  # count[0], known on the host: drain never reads it back from the device
    used: int = 0  # dest rows written (CUDA only; 0: nothing to reset)

    def run(self, x: torch.Tensor, y: torch.Tensor | None) -> None:
        torch.ops.interp_engine.tap(x, y, self.buf, self.rows, self.count, self.dest)


@dataclass(eq=False)
class _Site:
    """One declared steering site: a bank of slots (0 is the identity) and this step's rows."""

    address: Address
    source: str
    vec: torch.Tensor
    direction: torch.Tensor
    coef: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor
    count: torch.Tensor
    slot_of: torch.Tensor
    free: list = field(default_factory=list)
    # one-vector ops of the same content share one slot: (op, coef, id(vector)) -> [slot, vector, holders]
    shared: dict = field(default_factory=dict)
    # the entries of ``shared`` no request holds any more, oldest first: their slots still hold
    # their vectors, for the next request that steers with the same one; taken back for ``free``
    # when it runs short
    idle: dict = field(default_factory=dict)
    key: tuple | None = None  # what the maps hold: [(s, e, slot, add) | (rows, slots, add)], None: empty
    used: int = 0  # slot_of rows written (CUDA only)

    def run(self, x: torch.Tensor, base: torch.Tensor | None) -> None:
        torch.ops.interp_engine.steer(x, base, self.vec, self.direction, self.coef, self.rows,
                                      self.slots, self.count, self.slot_of)


class StaticTaps:
    """The declared set inside one worker."""

    def __init__(self, root: nn.Module, spec, points: tuple[Address, ...], writes: tuple[Address, ...],
                 slots: int, max_tokens: int, device: torch.device, dtype: torch.dtype, d_model: int) -> None:
        self.root, self.spec = root, spec
        self.max_tokens, self.n_slots = max_tokens, slots
        self.device, self.dtype = device, dtype
        # CUDA replays the graph with fixed shapes, so its ops read the per-row maps (dest,
        # slot_of); elsewhere they read rows[:count] and the per-row maps are never filled
        self.fixed = device.type == "cuda"
        long = dict(dtype=torch.long, device=device)
        self.taps: dict[Address, _Tap] = {}
        for address in points:
            tap = spec.vllm[address.name]
            self.taps[address] = _Tap(
                address, tap.source, torch.zeros(max_tokens + 1, d_model, dtype=dtype, device=device),
                torch.zeros(max_tokens, **long), torch.zeros(2, **long),
                torch.full((max_tokens,), max_tokens, **long))
        self.sites: dict[Address, _Site] = {}
        for address in writes:
            tap = spec.vllm_writes.get(address.name) or spec.vllm[address.name]
            coef = torch.zeros(slots + 1, 2, dtype=dtype, device=device)
            coef[0, 0] = 1.0
            self.sites[address] = _Site(
                address, tap.source, torch.zeros(slots + 1, d_model, dtype=dtype, device=device),
                torch.zeros(slots + 1, d_model, dtype=dtype, device=device), coef,
                torch.zeros(max_tokens, **long), torch.zeros(max_tokens, **long), torch.zeros(4, **long),
                torch.zeros(max_tokens, **long), free=list(range(slots, 0, -1)))
        self.owned: dict[int, list[tuple[_Site, list[int]]]] = {}  # id(request) -> slots it holds
        self.idle = True  # every row map is empty (count 0): an idle step has nothing to reset
        self.last_active: list | None = None  # the runtime's layout the maps were last filled for
        self.steady = False  # and none of its writes depends on positions: the next fill for it is free
        self.reading: list[_Tap] = []  # the taps the last fill gave readers
        self.bytes = sum(t.buf.numel() * t.buf.element_size() for t in self.taps.values()) + sum(
            (s.vec.numel() + s.direction.numel() + s.coef.numel()) * s.vec.element_size()
            for s in self.sites.values())

    # ---- patching: before vLLM compiles ------------------------------------------------
    def patch(self) -> None:
        by_layer: dict[int, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
        for address, tap in self.taps.items():
            by_layer[address.layer][("r", tap.source, self._path(address, False))].append(tap)
        for address, site in self.sites.items():
            by_layer[address.layer][("w", site.source, self._path(address, True))].append(site)
        for layer, work in by_layer.items():
            layer_path = self.spec.vllm["resid_post"].module_path(layer)
            layer_work = {k[:2]: v for k, v in work.items() if k[1].startswith("layer_")}
            if layer_work:
                _wrap(self.root.get_submodule(layer_path),
                      functools.partial(_layer_forward, hidden_arg=self.spec.vllm_layer_hidden_arg), layer_work)
            modules = collections.defaultdict(dict)
            for (kind, source, path), items in work.items():
                if not source.startswith("layer_"):
                    modules[path][(kind, source)] = items
            for path, module_work in modules.items():
                _wrap(self.root.get_submodule(path), _module_forward, module_work)

    def _path(self, address: Address, writing: bool) -> str:
        tap = (self.spec.vllm_writes.get(address.name) if writing else None) or self.spec.vllm[address.name]
        return tap.module_path(address.layer)

    # ---- requests: slots in the steering banks -----------------------------------------
    def admit(self, request) -> None:
        """Give ``request``'s writes their slots (raises when a site is not declared or full).
        A one-vector op whose op, coefficients and vector object another request in flight
        already holds shares that request's slot (requests steering with one SteerSpec decode to
        one vector object in the worker; an add's scale is inside its vector): it writes
        nothing, takes no slot of its own, and its rows can join its neighbours' in one slice add.
        So does one whose slot no request holds any more but still holds its vector (``forget``)."""
        for address in request.plan.reads:
            if address not in self.taps:
                raise ValueError(f"{address} is not a declared static tap (declared: {[str(a) for a in self.taps]})")
        held, adds, seen = [], [], set()
        try:
            for i, op in enumerate(request.plan.writes):
                if op.address in seen:  # the client refuses this; a plan from elsewhere must not
                    # reach a site whose rows take one slot each (the earlier op would be dropped)
                    raise ValueError(f"two steering ops at {op.address} in one request: a compiled site "
                                     "applies one op per row; combine them, or steer at another site")
                seen.add(op.address)
                if op.experts is not None:  # a row-wide site would zero or scale the whole block
                    raise ValueError(f"experts= at {op.address} is not compiled into vllm-static: its sites "
                                     "write whole rows, not routing weights")
                site = self.sites.get(op.address)
                if site is None:
                    raise ValueError(f"{op.address} is not a declared static write site "
                                     f"(declared: {[str(a) for a in self.sites]})")
                coef = affine(op.op, op.scale)
                adds.append(coef == (1.0, 0.0))  # x + v: the op's one-call path (static_ops)
                width = site.vec.shape[1]
                source = None if op.op in VECTORLESS else request.vectors[i]
                # what the slot's vector is made from: the decoded op's own vector, one object
                # for every request that sends it (the wire memo), where ``source`` is a copy of
                # it per request on a GPU
                origin = None if source is None else op.vector
                if source is None or source.dim() == 1 or source.shape[0] == 1:
                    key = (op.op, coef, None if origin is None else id(origin))
                    entry = site.shared.get(key)
                    if entry is not None and entry[1] is origin:  # (the entry keeps its vector alive)
                        if entry[2] == 0:  # a slot nobody held since its last request: as it was left
                            del site.idle[key]
                        entry[2] += 1
                        held.append((site, [entry[0]], key))
                        continue
                else:
                    key = None
                vector = torch.zeros(1, width) if source is None else source.reshape(-1, width)
                while len(site.free) < vector.shape[0] and site.idle:  # the oldest idle slot back
                    gone = next(iter(site.idle))
                    site.free.append(site.idle.pop(gone)[0])
                    del site.shared[gone]
                if len(site.free) < vector.shape[0]:
                    raise RuntimeError(f"{op.address}: all {self.n_slots} static steering slots are in use "
                                       "(raise static_slots when loading the model)")
                slots = [site.free.pop() for _ in range(vector.shape[0])]
                held.append((site, slots, None))  # (shared once its vector is in: below)
                if key is not None:  # one vector (the usual op): its slot's rows written in place
                    j = slots[0]
                    keep, clear = (site.direction, site.vec) if op.op == "ablate" else (site.vec, site.direction)
                    keep[j].copy_(vector[0])
                    clear[j].zero_()
                    site.coef[j].copy_(torch.tensor(coef, dtype=torch.float64))
                    site.shared[key] = [j, origin, 1]
                    held[-1] = (site, slots, key)
                else:
                    index = torch.tensor(slots, device=self.device)
                    if op.op == "ablate":
                        site.vec[index] = 0
                        site.direction[index] = vector.to(self.dtype)
                    else:
                        site.vec[index] = vector.to(self.dtype)
                        site.direction[index] = 0
                    site.coef[index] = torch.tensor(coef, dtype=self.dtype, device=self.device)
        finally:
            self.owned[id(request)] = held
        request.static_slots = [slots for _, slots, _ in held]  # op i, vector row j -> slot
        request.static_adds = adds  # op i only adds

    def forget(self, request) -> None:
        """``request``'s slots back. A one-vector op's slot keeps its vector while it is free
        (``_Site.idle``): a later request steering with the same vector object (the worker decodes
        a SteerSpec that requests send again to the one object it kept) takes it as it is,
        without writing it again; another vector takes it back once no slot is free."""
        for site, slots, key in self.owned.pop(id(request), ()):
            if key is not None:
                entry = site.shared[key]
                entry[2] -= 1
                if entry[2] == 0:  # nobody steers from it now: idle, newest last
                    site.idle[key] = entry
                continue
            site.free.extend(slots)

    # ---- per step: outside the graph ---------------------------------------------------
    def fill(self, active: list, positions: torch.Tensor | None) -> None:
        """This step's row maps from the runtime's ``active`` [(request, s, e)]. A map that
        holds the same rows as last step is not rewritten (a steady decode writes nothing)."""
        if not active and self.idle:
            return  # maps already empty: an engine with no plan in flight pays no Python per tap
        if self.keeps(active):
            # the runtime kept its layout (same requests at the same rows) and no write here
            # selects positions: the maps hold this step's rows already, and the readers are the same
            for tap in self.reading:
                tap.readers = tap.last_readers
            return
        for tap in self.taps.values():
            tap.readers = []
        work: dict[int, list] = {}
        for request, s, e in active:
            if request.error is not None:
                continue
            for address in request.plan.reads:
                self.taps[address].readers.append((request, s, e))
            for i, op in enumerate(request.plan.writes):
                sel = EVERY_ROW if op.positions == "all" else select_rows(
                    op.positions, op.per_position, positions[s:e], request.prompt_len)
                if sel.empty:
                    continue
                parts = work.setdefault(id(self.sites[op.address]), [])
                add = request.static_adds[i]
                held = request.static_slots[i]
                if sel.rows is None and sel.vector_rows is None:
                    last = parts[-1] if parts else None
                    if last is not None and len(last) == 4 and last[1] == s and last[2] == held[0] and last[3] == add:
                        parts[-1] = (last[0], e, held[0], add)  # the row before's slot (a shared one): one span
                    else:
                        parts.append((s, e, held[0], add))
                    continue
                rows = tuple(range(s, e)) if sel.rows is None else tuple((sel.rows + s).tolist())
                slots = ((held[0],) * len(rows) if sel.vector_rows is None
                         else tuple(held[j] for j in sel.vector_rows.tolist()))
                parts.append((rows, slots, add))
        built: dict[tuple, torch.Tensor] = {}  # one row list per distinct span set this step
        for tap in self.taps.values():
            self._fill_tap(tap, built)
        for site in self.sites.values():
            self._fill_site(site, tuple(work.get(id(site), ())))
        self.idle = not any(t.spans for t in self.taps.values()) and all(
            s.key is None for s in self.sites.values())
        self.last_active = active
        self.steady = all(request.error is None and all(op.positions == "all" and not op.per_position
                                                        for op in request.plan.writes)
                          for request, _, _ in active)
        for tap in self.taps.values():
            tap.last_readers = tap.readers
        self.reading = [tap for tap in self.taps.values() if tap.readers]

    def keeps(self, active: list) -> bool:
        """``fill(active, ...)`` would change nothing (and read no positions): the runtime kept
        the last fill's layout and none of its writes selects positions."""
        return bool(active) and active is self.last_active and self.steady

    def _fill_tap(self, tap: _Tap, built: dict) -> None:
        spans = tuple(sorted({(s, e) for _, s, e in tap.readers}))
        if spans != tap.spans:
            if self.fixed and tap.used:
                tap.dest[:tap.used].fill_(self.max_tokens)
                tap.used = 0
            tap.spans = spans
            if not spans:
                tap.count.zero_()
                tap.k = 0
                return
            # the spans tile rows 0..k-1 (a prefill's requests, one request alone): the op copies
            # that slice as it is, in one pass, instead of gathering it row by row (and on the
            # CPU never reads ``rows``: they are not written)
            prefix = spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            tap.k = sum(e - s for s, e in spans)
            if self.fixed or not prefix:
                rows = built.get(spans)
                if rows is None:
                    rows = built[spans] = _span_rows(spans)
                tap.rows[:tap.k].copy_(rows)
            _set(tap.count, (tap.k, int(prefix)))
            if self.fixed:
                tap.dest.index_copy_(0, rows.to(self.device), torch.arange(tap.k, device=self.device))
                tap.used = spans[-1][1]  # spans never overlap: the last ends highest
        offsets, at = {}, 0
        for s, e in spans:
            offsets[(s, e)] = at
            at += e - s
        tap.readers = [(request, s, e, offsets[(s, e)]) for request, s, e in tap.readers]

    def _fill_site(self, site: _Site, parts: tuple) -> None:
        key = parts or None
        if key == site.key:
            return
        if self.fixed and site.used:
            site.slot_of[:site.used].zero_()
            site.used = 0
        site.key = key
        if key is None:
            site.count.zero_()
            return
        add = all(p[-1] for p in parts)
        if add and len(parts) == 1 and len(parts[0]) == 4 and not self.fixed:
            # one request's span (or neighbours sharing its slot), one vector: the op adds a
            # slice from count alone, so the per-row maps are not written
            s, e, slot, _ = parts[0]
            _set(site.count, (e - s, 2, s, slot))
            return
        rows = np.concatenate([np.arange(p[0], p[1]) if len(p) == 4 else np.asarray(p[0], dtype=np.int64)
                               for p in parts])
        slots = np.concatenate([np.full(p[1] - p[0], p[2]) if len(p) == 4 else np.asarray(p[1], dtype=np.int64)
                                for p in parts])
        k = rows.shape[0]
        rows_t, slots_t = torch.from_numpy(rows), torch.from_numpy(slots)
        site.rows[:k].copy_(rows_t)
        site.slots[:k].copy_(slots_t)
        first = int(rows[0])
        if add and len(parts) == 1 and len(parts[0]) == 4:  # one request's span, one vector
            _set(site.count, (k, 2, first, int(parts[0][2])))
        elif add and int(rows[-1]) - first + 1 == k and bool((np.diff(rows) == 1).all()):  # one span
            _set(site.count, (k, 3, first, 0))
        else:
            _set(site.count, (k, int(add), 0, 0))
        if self.fixed:
            site.slot_of.index_copy_(0, rows_t.to(self.device), slots_t.to(self.device))
            site.used = int(rows.max()) + 1

    def drain(self, put: Callable[[Address, torch.Tensor, list], None]) -> None:
        """After the forward: each tap's rows leave the buffers for its readers
        (``put(address, rows, readers)``, each reader ``(request, s, e, offset)`` taking rows
        ``offset .. offset + e - s``, copied before ``put`` returns), in one copy to the CPU for
        all taps (one device sync per step); on the CPU as views of the buffers."""
        live = [tap for tap in self.taps.values() if tap.readers]
        if not live:
            return
        if self.device.type == "cpu":
            # the buffers are already on the CPU, and ``put`` copies the rows before the next
            # forward overwrites them (into a request's buffer, or its sink file): no copy here
            for tap in live:
                put(tap.address, tap.buf[:tap.k], tap.readers)
                tap.readers = []
            return
        if len(live) == 1:
            flat = stored(live[0].buf[:live[0].k])
        else:
            flat = stored(torch.cat([tap.buf[:tap.k] for tap in live]))
        at = 0
        for tap in live:
            rows = flat[at:at + tap.k]
            at += tap.k
            put(tap.address, rows, tap.readers)
            tap.readers = []


def _span_rows(spans: tuple) -> torch.Tensor:
    """The rows of ``spans`` ((s, e) pairs), in order, as one int64 tensor."""
    return torch.from_numpy(np.concatenate([np.arange(s, e) for s, e in spans]))


def _set(count: torch.Tensor, values: tuple) -> None:
    """A small int64 map (a tap's or site's ``count``) set to ``values``: through a numpy view
    on the CPU (one store per value, no tensor built), by a copy elsewhere."""
    if count.device.type == "cpu":
        count.numpy()[:] = values
    else:
        count.copy_(torch.tensor(values))

# ---- the wrappers Dynamo traces ------------------------------------------------------------

def _wrap(module: nn.Module, make: Callable, work: dict) -> None:
    original = module.forward  # the bound method of this instance's class
    module.forward = make(original, work)


def _run_point(work: dict, source: str, x: torch.Tensor, base: torch.Tensor | None) -> None:
    """Writes at ``source`` (in place), then its taps: the hook path's order."""
    for site in work.get(("w", source), ()):
        site.run(x, base)
    for tap in work.get(("r", source), ()):
        tap.run(x, base)


def _layer_forward(original: Callable, work: dict, hidden_arg: int = 1) -> Callable:
    """A decoder layer called as (positions, hidden_states, residual), or with hidden_states
    first (``hidden_arg`` 0: GPT-OSS)."""
    has_in = ("w", "layer_in") in work or ("r", "layer_in") in work

    def forward(*call, **kwargs):
        call = list(call)
        hidden_states, residual = call[hidden_arg], call[2]
        if has_in:
            if ("w", "layer_in") in work and residual is None:
                hidden_states = hidden_states.clone()  # layer 0: never write into vLLM's input buffer
            _run_point(work, "layer_in", hidden_states, residual)
        call[hidden_arg] = hidden_states
        h, r = original(*call, **kwargs)
        # eager order: the MLP's output (h) is written and read first; resid_post = h + r after
        _run_point(work, "layer_h", h, None)
        _run_point(work, "layer_r", r, None)
        _run_point(work, "layer_sum", h, r)
        return h, r

    return forward


def _module_forward(original: Callable, work: dict) -> Callable:
    def forward(*args, **kwargs):
        if ("w", "fused_in_sum") in work or ("r", "fused_in_sum") in work:  # norm(x, residual)
            args = list(args)
            x = args[0]
            residual = args[1] if len(args) > 1 else kwargs.get("residual")
            _run_point(work, "fused_in_sum", x, residual)
        out = original(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        _run_point(work, "module_out", first, None)
        return out

    return forward


def compilation_counts() -> dict:
    """vLLM's and Dynamo's compile counters in this process (for checks: no recompiles)."""
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter

    return {"dynamo_unique_graphs": int(counters["stats"]["unique_graphs"]),
            "dynamo_graph_breaks": int(sum(counters["graph_break"].values())),
            "vllm_aot_compiles": int(getattr(compilation_counter, "num_aot_compiles", 0)),
            "vllm_aot_loaded": int(getattr(compilation_counter, "num_aot_artifacts_loaded", 0)),
            "vllm_graphs_seen": int(compilation_counter.num_graphs_seen),
            "vllm_backend_compilations": int(compilation_counter.num_backend_compilations),
            "vllm_inductor_compiles": int(getattr(compilation_counter, "num_inductor_compiles", 0))}
