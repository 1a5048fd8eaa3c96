"""Plans and captures as plain data: what crosses from a client to vLLM's workers (inside
``SamplingParams.extra_args``) and back (through ``collective_rpc``).

Nothing here holds a torch object on the wire, so every engine shape carries it the same way
(in-process ``LLM``, multiprocess ``LLM``, ``AsyncLLM``, ``vllm serve``, Ray workers on other
machines): vectors travel inline (``vector``: a list of floats; or ``vector_b64`` with its
``shape``: the float64 bytes in base64, what ``plan_to_wire`` sends, since vLLM copies and
checks a request's extra_args element by element) or by name (from a registry loaded into the
workers), captures as ``(dtype, shape, bytes)``. No vllm import: the client, the worker
runtime, the admission validator and the server all read this one format.

Two spellings of a plan reach a worker:

- ``extra_args["interp_engine"] = {...}`` — a plan as ``plan_to_wire`` builds it; or the same
  mapping packed into MessagePack bytes (``pack_plan``), which is what this library's client
  sends: vLLM checks ``extra_args`` value by value each time it rebuilds a request's
  ``SamplingParams`` (in the engine core, and again in each worker), and one bytes value is one
  check instead of one per key and value of the plan;
- flat ``vllm_xargs`` a server request can carry (str / int / float / lists of them):
  ``interp_steer`` (a registered vector's name), ``interp_scale``, ``interp_at`` (a point;
  default: the vector's registered point), ``interp_positions`` ("all", "prompt", "generated"
  or a list of positions), ``interp_capture`` (a list of points, or one comma-separated string)
  and ``interp_capture_path`` (where the worker writes them; the server sets it).
"""

from __future__ import annotations

import base64
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from interp_engine._address import Address, to_address
from interp_engine._memo import memo_get
from interp_engine._ops import effective_vector
from interp_engine._plan import (EXPERT_OPS, OPS, VECTORLESS, Plan, _norm_positions, is_write_site, unit_dims,
                                 write_sites)

__all__ = ["KEY", "FLAT_KEYS", "PACKED", "PlanError", "VectorRegistry", "WireOp", "WirePlan", "WireSink", "memo_get",
           "pack_plan", "plan_from_args", "plan_rid", "plan_to_wire", "tensor_from_wire", "tensor_to_wire", "unpack_plan"]

KEY = "interp_engine"
VERSION = 1
FLAT_KEYS = ("interp_steer", "interp_scale", "interp_at", "interp_positions", "interp_capture",
             "interp_capture_path")
_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class PlanError(ValueError):
    """A plan in extra_args that cannot run: says what was wrong and what to send instead."""


# ---- tensors --------------------------------------------------------------------------

