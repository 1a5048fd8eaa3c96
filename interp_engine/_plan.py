"""Plans and steering specs: pure data describing what a run reads and writes.

Transforms (``capture_plan``, ``steer_plan``) take the immutable model graph and return a Plan;
they never touch hooks and never mutate their inputs. A backend lowers a Plan onto its engine.

A steering op holds its own frozen copy of the caller's vector, made when the op is built, so
editing the caller's tensor afterwards changes nothing; ops, specs and plans compare and hash
by content.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, Union

import torch
from jaxtyping import Float

from ._address import Address, AddressLike, to_address
from ._graph import ModelGraph
from ._ops import effective_vector, selector_columns
from ._points import POINTS

__all__ = ["OPS", "Plan", "Positions", "SteerOp", "SteerSpec", "capture_plan", "effective_vector",
           "point_width", "steer_plan", "unit_count"]

Positions = Union[str, tuple[int, ...]]
_POSITION_WORDS = ("all", "prompt", "generated")
OPS = ("add", "set", "ablate", "zero", "mean", "scale", "patch")
VECTORLESS = ("zero", "scale")  # ops that take no vector

SteerVector = Union[Float[torch.Tensor, "d_model"], Float[torch.Tensor, "n_positions d_model"]]


def _norm_positions(positions: object) -> Positions:
    if isinstance(positions, str):
        if positions not in _POSITION_WORDS:
            raise ValueError(
                f"positions={positions!r} is not valid: use 'all', 'prompt', 'generated' or a "
                "sequence of absolute positions like [4, 5]"
            )
        return positions
    if isinstance(positions, torch.Tensor):
        if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.dim() != 1:
            raise ValueError(f"positions as a tensor must be 1-D integers, got dtype {positions.dtype} "
                             f"shape {tuple(positions.shape)}")
        positions = positions.tolist()
    if isinstance(positions, Iterable) and not isinstance(positions, (bytes, dict)):
        out = tuple(positions)
        if not out:
            raise ValueError("positions is an empty sequence: pass at least one position or 'all'")
        for p in out:
            # numpy integers are Integral too; bools are not positions
            if isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 0:
                raise ValueError(f"positions must be non-negative ints, got {p!r} in {list(out)}")
        out = tuple(int(p) for p in out)
        if len(set(out)) != len(out):
            raise ValueError(f"positions has repeats: {list(out)}")
        return out
    raise TypeError(f"positions must be a str or a sequence of ints, got {positions!r}")


def _frozen_copy(vector: torch.Tensor) -> torch.Tensor:
    """The op's own copy: never the caller's tensor. A vector that requires grad is cloned with
    its autograd link (gradients reach the caller's tensor; its later in-place edits do not
    reach the copy); any other vector is detached."""
    if vector.requires_grad:
        return vector.clone(memory_format=torch.contiguous_format)
    return vector.detach().clone(memory_format=torch.contiguous_format)


_SELECTORS = {"heads": ("n_heads", "n_kv_heads"), "neurons": ("d_mlp",), "experts": ("n_experts",)}
EXPERT_OPS = ("zero", "scale")
"""The ops an ``experts=`` selector takes: an expert's share of an MoE block's output is its
routing weight times its output, so zeroing or scaling that weight is exact (no module returns
one expert's output, which the other ops would need)."""
WRITABLE_INSIDE = ("q", "k", "v", "z", "mlp_pre", "mlp_act")
"""Points inside a block a SteerSpec writes besides the residual-width steering sites (the
point table's ``writable``): per head on q, k, v and z, per neuron on the MLP's hidden points."""


def is_write_site(point) -> bool:
    """Can a SteerSpec write at this point (a PointSpec of a model's graph)?"""
    return point.writable or point.name in WRITABLE_INSIDE


def write_sites(graph) -> str:
    return ", ".join(p.name for p in graph.points() if is_write_site(p))


def unit_dims(name: str) -> tuple[str, ...]:
    """The per-token dims of a point (``(d_model,)``, ``(n_heads, d_head)``, ``(d_mlp,)``): what
    one position's value of a write looks like."""
    if name not in WRITABLE_INSIDE:
        return ("d_model",)  # the residual-width steering sites (others are refused by steer_plan)
    return POINTS[name].dims[2:]


def _norm_select(site: str, name: str, heads, neurons, experts) -> tuple[str, tuple[int, ...]] | None:
    given = [(k, v) for k, v in (("heads", heads), ("neurons", neurons), ("experts", experts)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"at {site} pass one selector (heads=, neurons= or experts=), got "
                         f"{', '.join(k for k, _ in given)}")
    kind, value = given[0]
    if kind == "experts":
        if name != "mlp_out":
            raise ValueError(f"experts= does not apply at {site}: it selects experts of an MoE block's "
                             "output, so write at mlp_out.<layer> (an MoE layer)")
    else:
        dims = unit_dims(name)
        if dims[0] not in _SELECTORS[kind]:
            fits = [n for n in WRITABLE_INSIDE if unit_dims(n)[0] in _SELECTORS[kind]]
            raise ValueError(f"{kind}= does not apply at {site} ({name} is [{', '.join(dims)}] per position); "
                             f"{kind}= selects at {', '.join(fits)}")
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, dict)):
        raise TypeError(f"{kind}= at {site} takes a list of indices like [3, 5], got {value!r}")
    out = tuple(value)
    if not out:
        raise ValueError(f"{kind}= at {site} is empty: name at least one index")
    for i in out:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
            raise ValueError(f"{kind}= at {site} takes non-negative ints, got {i!r} in {list(out)}")
    out = tuple(int(i) for i in out)
    if len(set(out)) != len(out):
        raise ValueError(f"{kind}= at {site} has repeats: {list(out)}")
    return kind, out


