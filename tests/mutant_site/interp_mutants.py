"""Planted bugs for tests/test_mutation.py: each mutant is a small, realistic mistake in the
library (op math, row selection, capture copies, the steering context, the data transforms),
installed by wrapping the function where the mistake would live.

Test-only. ``install()`` (called from this folder's sitecustomize.py) hooks the import of the
library modules, so the wrappers are in place in every process that has this folder on
PYTHONPATH: the pytest process and vLLM's engine and worker processes alike. The wrappers do
nothing until a mutant is switched on; which one is read, at call time, from the file named by
``INTERP_ENGINE_MUTANT_FILE`` (or fixed by ``INTERP_ENGINE_MUTANT``), so one pytest process and
one vLLM engine can run a test under several mutants in turn.

A name ``bug`` is on wherever its code runs; ``bug@eager`` / ``bug@vllm`` only in that backend's
code (the bridge modules), so the laws that compare the backends can see it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import os
import sys

__all__ = ["MUTANTS", "active", "install", "set_active"]

MUTANTS = {
    # op math (interp_engine._ops, as the two bridges call it)
    "add_noop": "steering add leaves x unchanged",
    "ablate_identity": "ablate returns x unchanged",
    "set_ignores_positions": "set writes every row, whatever its positions",
    "add_scaled": "add writes x + 1.5 * scale * v",
    "write_noop": "no steering op changes anything",
    "scale_ignored": "the effective add vector ignores scale",
    # position selection
    "positions_off_by_one": "row selection reads every position one too high",
    # capture copies
    "capture_scaled": "a capture keeps 1.5 x the value",
    "capture_wrong_layer": "a capture reads the neighbouring layer",
    "capture_writes_stream": "capturing scales the live tensor in place",
    "capture_stale_decode": "a decode step's capture repeats the previous position",
    # the steering context and the data transforms
    "nested_inner_only": "nested steer blocks keep only the innermost spec",
    "steer_exit_leaks": "an exception inside steer() leaves the steering on",
    "spec_aliases_caller_vector": "a SteerOp keeps the caller's tensor instead of a copy",
    "expert_weights_dropped": "expert_assignment puts 1.0 on every selected expert",
    "stream_drops_last_delta": "the last text delta is never emitted",
    "format_drops_stream": "format_address forgets the stream",
    "parse_error_unnamed": "a bad address string raises without naming it",
    "refusal_dropped": "the vLLM backend refuses nothing",
    "static_refused_unnamed": "load_model refuses vllm-static with a plain ValueError",
    "lens_skips_norm": "the eager lens unembeds without the final norm",
    "embed_scaled": "model.embed returns 1.5 x the input embeddings",
    "route_not_renormalised": "vLLM's recomputed expert weights skip the renormalisation over the top k",
    "route_unsorted": "vLLM's recomputed selection lists the top k worst first",
    # vLLM's pattern, rebuilt in the worker from the attention kernel's q and k
    "pattern_no_causal_mask": "the rebuilt pattern lets each query attend to later keys",
    "pattern_no_softcap": "the rebuilt pattern skips the logit soft-cap",
    "pattern_gqa_tiled": "the rebuilt pattern gives query head h the KV head h % n_kv_heads",
    "pattern_window_off_by_one": "the rebuilt pattern keeps one key more than the sliding window",
    "pattern_sinks_dropped": "the rebuilt pattern leaves the attention sinks out of the softmax",
    "expert_write_noop": "an experts= write leaves the routing weights as they were",
}

SIDED = {"add_noop", "ablate_identity", "set_ignores_positions", "add_scaled", "write_noop",
         "positions_off_by_one", "capture_scaled", "capture_wrong_layer", "capture_writes_stream",
         "capture_stale_decode", "expert_write_noop"}

_FILE = os.environ.get("INTERP_ENGINE_MUTANT_FILE")
_FIXED = os.environ.get("INTERP_ENGINE_MUTANT", "")
_seen: tuple = (None, "")
LEAKED: list = []  # steer blocks left open by steer_exit_leaks (the plugin closes them)


def _current() -> str:
    global _seen
    if not _FILE:
        return _FIXED
    try:
        st = os.stat(_FILE)
    except FileNotFoundError:
        return ""
    key = (st.st_mtime_ns, st.st_size)
    if _seen[0] != key:
        with open(_FILE) as f:
            _seen = (key, f.read().strip())
    return _seen[1]


def active(name: str, side: str | None = None) -> bool:
    """Is mutant ``name`` on for code of ``side`` ("eager", "vllm", or None: shared code)?"""
    current = _current()
    if not current:
        return False
    bug, _, where = current.partition("@")
    return bug == name and (not where or where == side)


def set_active(name: str) -> None:
    """Switch the mutant for every process reading the file (the pytest plugin calls this)."""
    if name and name != "none":
        bug = name.partition("@")[0]
        if bug not in MUTANTS or ("@" in name and bug not in SIDED):
            raise ValueError(f"unknown mutant {name!r}; known: {sorted(MUTANTS)} (sided: {sorted(SIDED)})")
    with open(_FILE, "w") as f:
        f.write("" if name == "none" else name)


# ---- the wrappers, by module --------------------------------------------------------------

def _ops_wrappers(side: str):
    from interp_engine import _ops

    _ops.OP_MATH.setdefault("~keep", lambda region, vec, base: region)
    _ops.OP_MATH.setdefault("~add_scaled", lambda region, vec, base: region + 1.5 * vec)
    apply_write, select_rows = _ops.apply_write, _ops.select_rows

    def mutant_apply_write(kind, x, vec, sel, base=None, **kwargs):
        if active("write_noop", side) or (kind == "add" and active("add_noop", side)) \
                or (kind == "ablate" and active("ablate_identity", side)):
            kind = "~keep"
        elif kind == "add" and active("add_scaled", side):
            kind = "~add_scaled"
        elif kind == "set" and active("set_ignores_positions", side) and sel.rows is not None:
            sel = _ops.EVERY_ROW
        return apply_write(kind, x, vec, sel, base, **kwargs)

    def mutant_select_rows(positions_spec, per_position, positions, prompt_len):
        if active("positions_off_by_one", side):
            positions = positions + 1
        return select_rows(positions_spec, per_position, positions, prompt_len)

    return mutant_apply_write, mutant_select_rows


def _experts_wrapper(side: str):
    from interp_engine import _ops

    weight_experts = _ops.weight_experts

    def mutant_weight_experts(weights, indices, experts, factor, sel):
        if active("expert_write_noop", side):
            return weights
        return weight_experts(weights, indices, experts, factor, sel)
    return mutant_weight_experts


def _patch_eager(module) -> None:
    import torch

    module.apply_write, module.select_rows = _ops_wrappers("eager")
    module.weight_experts = _experts_wrapper("eager")
    backend = module.EagerBackend
    read_key, decode = backend._read_key, backend.decode

    def mutant_decode(self, resid):
        if active("lens_skips_norm"):
            with torch.set_grad_enabled(resid.requires_grad):
                return self.module(self.spec.unembed_path)(resid.to(self.device, self.dtype))
        return decode(self, resid)
    backend.decode = mutant_decode

    def _read_key(self, address):
        if active("capture_wrong_layer", "eager"):
            layers = self.graph.layers_of(address.name)
            other = layers[layers.index(address.layer) - 1] if address.layer != layers[0] else layers[-1]
            tap = self._tap(address.name)
            return tap.module_path(other), tap.how
        return read_key(self, address)
    backend._read_key = _read_key


class _Sink:
    """A capture sink that plants a capture bug on the way into the real list."""

    def __init__(self, target: list) -> None:
        self.target = target

    def append(self, t) -> None:
        if active("capture_scaled", "eager"):
            t = t * 1.5
        elif active("capture_writes_stream", "eager"):
            import torch

            kept = t.clone()
            with torch.no_grad():
                t.mul_(1.5)
            t = kept
        elif active("capture_stale_decode", "eager") and self.target and t.dim() >= 3 \
                and t.shape[1] == 1 and self.target[-1].dim() == t.dim():
            t = self.target[-1][:, -1:].clone()
        self.target.append(t)

    def __getitem__(self, i):
        return self.target[i]

    def __len__(self) -> int:
        return len(self.target)


def _patch_hooks(module) -> None:
    read = module.HookSet.read

    def mutant_read(self, mod, how, sink):
        return read(self, mod, how, _Sink(sink))
    module.HookSet.read = mutant_read


def _patch_runtime(module) -> None:
    module.apply_write, module.select_rows = _ops_wrappers("vllm")
    module.weight_experts = _experts_wrapper("vllm")
    stored = module.stored

    def mutant_stored(t):
        if active("capture_scaled", "vllm"):
            return stored(t) * 1.5
        if active("capture_writes_stream", "vllm"):
            kept = stored(t)
            t.mul_(1.5)
            return kept
        return stored(t)
    module.stored = mutant_stored
    route = module.route

    def mutant_route(logits, top_k, renormalize):
        if active("route_not_renormalised"):
            renormalize = False
        weights, indices = route(logits, top_k, renormalize)
        if active("route_unsorted"):
            return weights.flip(-1), indices.flip(-1)
        return weights, indices
    module.route = mutant_route

    runtime = module.Runtime
    tap = runtime._tap

    class _Shifted:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name):  # everything but the layer it reads is the real tap's
            return getattr(self.inner, name)

        def module_path(self, layer: int) -> str:
            return self.inner.module_path(layer - 1 if layer > 0 else layer + 1)

    def mutant_tap(self, name, writing):
        found = tap(self, name, writing)
        if not writing and active("capture_wrong_layer", "vllm"):
            return _Shifted(found)
        return found
    runtime._tap = mutant_tap

    buffer = module.Buffer
    put = buffer.put

    def mutant_put(self, first, rows):
        if rows.shape[0] == 1 and self.data is not None and first > 0 \
                and active("capture_stale_decode", "vllm"):
            rows = self.data[first - 1:first].clone()
        return put(self, first, rows)
    buffer.put = mutant_put
    arena = module.Arena
    arena_put = arena.put

    def mutant_arena_put(self, rows_at, rows):  # a decode step's rows of several requests
        if active("capture_stale_decode", "vllm"):
            rows = self.data.index_select(0, (rows_at - 1).clamp(min=0))
        return arena_put(self, rows_at, rows)
    arena.put = mutant_arena_put


def _patch_attention(module) -> None:
    import torch

    attention_pattern = module.attention_pattern

    def mutant_attention_pattern(q, k, *, scale, window=None, softcap=None, sinks=None):
        if active("pattern_no_causal_mask"):
            kk = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            return torch.softmax(torch.einsum("qhd,khd->hqk", q.float(), kk) * scale, -1).to(q.dtype)
        if active("pattern_no_softcap"):
            softcap = None
        if active("pattern_gqa_tiled"):
            k = k.repeat(1, q.shape[1] // k.shape[1], 1)
        if active("pattern_window_off_by_one") and window is not None:
            window = window + 1
        if active("pattern_sinks_dropped"):
            sinks = None
        return attention_pattern(q, k, scale=scale, window=window, softcap=softcap, sinks=sinks)
    module.attention_pattern = mutant_attention_pattern


def _patch_wire(module) -> None:
    effective = module._effective

    def mutant_effective(op, vec, scale, *rest):
        if op == "add" and active("scale_ignored"):
            return vec
        return effective(op, vec, scale, *rest)
    module._effective = mutant_effective

    # The runtime keeps the ops it decoded, by content, for the worker's life; a mutant switched
    # on between tests would meet ops decoded without it. Decode afresh every time here.
    write = module._write
    module._write_once = lambda entry, graph, registry, memo: write(entry, graph, registry)


def _patch_client(module) -> None:
    backend = module.VllmBackend
    refusal = backend.refusal

    def mutant_refusal(self, plan, batch, *, gradients=False):
        if active("refusal_dropped"):
            return None
        return refusal(self, plan, batch, gradients=gradients)
    backend.refusal = mutant_refusal


def _patch_plan(module) -> None:
    frozen_copy = module._frozen_copy

    def mutant_frozen_copy(vector):
        if active("spec_aliases_caller_vector"):
            return vector
        return frozen_copy(vector)
    module._frozen_copy = mutant_frozen_copy

    op_cls = module.SteerOp
    compute, effective, placed = op_cls._compute_effective, op_cls.effective, op_cls.placed

    def mutant_compute(self):
        if self.op == "add" and active("scale_ignored"):
            return self._vector
        return compute(self)

    def mutant_effective_(self):
        if active("scale_ignored"):  # past the cache, which holds the true vector
            return mutant_compute(self)
        return effective(self)

    def mutant_placed(self, device, dtype):
        if active("scale_ignored"):
            return mutant_compute(self).to(device, dtype)
        return placed(self, device, dtype)
    op_cls._compute_effective, op_cls.effective, op_cls.placed = mutant_compute, mutant_effective_, mutant_placed


def _patch_api(module) -> None:
    active_steering, steer, expert_assignment = module.active_steering, module.steer, module.expert_assignment

    def mutant_active_steering(model):
        if active("nested_inner_only"):
            specs = [spec for owner, spec in module._ACTIVE.get() if owner is model]
            return specs[-1] if specs else module.SteerSpec()
        return active_steering(model)
    module.active_steering = mutant_active_steering

    @contextlib.contextmanager
    def _leaky(model, spec):
        manager = steer(model, spec)
        value = manager.__enter__()
        LEAKED.append(manager)  # kept alive: closing it would run steer's own reset
        yield value  # an exception propagates without the reset
        LEAKED.remove(manager)
        manager.__exit__(None, None, None)

    @functools.wraps(steer)
    def mutant_steer(model, spec):
        if active("steer_exit_leaks"):
            return _leaky(model, spec)
        return steer(model, spec)
    module.steer = mutant_steer

    @functools.wraps(expert_assignment)
    def mutant_expert_assignment(*args, **kwargs):
        dense = expert_assignment(*args, **kwargs)
        if active("expert_weights_dropped"):
            return (dense != 0).to(dense.dtype)
        return dense
    module.expert_assignment = mutant_expert_assignment

    deltas = module._TextDeltas
    push = deltas.push

    def mutant_push(self, token_id, last):
        delta = push(self, token_id, last)
        return "" if last and active("stream_drops_last_delta") else delta
    deltas.push = mutant_push


def _patch_address(module) -> None:
    format_address, parse_address = module.format_address, module.parse_address

    @functools.wraps(format_address)
    def mutant_format(address):
        if active("format_drops_stream") and getattr(address, "stream", None) is not None:
            return f"{address.name}.{address.layer}"
        return format_address(address)

    @functools.wraps(parse_address)
    def mutant_parse(text):
        try:
            return parse_address(text)
        except ValueError:
            if active("parse_error_unnamed"):
                raise ValueError("cannot parse address") from None
            raise
    module.format_address, module.parse_address = mutant_format, mutant_parse


def _patch_model(module) -> None:
    load_model = module.load_model

    @functools.wraps(load_model)
    def mutant_load_model(path, backend="eager", *args, **kwargs):
        if backend == "vllm-static" and active("static_refused_unnamed"):
            raise ValueError("this backend is not available")
        return load_model(path, backend, *args, **kwargs)
    module.load_model = mutant_load_model

    embed = module.Model.embed

    @functools.wraps(embed)
    def mutant_embed(self, tokens):
        out = embed(self, tokens)
        return out * 1.5 if active("embed_scaled") else out
    module.Model.embed = mutant_embed


PATCHES = {
    "interp_engine._model": _patch_model,
    "interp_engine._address": _patch_address,
    "interp_engine._plan": _patch_plan,
    "interp_engine._api": _patch_api,
    "bridge._hooks": _patch_hooks,
    "bridge.eager": _patch_eager,
    "bridge.vllm.runtime": _patch_runtime,
    "bridge.vllm.attention": _patch_attention,
    "bridge.vllm.wire": _patch_wire,
    "bridge.vllm.client": _patch_client,
}


# ---- import hook --------------------------------------------------------------------------

class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patch) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, patch)
        return spec


def install() -> None:
    loaded = [name for name in PATCHES if name in sys.modules]
    if loaded:
        raise RuntimeError(f"mutants must be installed before {loaded} is imported")
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