def tensor_to_wire(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    t = t.detach().to("cpu").contiguous()
    return str(t.dtype).replace("torch.", ""), list(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_wire(wire) -> torch.Tensor:
    """The tensor of a wire triple. Its bytes are copied unless they come as a writable
    memoryview (rows a client read from a worker's rows file, spill.py): then it is a view.
    A tensor is already one (an in-process worker's answer)."""
    if isinstance(wire, torch.Tensor):
        return wire
    dtype, shape, data = wire
    if not len(data):  # frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=_DTYPES[dtype] if dtype in _DTYPES else getattr(torch, dtype))
    if not (isinstance(data, memoryview) and not data.readonly):
        data = bytearray(data)
    flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(_DTYPES[dtype] if dtype in _DTYPES else getattr(torch, dtype)).reshape(shape)


# ---- vector registry ------------------------------------------------------------------

@dataclass(frozen=True)
class VectorRegistry:
    """Named steering vectors (and the point each is meant for), loaded once per process from
    a safetensors file: tensor names are vector names; metadata ``{name: point}`` gives a
    default site. ``INTERP_ENGINE_VECTORS`` names the file in worker and server processes."""

    vectors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    points: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike | None) -> "VectorRegistry":
        if not path:
            return cls()
        from safetensors import safe_open

        vectors, points = {}, {}
        with safe_open(os.fspath(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            for name in handle.keys():
                vectors[name] = handle.get_tensor(name)
                if name in meta:
                    points[name] = meta[name]
        return cls(MappingProxyType(vectors), MappingProxyType(points))

    @staticmethod
    def save(path: str | os.PathLike, vectors: Mapping[str, torch.Tensor],
             points: Mapping[str, str] | None = None) -> None:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in vectors.items()}, os.fspath(path),
                  metadata={k: str(v) for k, v in (points or {}).items()})


_PROCESS_REGISTRY: VectorRegistry | None = None


def process_registry() -> VectorRegistry:
    """The vectors named by ``INTERP_ENGINE_VECTORS`` in this process (loaded once)."""
    global _PROCESS_REGISTRY
    if _PROCESS_REGISTRY is None:
        _PROCESS_REGISTRY = VectorRegistry.load(os.environ.get("INTERP_ENGINE_VECTORS"))
    return _PROCESS_REGISTRY


# ---- plans ------------------------------------------------------------------------------

@dataclass(frozen=True)
class WireOp:
    address: Address
    op: str
    vector: torch.Tensor  # the effective vector (interp_engine._ops.effective_vector), on the selected columns
    positions: Any  # "all" | "prompt" | "generated" | tuple of positions
    per_position: bool
    columns: tuple[int, ...] | None = None  # the selected heads' / neurons' columns of the point's row
    scale: float = 1.0
    experts: tuple[int, ...] | None = None  # an MoE layer's experts whose routing weights it zeroes / scales


@dataclass(frozen=True)
class WireSink:
    """Where a harvest request's rows go: ``positions`` rows of each read, as float32, written
    contiguously at ``offsets[address]`` bytes into the file at ``path`` (which the client made
    and maps). The collect rpc then answers only whether the rows are there. ``hold``: the
    worker keeps the rows in its buffers as they are read and writes each read's rows at once,
    in the forward that reads the last position (a generation: one write per point, not one per
    step); a request that ends sooner is collected by rpc."""

    path: str
    offsets: Mapping[str, int]
    positions: int
    widths: Mapping[str, int] | None = None  # floats per row of each read, where the client sized it so
    hold: bool = False


@dataclass(frozen=True)
class WirePlan:
    rid: str
    reads: tuple[Address, ...]
    writes: tuple[WireOp, ...]
    capture_path: str | None = None  # write captures here when the request ends (else: rpc)
    sink: "WireSink | None" = None  # write the rows into a file the client maps (harvest)
    board: tuple[str, int] | None = None  # (file, byte of rank 0): where it reports (board.py)

    @property
    def empty(self) -> bool:
        return not self.reads and not self.writes


_WRITES: dict[int, tuple[Any, dict]] = {}  # id(op) -> (the op, kept alive so its id is not reused; its entry)
_WRITES_MAX = 256


def _wire_write(op) -> dict:
    """A steering op as plain data (a copy of its own each time: a caller may edit it): encoded
    once per op object, since ops are immutable and requests steering with one SteerSpec share
    its ops."""
    hit = _WRITES.get(id(op))
    if hit is not None and hit[0] is op:
        return dict(hit[1])
    if op.batched:
        raise PlanError(f"interp_engine plan: patch at {op.address} has a source of several rows; a vLLM "
                        "request is one prompt: patch from a one-row source")
    vec = op.flat_vector  # a copy; the effective vector is computed in the worker
    entry = {"at": str(op.address), "op": op.op, "scale": op.scale,
             "positions": op.positions if isinstance(op.positions, str) else list(op.positions)}
    if vec is not None:  # float64 bytes as one string: exact, and cheap for vLLM to copy
        entry["vector_b64"] = base64.b64encode(vec.to(torch.float64).contiguous().numpy().tobytes()).decode()
        entry["shape"] = list(vec.shape)
        entry["dtype"] = str(op.dtype).replace("torch.", "")
    if op.columns is not None:
        entry["columns"] = list(op.columns)
    if op.experts is not None:
        entry["experts"] = list(op.experts)
    if len(_WRITES) >= _WRITES_MAX:
        _WRITES.pop(next(iter(_WRITES)), None)
    _WRITES[id(op)] = (op, entry)
    return dict(entry)


def plan_to_wire(plan: Plan, rid: str, capture_path: str | None = None, model: str | None = None,
                 sink: Mapping | None = None, board: Mapping | None = None) -> dict:
    """A validated Plan as plain data for ``SamplingParams(extra_args={KEY: ...})``. ``sink``:
    ``{"path", "offsets": {address: byte offset}, "positions"}`` (see WireSink); ``board``:
    ``{"path", "at"}``, the status bytes of a plan that only writes or writes its rows into a
    sink (board.py)."""
    writes = [_wire_write(op) for op in plan.writes]
    data = {"v": VERSION, "rid": rid, "reads": [str(a) for a in plan.reads], "writes": writes}
    if model:
        data["model"] = model  # the graph's fingerprint, for admission checks
    if capture_path:
        data["capture_path"] = capture_path
    if sink is not None:
        data["sink"] = {"path": str(sink["path"]), "positions": int(sink["positions"]),
                        "offsets": {str(k): int(v) for k, v in sink["offsets"].items()}}
        if sink.get("widths") is not None:
            data["sink"]["widths"] = {str(k): int(v) for k, v in sink["widths"].items()}
        if sink.get("hold"):
            data["sink"]["hold"] = True
    if board is not None:
        data["board"] = {"path": str(board["path"]), "at": int(board["at"])}
    return data


PACKED = (bytes, bytearray, memoryview)  # what a packed plan (pack_plan) may come as
_CODEC: list = []  # msgspec's MessagePack (encoder, decoder), made on first use


def _codec() -> tuple:
    if not _CODEC:
        import msgspec  # (a vLLM dependency: imported where plans are packed or unpacked)

        _CODEC.extend((msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(), msgspec.DecodeError))
    return _CODEC[0], _CODEC[1], _CODEC[2]


def pack_plan(data: Mapping) -> bytes:
    """A wire plan (``plan_to_wire``'s mapping) as one MessagePack bytes value, for
    ``extra_args[KEY]``: what this library's client sends (see the module's docstring)."""
    return _codec()[0].encode(data)


def unpack_plan(data: bytes | bytearray | memoryview) -> dict:
    """The mapping a packed plan (``pack_plan``) holds. Raises PlanError if it holds none."""
    _, decoder, error = _codec()
    try:
        value = decoder.decode(data)
    except error as exc:
        raise _fail(f"extra_args[{KEY!r}] holds bytes that are not a MessagePack plan ({exc}); send the "
                    "mapping plan_to_wire builds, or pack_plan of it") from None
    if type(value) is not dict:
        raise _fail(f"extra_args[{KEY!r}] holds bytes that unpack to {type(value).__name__}, not a plan mapping; "
                    "send the mapping plan_to_wire builds, or pack_plan of it")
    return value


def plan_rid(extra_args, default: str) -> str:
    """The rid a request's ``extra_args[KEY]`` names (mapping or packed), or ``default``: where
    its plan failed to parse, so that its client, which collects by rid, hears why."""
    data = extra_args.get(KEY) if isinstance(extra_args, Mapping) else None
    if isinstance(data, PACKED):
        try:
            data = unpack_plan(data)
        except PlanError:
            return default
    rid = data.get("rid") if isinstance(data, Mapping) else None
    return str(rid) if rid else default


def _fail(message: str) -> PlanError:
    return PlanError(f"interp_engine plan: {message}")


def _address(value, what: str) -> Address:
    try:
        return to_address(value)
    except (TypeError, ValueError) as exc:
        raise _fail(f"{what} {value!r} is not a point address ({exc}); send 'name.layer', e.g. 'resid_post.3'") from None


def _positions(value) -> Any:
    try:
        return _norm_positions(value)
    except (TypeError, ValueError) as exc:
        raise _fail(f"positions {value!r}: {exc}") from None


def _effective(op: str, vec: torch.Tensor | None, scale: float, cols: torch.Tensor | None = None) -> torch.Tensor:
    return effective_vector(op, vec, scale, cols)


def point_width(graph, name: str) -> int:
    """The width of one position's row of a point (d_model; n_heads * d_head on z; d_mlp)."""
    return math.prod(graph.dim_size(d) for d in unit_dims(name))


def _check_graph(address: Address, graph, writing: bool) -> None:
    if graph is None:
        return
    try:
        graph.check_address(address)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if writing and not is_write_site(graph.point(address.name)):
        raise _fail(f"{address} is not a steering site; steer at one of: {write_sites(graph)}")


def _write(entry: Mapping, graph, registry: VectorRegistry) -> WireOp:
    if not isinstance(entry, Mapping):
        raise _fail(f"each write is a mapping with 'at', 'op', 'vector' (or 'name'), got {entry!r}")
    op = entry.get("op", "add")
    if op not in OPS:
        raise _fail(f"unknown op {op!r}; send one of {OPS}")
    scale = entry.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise _fail(f"scale {scale!r} must be a finite number")
    if op in VECTORLESS:
        if "vector" in entry or "vector_b64" in entry or "name" in entry:
            raise _fail(f"{op} takes no vector (send 'at', 'op', 'scale' for scale, 'positions')")
        vec, at = None, entry.get("at")
    elif "name" in entry:
        name = entry["name"]
        if name not in registry.vectors:
            known = ", ".join(sorted(registry.vectors)) or "none (start the server with --vectors FILE)"
            raise _fail(f"unknown vector name {name!r}; registered vectors: {known}")
        vec = registry.vectors[name].to(torch.float32)
        at = entry.get("at") or registry.points.get(name)
        if not at:
            raise _fail(f"vector {name!r} has no registered point: send 'interp_at' (e.g. 'resid_post.3')")
    else:
        if ("vector" in entry) == ("vector_b64" in entry):
            raise _fail("a write needs 'vector' (a list of floats) or 'name' (a registered vector)"
                        + (", not both 'vector' and 'vector_b64'" if "vector" in entry else ""))
        if "vector" in entry:
            try:
                vec = torch.tensor(entry["vector"], dtype=torch.float64)
            except (TypeError, ValueError):
                raise _fail("'vector' must be a list of numbers (or a list of such lists, one per position)") from None
        else:
            vec = _vector_b64(entry)
        dtype = entry.get("dtype", "float32")
        if dtype not in _DTYPES:
            raise _fail(f"dtype {dtype!r}; send one of {sorted(_DTYPES)}")
        vec = vec.to(_DTYPES[dtype])
        at = entry.get("at")
    address = _address(at, "write point")
    _check_graph(address, graph, writing=True)
    positions = _positions(entry.get("positions", "all"))
    width = point_width(graph, address.name) if graph is not None else None
    columns = _columns(entry.get("columns"), address, width)
    per_position = False
    if vec is not None:
        if vec.dim() not in (1, 2) or not bool(torch.isfinite(vec).all()):
            raise _fail(f"vector at {address} must be finite, [width] or [n_positions, width] (one flat row "
                        f"per position); got shape {list(vec.shape)}")
        per_position = vec.dim() == 2
        if per_position and (not isinstance(positions, tuple) or len(positions) != vec.shape[0]):
            raise _fail(f"a per-position vector at {address} has {vec.shape[0]} rows: send as many positions")
        if width is not None and vec.shape[-1] != width:
            what = f"d_model is {width}" if unit_dims(address.name) == ("d_model",) else \
                f"rows at {address.name} are {width} wide"
            raise _fail(f"vector at {address} has width {vec.shape[-1]}; this model's {what}")
        if columns is not None and max(columns) >= vec.shape[-1]:
            raise _fail(f"columns at {address} reach past the vector's width {vec.shape[-1]}")
        if op == "ablate" and (per_position or not float(vec.norm()) > 0):
            raise _fail(f"ablate at {address} takes one direction with a non-zero norm")
    experts = _experts(entry.get("experts"), address, op, columns, graph)
    cols = None if columns is None else torch.tensor(columns, dtype=torch.long)
    try:
        effective = _effective(op, vec, float(scale), cols)
    except ValueError as exc:
        raise _fail(f"{address}: {exc}") from None
    return WireOp(address, op, effective, positions, per_position, columns, float(scale), experts)


_MEMO_MAX = 256  # decoded writes kept per memo (cleared when full: a few vectors are the usual case)


def _write_once(entry, graph, registry: VectorRegistry, memo: dict | None) -> WireOp:
    """``_write(entry)``, or the op a write of the same content decoded into before (ops are
    immutable and their vectors are only read). Only valid writes are kept: a bad one raises
    every time."""
    if memo is None or not isinstance(entry, Mapping):
        return _write(entry, graph, registry)
    try:
        # with each value's type: True == 1 and 1 == 1.0, but only some of them pass _write
        key = tuple(sorted((k, type(v), tuple((type(x), x) for x in v) if isinstance(v, list) else v)
                           for k, v in entry.items()))
        hash(key)
    except TypeError:  # nested lists (a per-position vector sent as floats): decode it afresh
        return _write(entry, graph, registry)
    return memo_get(memo, key, lambda: _write(entry, graph, registry), _MEMO_MAX)


def _reads(values, graph) -> tuple[Address, ...]:
    addresses = []
    for value in values:
        address = _address(value, "capture point")
        _check_graph(address, graph, writing=False)
        addresses.append(address)
    return tuple(dict.fromkeys(addresses))


def _reads_once(values, graph, memo: dict | None) -> tuple[Address, ...]:
    """``_reads(values)``, or what the same list of point strings decoded into before (every
    request of a capture loop sends the same list). Only strings are kept, and only valid lists."""
    if memo is None or not values or not all(type(v) is str for v in values):
        return _reads(values, graph)
    return memo_get(memo, ("reads", *values), lambda: _reads(values, graph), _MEMO_MAX)  # a write's key: pairs, never this


def _experts(value, address: Address, op: str, columns, graph) -> tuple[int, ...] | None:
    """An ``experts`` list: zero or scale at an MoE layer's mlp_out, experts within the router."""
    if value is None:
        return None
    if (not isinstance(value, list) or not value
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value)):
        raise _fail(f"experts at {address} must be a non-empty list of non-negative ints, got {value!r}")
    if len(set(value)) != len(value):
        raise _fail(f"experts at {address} has repeats: {value}")
    if address.name != "mlp_out" or op not in EXPERT_OPS or columns is not None:
        raise _fail(f"experts= takes zero or scale at an MoE layer's mlp_out, without columns; got {op} at {address}")
    if graph is not None:
        if address.layer not in graph.moe_layers:
            raise _fail(f"experts at {address}: layer {address.layer} is not an MoE layer; MoE layers: "
                        f"{list(graph.moe_layers)}")
        if max(value) >= graph.n_experts:
            raise _fail(f"experts at {address} reach {max(value)}; the router has {graph.n_experts} experts")
    return tuple(value)