class SteerOp:
    """One write: ``op`` at ``address``, with ``vector`` where the op takes one.

    Ops: ``add`` (``x + scale * v``), ``set`` (``x = v``), ``ablate`` (project direction ``v``
    out), ``zero``, ``mean`` (``x = v``, a mean), ``scale`` (``x * scale``), ``patch`` (another
    run's values per position). A vector has the point's per-position shape (``[d_model]``,
    ``[n_heads, d_head]`` on z, ``[d_mlp]`` on mlp_act), optionally with a leading
    ``n_positions`` dim (then ``positions`` names them), or ``[batch, n_positions, ...]`` for a
    batch-aware patch. ``select`` (``("heads", (3, 5))`` / ``("neurons", (...))``) restricts the
    write to those heads or neurons; the vector's other entries are not used. ``("experts", (...))``
    at an MoE layer's ``mlp_out`` zeroes or scales those experts' shares of the block's output
    (through their routing weights; zero and scale only)

    Immutable: the op keeps a private copy of the vector made at construction; ``op.vector``
    returns a fresh copy each time. Equal ops compare equal and hash alike."""

    __slots__ = ("address", "op", "scale", "positions", "select", "columns", "batched", "_vector",
                 "_unit", "_digest", "_effective", "_placed", "_bound")

    def __init__(self, address: AddressLike, op: str, vector: torch.Tensor | None = None, scale: float = 1.0,
                 positions: object = "all", select: object = None, *, batched: bool = False) -> None:
        address = to_address(address)
        site = str(address)
        if op not in OPS:
            raise ValueError(f"unknown steering op {op!r} at {site}; use one of {OPS}")
        dims = unit_dims(address.name)
        if isinstance(select, tuple) and len(select) == 2 and select[0] in _SELECTORS:
            given = {"heads": None, "neurons": None, "experts": None}
            given[select[0]] = select[1]
            select = _norm_select(site, address.name, **given)
        elif select is not None:
            raise TypeError(f"select at {site} is ('heads', [...]), ('neurons', [...]) or ('experts', [...]), "
                            f"got {select!r}")
        if select is not None and select[0] == "experts" and op not in EXPERT_OPS:
            raise ValueError(
                f"{op} with experts={list(select[1])} at {site}: an expert's share of the block's output is "
                "its routing weight times its output, and no module returns one expert's output, so only "
                "zero and scale (which act on that weight) are exact; use SteerSpec.zero(point, experts=[...]) "
                "or SteerSpec.scale(point, factor, experts=[...]), or write the block's sum at mlp_out "
                "without experts=")
        positions = _norm_positions(positions)
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale at {site} must be a real number, got {scale!r}")
        if not math.isfinite(float(scale)):
            hint = " (0 leaves the model unchanged)" if op == "add" else ""
            raise ValueError(f"scale at {site} must be finite, got {scale!r}: pass a finite number{hint}")
        if op in VECTORLESS:
            if vector is not None:
                raise ValueError(f"{op} at {site} takes no vector")
            copy, unit = None, ()
        else:
            copy, unit = self._check_vector(site, op, vector, dims, positions, batched)
        digest = "none"
        if copy is not None:
            data = copy.detach()
            raw = data.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()  # any float dtype
            digest = f"{copy.dtype}:{tuple(copy.shape)}:{hashlib.blake2b(raw, digest_size=16).hexdigest()}"
        for name, value in (("address", address), ("op", op), ("scale", float(scale)),
                            ("positions", positions), ("select", select), ("columns", None),
                            ("batched", bool(batched)), ("_vector", copy), ("_unit", unit),
                            ("_digest", digest), ("_effective", None), ("_placed", {}), ("_bound", {})):
            object.__setattr__(self, name, value)

    @staticmethod
    def _check_vector(site, op, vector, dims, positions, batched):
        if not isinstance(vector, torch.Tensor):
            raise TypeError(f"steering vector at {site} must be a torch.Tensor, got {type(vector).__name__}")
        if not vector.dtype.is_floating_point:
            raise TypeError(
                f"steering vector at {site} must be a floating tensor [{', '.join(dims)}], got dtype {vector.dtype}")
        lead = vector.dim() - len(dims)
        if lead not in ((2,) if batched else (0, 1)):
            want = f"[{', '.join(dims)}] or [n_positions, {', '.join(dims)}]"
            raise ValueError(f"steering vector at {site} must be {want}, got shape {tuple(vector.shape)}")
        n_pos = vector.shape[lead - 1] if lead else None
        if lead and (not isinstance(positions, tuple) or len(positions) != n_pos):
            raise ValueError(
                f"a per-position steering vector at {site} has shape {tuple(vector.shape)}: "
                f"pass positions as a sequence of {n_pos} absolute positions")
        if op == "ablate" and lead:
            raise ValueError(f"ablate at {site} takes one direction [{', '.join(dims)}], got {tuple(vector.shape)}")
        copy = _frozen_copy(vector)
        data = copy.detach()
        if not bool(torch.isfinite(data).all()):
            raise ValueError(f"steering vector at {site} has non-finite entries")
        if op == "ablate" and not float(data.norm()) > 0:
            raise ValueError(f"ablation direction at {site} has zero norm")
        unit = tuple(int(n) for n in vector.shape[lead:])
        return copy.reshape(*copy.shape[:lead], -1), unit

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"SteerOp is immutable: build a new one (SteerSpec.add(...)) instead of setting {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("SteerOp is immutable")

    # ---- content --------------------------------------------------------------------
    @property
    def vector(self) -> torch.Tensor | None:
        """A copy of the op's vector (editing it changes nothing), in the point's per-position
        shape; None for zero and scale."""
        if self._vector is None:
            return None
        return self._vector.detach().clone().reshape(*self._vector.shape[:-1], *self._unit)

    @property
    def flat_vector(self) -> torch.Tensor | None:
        """The vector with each position's value flattened to one row (what backends write)."""
        return None if self._vector is None else self._vector.detach().clone()

    @property
    def per_position(self) -> bool:
        return self._vector is not None and self._vector.dim() >= 2

    @property
    def width(self) -> int | None:
        return None if self._vector is None else int(self._vector.shape[-1])

    @property
    def unit(self) -> tuple[int, ...]:
        """The vector's per-position shape (``()`` for zero and scale)."""
        return self._unit

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self._vector is None else self._vector.dtype

    @property
    def requires_grad(self) -> bool:
        return self._vector is not None and self._vector.requires_grad

    def _key(self) -> tuple:
        return (self.address, self.op, self.scale, self.positions, self.select, self.columns, self.batched,
                self._digest)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SteerOp):
            return NotImplemented
        if self._key() != other._key():
            return False
        return self._vector is None or torch.equal(self._vector.detach(), other._vector.detach())

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        if self._vector is None:
            what = ""
        else:
            what = f", vector[{'x'.join(str(s) for s in self._vector.shape)}] {self._digest[-8:]}"
        sel = f", {self.select[0]}={list(self.select[1])}" if self.select else ""
        return (f"SteerOp({str(self.address)!r}, {self.op!r}{what}, scale={self.scale}, "
                f"positions={self.positions!r}{sel})")

    def __reduce__(self):
        return (_rebuild, (self.address, self.op, self.vector, self.scale, self.positions, self.select,
                           self.batched, self.columns))

    def bind(self, columns: tuple[int, ...] | None) -> "SteerOp":
        """This op with its selector resolved to ``columns`` of the point's flat row (what
        ``steer_plan`` does with the model's sizes); the same op when nothing changes."""
        if columns == self.columns:
            return self
        found = self._bound.get(columns)
        if found is None:
            found = self._bound[columns] = _rebuild(self.address, self.op, self.vector, self.scale,
                                                    self.positions, self.select, self.batched, columns)
        return found

    # ---- what backends use ---------------------------------------------------------
    @property
    def experts(self) -> tuple[int, ...] | None:
        """The experts an ``experts=`` write zeroes or scales (None: not an expert write)."""
        return self.select[1] if self.select is not None and self.select[0] == "experts" else None

    @property
    def column_index(self) -> torch.Tensor | None:
        return None if self.columns is None else torch.tensor(self.columns, dtype=torch.long)

    def effective(self) -> torch.Tensor:
        """What the op uses (``interp_engine._ops.effective_vector``), restricted to the
        selected columns. Computed once (the op is immutable), except for a vector that
        requires grad, whose autograd graph must be fresh for every forward."""
        if self.requires_grad:
            return self._compute_effective()
        if self._effective is None:
            object.__setattr__(self, "_effective", self._compute_effective())
        return self._effective

    def _compute_effective(self) -> torch.Tensor:
        return effective_vector(self.op, self._vector, self.scale, self.column_index)

    def placed(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """``effective()`` on ``device`` in ``dtype``, made once per (device, dtype)."""
        if self.requires_grad:
            return self._compute_effective().to(device, dtype)
        key = (str(device), dtype)
        found = self._placed.get(key)
        if found is None:
            found = self._placed[key] = self.effective().to(device, dtype)
        return found


def _rebuild(address, op, vector, scale, positions, select, batched, columns) -> SteerOp:
    new = SteerOp(address, op, vector, scale, positions, select, batched=batched)
    object.__setattr__(new, "columns", columns)
    return new


def _patch_values(point: Address, source, positions) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    from ._cache import Cache

    if not isinstance(source, Cache):
        raise TypeError(f"patch at {point} takes a Cache from another run (run_with_cache(model, tokens, "
                        f"['{point}'])), got {type(source).__name__}")
    if point not in source:
        held = ", ".join(str(a) for a in source) or "nothing"
        raise ValueError(f"the patch source has no {point} (it holds: {held}): capture it in the source "
                         f"run, e.g. run_with_cache(model, clean_tokens, ['{point}'])")
    values = source[point]
    batch, n_pos = int(values.shape[0]), int(values.shape[1])
    if positions == "all":
        positions = tuple(range(n_pos))
    elif isinstance(positions, str):
        raise ValueError(f"patch at {point} takes 'all' or a list of positions, got {positions!r}")
    positions = _norm_positions(positions)
    beyond = [p for p in positions if p >= n_pos]
    if beyond:
        raise ValueError(f"the patch source has {n_pos} positions at {point}; positions {beyond} are not in it")
    index = torch.tensor(positions, dtype=torch.long)
    if source.attention_mask is not None:
        pads = ~source.attention_mask.bool().index_select(1, index)
        if bool(pads.any()):
            rows = sorted({int(r) for r in torch.nonzero(pads)[:, 0]})
            raise ValueError(f"patch at {point}: source rows {rows} are padding at some of positions "
                             f"{list(positions)}: patch only positions every source row holds")
    picked = values.detach().index_select(1, index)
    if batch == 1:
        return picked[0], positions, False
    return picked, positions, True


@dataclass(frozen=True)
class SteerSpec:
    """Steering as data. Build with ``SteerSpec.add / .set / .ablate / .zero / .mean / .scale /
    .patch``; compose with ``|``. Compared by content: two specs with the same ops in the same
    order are equal. Every builder takes ``positions`` ("all", "prompt", "generated" or absolute
    positions) and a selector where the point has heads (``heads=[3, 5]``: z, q, k, v) or neurons
    (``neurons=[...]``: mlp_act, mlp_pre)."""

    ops: tuple[SteerOp, ...] = ()

    def __post_init__(self) -> None:
        ops = tuple(self.ops)
        for op in ops:
            if not isinstance(op, SteerOp):
                raise TypeError(f"SteerSpec holds SteerOps, got {type(op).__name__}: build specs with "
                                "SteerSpec.add / .ablate / .set / .zero / .mean / .scale / .patch")
        object.__setattr__(self, "ops", ops)

    @staticmethod
    def _one(point, op, vector, scale, positions, heads, neurons, experts, batched=False) -> "SteerSpec":
        address = to_address(point)
        select = _norm_select(str(address), address.name, heads, neurons, experts)
        return SteerSpec((SteerOp(address, op, vector, scale, positions, select, batched=batched),))

    @classmethod
    def add(cls, point: AddressLike, vector: SteerVector, scale: float = 1.0, positions: object = "all",
            *, heads=None, neurons=None, experts=None) -> "SteerSpec":
        """``x + scale * vector`` at ``point``."""
        return cls._one(point, "add", vector, scale, positions, heads, neurons, experts)

    @classmethod
    def ablate(cls, point: AddressLike, direction: torch.Tensor, positions: object = "all",
               *, heads=None, neurons=None, experts=None) -> "SteerSpec":
        """``x - (x . d) d`` with ``d`` normalised: project the direction out (with a selector:
        the direction's part on those heads or neurons, normalised)."""
        return cls._one(point, "ablate", direction, 1.0, positions, heads, neurons, experts)

    @classmethod
    def set(cls, point: AddressLike, vector: SteerVector, positions: object = "all",
            *, heads=None, neurons=None, experts=None) -> "SteerSpec":
        """``x = vector`` at ``point``."""
        return cls._one(point, "set", vector, 1.0, positions, heads, neurons, experts)

    @classmethod
    def zero(cls, point: AddressLike, positions: object = "all", *, heads=None, neurons=None,
             experts=None) -> "SteerSpec":
        """``x = 0`` at ``point`` (zero-ablation)."""
        return cls._one(point, "zero", None, 1.0, positions, heads, neurons, experts)

    @classmethod
    def mean(cls, point: AddressLike, mean: torch.Tensor, positions: object = "all",
             *, heads=None, neurons=None, experts=None) -> "SteerSpec":
        """``x = mean`` at ``point`` (mean-ablation with a mean you computed, e.g. over a
        reference set: ``cache["z.2"].mean((0, 1))``)."""
        return cls._one(point, "mean", mean, 1.0, positions, heads, neurons, experts)

    @classmethod
    def scale(cls, point: AddressLike, factor: float, positions: object = "all",
              *, heads=None, neurons=None, experts=None) -> "SteerSpec":
        """``x * factor`` at ``point``."""
        return cls._one(point, "scale", None, factor, positions, heads, neurons, experts)

    @classmethod
    def patch(cls, point: AddressLike, source, positions: object = "all",
              *, heads=None, neurons=None, experts=None) -> "SteerSpec":
        """``x = source[point]`` at ``positions`` (all of the source's positions by default):
        activation patching from another run's Cache. A source with one row patches every
        run; a source with a batch of rows patches a run over the same number of rows, row by
        row (eager)."""
        address = to_address(point)
        values, positions, batched = _patch_values(address, source, positions)
        return cls._one(address, "patch", values, 1.0, positions, heads, neurons, experts, batched)

    def __or__(self, other: "SteerSpec") -> "SteerSpec":
        if not isinstance(other, SteerSpec):
            return NotImplemented
        # specs are immutable: the union with nothing is the spec itself (so a request steering
        # with ``steer=spec`` and no ``steer`` block in force reuses spec's checked plan)
        if not other.ops:
            return self
        if not self.ops:
            return other
        return SteerSpec(self.ops + other.ops)

    def __bool__(self) -> bool:
        return bool(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def sites(self) -> tuple[Address, ...]:
        return tuple(dict.fromkeys(op.address for op in self.ops))


@dataclass(frozen=True)
class Plan:
    """What one run reads (captures) and writes (steering), in order of application.
    Compared by content. ``Plan(reads=["resid_post.1"], writes=SteerSpec.zero("z.0", heads=[2]))``
    builds one by hand (strings become Addresses, a SteerSpec its ops); a user transform is a
    function from Plan to Plan."""

    reads: tuple[Address, ...] = ()
    writes: tuple[SteerOp, ...] = ()

    def __post_init__(self) -> None:
        reads = self.reads
        if isinstance(reads, (str, Address)):
            reads = (reads,)
        reads = tuple(dict.fromkeys(to_address(a) for a in reads))
        writes = self.writes.ops if isinstance(self.writes, SteerSpec) else tuple(self.writes)
        for op in writes:
            if not isinstance(op, SteerOp):
                raise TypeError(f"Plan.writes holds SteerOps (or pass a SteerSpec), got {type(op).__name__}")
        object.__setattr__(self, "reads", reads)
        object.__setattr__(self, "writes", writes)

    def __or__(self, other: "Plan") -> "Plan":
        if isinstance(other, SteerSpec):
            other = Plan(writes=other.ops)
        if not isinstance(other, Plan):
            return NotImplemented
        if other.empty:  # plans are immutable: the union with nothing is the plan itself
            return self
        if self.empty:
            return other
        return Plan(tuple(dict.fromkeys(self.reads + other.reads)), self.writes + other.writes)

    @property
    def empty(self) -> bool:
        return not self.reads and not self.writes

    @property
    def steering(self) -> SteerSpec:
        """The writes as a SteerSpec."""
        return SteerSpec(self.writes)


def capture_plan(graph: ModelGraph, points: Sequence[AddressLike] | AddressLike) -> Plan:
    """Validate the requested points against the graph; return a read-only Plan."""
    if isinstance(points, (str, Address)) or (isinstance(points, tuple) and points and isinstance(points[0], str)
                                              and len(points) in (2, 3) and isinstance(points[1], int)):
        points = [points]  # type: ignore[list-item]
    if isinstance(points, torch.Tensor) or not isinstance(points, Iterable):
        raise TypeError(f"points must be an address or a list of addresses like ['resid_post.1'], got "
                        f"{type(points).__name__}")
    if isinstance(points, (list, tuple)) and all(type(p) is str or type(p) is Address for p in points):
        # a loop capturing the same points request after request checks them once per graph
        return _checked_once((graph,), tuple(points),
                             lambda: Plan(reads=tuple(dict.fromkeys(graph.check_address(p) for p in points))))
    addresses = tuple(dict.fromkeys(graph.check_address(p) for p in points))  # type: ignore[union-attr]
    return Plan(reads=addresses)


_CHECKED: dict[tuple, tuple[tuple, Plan]] = {}  # capture_plan's and steer_plan's checked plans


def _checked_once(held: tuple, key: tuple, check: Callable[[], Plan]) -> Plan:
    """``check()``, or the plan it returned before for the same ``held`` objects (compared by
    identity: each is kept with its plan, so its id is never another's) and ``key``. A check
    that raises keeps nothing."""
    full = (tuple(id(o) for o in held), key)
    hit = _CHECKED.get(full)
    if hit is not None and all(a is b for a, b in zip(hit[0], held)):
        return hit[1]
    plan = check()
    if len(_CHECKED) >= 256:
        _CHECKED.clear()
    _CHECKED[full] = (held, plan)
    return plan


def point_width(graph: ModelGraph, name: str) -> int:
    """A point's flat width per token (what a write's vector spans)."""
    width = 1
    for dim in graph.point(name).dims[2:]:
        width *= graph.dim_size(dim)
    return width


def unit_count(graph: ModelGraph, name: str) -> int:
    """How many heads (z, q, k, v) or neurons (mlp_pre, mlp_act) a point holds per token."""
    return graph.dim_size(graph.point(name).dims[2])


def steer_plan(graph: ModelGraph, spec: SteerSpec | None, dtype: torch.dtype | None = None) -> Plan:
    """Validate a SteerSpec against the graph (sites exist and are writable, vector shapes,
    selected heads / neurons and dtype match); return a write-only Plan whose ops carry their
    selectors resolved to columns."""
    if spec is None:
        return Plan()
    if isinstance(spec, Plan):
        spec = spec.steering
    if not isinstance(spec, SteerSpec):
        raise TypeError(f"expected a SteerSpec, got {type(spec).__name__}: build one with SteerSpec.add(...)")
    # a spec is immutable: requests steering with the same one (a loop, a batch of requests)
    # share its checked plan, checked once per graph and dtype
    return _checked_once((graph, spec), ("steer", dtype),
                         lambda: Plan(writes=tuple(check_write(graph, op, dtype) for op in spec.ops)))


def check_write(graph: ModelGraph, op: SteerOp, dtype: torch.dtype | None = None) -> SteerOp:
    """One op checked against the graph, its selector bound to columns of the point's row."""
    graph.check_address(op.address)
    point = graph.point(op.address.name)
    if not is_write_site(point):
        raise ValueError(f"cannot steer at {op.address}: {op.address.name} is not a steering site "
                         f"on this {graph.arch} model; steerable points: {write_sites(graph)}")
    dims = unit_dims(op.address.name)
    unit = tuple(graph.dim_size(d) for d in dims)
    if op.width is not None and op.unit != unit:
        if dims == ("d_model",):
            raise ValueError(
                f"steering vector at {op.address} has width {op.width}, expected d_model={graph.d_model} "
                f"(shape [{graph.d_model}] or [n_positions, {graph.d_model}])")
        raise ValueError(f"steering vector at {op.address} is {list(op.unit)} per position, expected "
                         f"[{', '.join(dims)}] = {list(unit)} on this {graph.arch} model")
    if dtype is not None and op.dtype is not None and op.dtype != dtype:
        raise TypeError(
            f"steering vector at {op.address} has dtype {op.dtype}, the model runs in {dtype}: "
            f"pass vector.to({dtype})"
        )
    if op.select is None:
        return op
    kind, indices = op.select
    if kind == "experts":
        return _check_experts(graph, op)
    limit = unit[0]
    bad = [i for i in indices if i >= limit]
    if bad:
        raise ValueError(f"{kind}={list(indices)} at {op.address}: {bad} out of range; this {graph.arch} "
                         f"model has {limit} {dims[0]} (0..{limit - 1}) at {op.address.name}")
    cols = selector_columns(op.select, unit)
    if op.op == "ablate" and not float(op.flat_vector.index_select(-1, cols).norm()) > 0:
        raise ValueError(f"ablation direction at {op.address} is zero on {kind} {list(indices)}")
    return op.bind(tuple(cols.tolist()))


def _check_experts(graph: ModelGraph, op: SteerOp) -> SteerOp:
    """An ``experts=`` write: at an MoE layer's mlp_out, experts within the router's width."""
    indices, layer = op.select[1], op.address.layer
    if not graph.n_experts:
        raise ValueError(f"experts={list(indices)} at {op.address}: this {graph.arch} model has no MoE "
                         "layers; drop experts= to write the MLP's output")
    if layer not in graph.moe_layers:
        raise ValueError(f"experts={list(indices)} at {op.address}: layer {layer} of this {graph.arch} model "
                         f"is dense; its MoE layers are {list(graph.moe_layers)}")
    bad = [i for i in indices if i >= graph.n_experts]
    if bad:
        raise ValueError(f"experts={list(indices)} at {op.address}: {bad} out of range; this {graph.arch} "
                         f"model has {graph.n_experts} experts (0..{graph.n_experts - 1})")
    return op


def check_batch(plan: Plan, rows: int | None) -> None:
    """A batch-aware patch (a source with several rows) fits only a run over as many rows."""
    for op in plan.writes:
        if op.batched:
            n = int(op.flat_vector.shape[0])
            if rows is None:
                raise ValueError(f"patch at {op.address} comes from a source of {n} rows: it applies to "
                                 "run_with_cache over a batch of as many prompts; for generation, patch "
                                 "from a one-row source")
            if n != rows:
                raise ValueError(f"patch at {op.address} comes from a source of {n} rows, but this run has "
                                 f"{rows}: patch a batch of {n} prompts (row i takes source row i), or take "
                                 "one source row (source rows are patched row by row)")