def _vector_b64(entry: Mapping) -> torch.Tensor:
    """A vector sent as its float64 bytes in base64 (``vector_b64``) with its ``shape``."""
    shape = entry.get("shape")
    if not isinstance(shape, list) or not 1 <= len(shape) <= 2 or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
        raise _fail(f"'vector_b64' needs 'shape': [width] or [n_positions, width], got {shape!r}")
    try:
        data = base64.b64decode(entry["vector_b64"], validate=True)
    except (TypeError, ValueError):
        raise _fail("'vector_b64' must be base64 of the vector's float64 bytes (or send 'vector', a list "
                    "of floats)") from None
    if len(data) != 8 * math.prod(shape):
        raise _fail(f"'vector_b64' holds {len(data)} bytes; shape {shape} in float64 is {8 * math.prod(shape)}")
    return torch.frombuffer(bytearray(data), dtype=torch.float64).reshape(shape)


def _columns(value, address: Address, width: int | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in value):
        raise _fail(f"columns at {address} must be a non-empty list of non-negative ints")
    if len(set(value)) != len(value):
        raise _fail(f"columns at {address} has repeats")
    if width is not None and max(value) >= width:
        raise _fail(f"columns at {address} reach {max(value)}; rows at {address.name} are {width} wide")
    return tuple(int(c) for c in value)


def plan_from_args(extra_args: Mapping | None, graph=None, registry: VectorRegistry | None = None,
                   rid: str | None = None, memo: dict | None = None) -> WirePlan | None:
    """The plan a request carries (None when it carries none), checked against ``graph``
    when one is known. Raises PlanError saying what to send instead. ``memo``: a dict the
    caller keeps (for one graph and registry) of the writes it has decoded, by their content,
    so that a steering op many requests send (the same vector, scale and site) is decoded and
    checked once (~60 us a request in a worker)."""
    if not extra_args:
        return None
    registry = registry if registry is not None else process_registry()
    if KEY in extra_args:
        data = extra_args[KEY]
        if isinstance(data, PACKED):
            data = unpack_plan(data)
        if not isinstance(data, Mapping) or data.get("v") != VERSION:
            raise _fail(f"extra_args[{KEY!r}] must be a mapping with v={VERSION} (build it with plan_to_wire), "
                        "or pack_plan of one")
        reads = data.get("reads", [])
        writes = data.get("writes", [])
        if not isinstance(reads, (list, tuple)) or not isinstance(writes, (list, tuple)):
            raise _fail("'reads' and 'writes' must be lists")
        plan_rid = str(data.get("rid") or rid or "")
        capture_path = data.get("capture_path")
        sink = data.get("sink")
        board = data.get("board")
    elif any(key in extra_args for key in FLAT_KEYS):
        unknown = sorted(k for k in extra_args if k.startswith("interp_") and k not in FLAT_KEYS)
        if unknown:
            raise _fail(f"unknown keys {unknown}; the keys are {', '.join(FLAT_KEYS)}")
        writes = []
        if "interp_steer" in extra_args:
            writes.append({"name": extra_args["interp_steer"], "at": extra_args.get("interp_at"),
                           "scale": extra_args.get("interp_scale", 1.0), "op": "add",
                           "positions": extra_args.get("interp_positions", "all")})
        elif any(k in extra_args for k in ("interp_scale", "interp_at", "interp_positions")):
            raise _fail("interp_scale / interp_at / interp_positions steer only with interp_steer (a vector name)")
        reads = extra_args.get("interp_capture", [])
        if isinstance(reads, str):
            reads = [r.strip() for r in reads.split(",") if r.strip()]
        capture_path = extra_args.get("interp_capture_path")
        sink = board = None  # a server request never names a file the workers write into
        plan_rid = str(capture_path or rid or "")  # the server flushes a capture by its path
        if reads and not capture_path:
            raise _fail("interp_capture needs interp_capture_path (interp-engine serve sets it and returns it)")
    else:
        return None
    reads = _reads_once(reads, graph, memo)
    ops = tuple(_write_once(entry, graph, registry, memo) for entry in writes)
    if capture_path is not None and not isinstance(capture_path, str):
        raise _fail("capture_path must be a string")
    return WirePlan(plan_rid, reads, ops, capture_path, None if sink is None else _sink(sink, reads),
                    None if board is None else _board(board, reads, sink))


def _mapping(value) -> bool:
    # a dict (what msgpack and plan_to_wire make) without the ABC's slower instance check
    return type(value) is dict or isinstance(value, Mapping)


_ABSOLUTE: dict[str, None] = {}  # file paths seen absolute: an engine's few sinks and boards, every request


def _absolute(path) -> bool:
    """Whether ``path`` is a str and an absolute path."""
    if type(path) is str and path in _ABSOLUTE:
        return True
    if not isinstance(path, str) or not os.path.isabs(path):
        return False
    if len(_ABSOLUTE) >= 64:
        _ABSOLUTE.clear()
    _ABSOLUTE[path] = None
    return True


def _board(value, reads: tuple[Address, ...], sink) -> tuple[str, int]:
    if reads and sink is None:
        raise _fail("a plan that reads brings its rows back by rpc: 'board' is only for plans that only write "
                    "or write their rows into a sink")
    if not _mapping(value) or not _absolute(value.get("path")) or isinstance(value.get("at"), bool) \
            or not isinstance(value.get("at"), int) or value["at"] < 0:
        raise _fail("board must be {'path': an absolute file path, 'at': a byte offset >= 0} "
                    "(build it with plan_to_wire)")
    return value["path"], value["at"]


def _ints(values, low: int) -> bool:
    """Whether every one of ``values`` is an int (not a bool) >= ``low``."""
    for v in values:
        if type(v) is not int and (not isinstance(v, int) or isinstance(v, bool)) or v < low:
            return False
    return True


def _per_read(value, names: list[str], low: int) -> bool:
    """Whether ``value`` maps exactly the reads ``names`` (distinct) to ints >= ``low``."""
    return (_mapping(value) and len(value) == len(names) and all(n in value for n in names)
            and _ints(value.values(), low))


def _sink(value, reads: tuple[Address, ...]) -> WireSink:
    if not _mapping(value) or not _absolute(value.get("path")):
        raise _fail("sink must be {'path': an absolute file path, 'offsets': {point: byte offset}, "
                    "'positions': rows per point} (build it with plan_to_wire)")
    positions, offsets = value.get("positions"), value.get("offsets")
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise _fail(f"sink positions must be an int >= 1, got {positions!r}")
    names = [str(a) for a in reads]  # (distinct: _reads keeps each address once)
    if not _per_read(offsets, names, 0):
        raise _fail(f"sink offsets must map each read ({', '.join(names)}) to a byte "
                    f"offset >= 0, got {offsets!r}")
    widths = value.get("widths")
    if widths is not None and not _per_read(widths, names, 1):
        raise _fail(f"sink widths must map each read ({', '.join(names)}) to its floats per "
                    f"row (an int >= 1), got {widths!r}")
    hold = value.get("hold", False)
    if not isinstance(hold, bool):
        raise _fail(f"sink hold must be true or false, got {hold!r}")
    return WireSink(value["path"], MappingProxyType(dict(offsets)), positions,
                    None if widths is None else MappingProxyType(dict(widths)), hold)


def merge_ranks(reads: Sequence[Address], results: Sequence[Mapping]) -> dict[Address, torch.Tensor]:
    """The rows of one request from the workers' ``interp_collect`` answers: rank 0's, with the
    slices of points sharded across tensor-parallel ranks concatenated in rank order."""
    by_rank = sorted((r for r in results if r.get("found")), key=lambda r: r.get("rank", 0))
    values = {}
    for address in reads:
        key = str(address)
        parts = [tensor_from_wire(r["values"][key]) for r in by_rank if key in r.get("values", {})]
        if not parts:
            raise RuntimeError(f"no worker returned {address}")
        values[address] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return values

