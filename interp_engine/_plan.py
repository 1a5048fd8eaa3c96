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
from typing import Iterable, Sequence, Union

import torch
from jaxtyping import Float

from ._address import Address, AddressLike, to_address
from ._graph import ModelGraph

__all__ = ["Plan", "Positions", "SteerOp", "SteerSpec", "capture_plan", "steer_plan"]

Positions = Union[str, tuple[int, ...]]
_POSITION_WORDS = ("all", "prompt", "generated")
OPS = ("add", "set", "ablate")

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


class SteerOp:
    """One write: ``op`` at ``address`` with ``vector`` (``[d_model]`` or ``[n_positions, d_model]``).

    Immutable: the op keeps a private copy of the vector made at construction; ``op.vector``
    returns a fresh copy each time. Equal ops (same site, op, scale, positions and vector
    values) compare equal and hash alike."""

    __slots__ = ("address", "op", "scale", "positions", "_vector", "_digest", "_effective", "_placed")

    def __init__(self, address: AddressLike, op: str, vector: torch.Tensor, scale: float = 1.0,
                 positions: object = "all") -> None:
        address = to_address(address)
        site = str(address)
        if op not in OPS:
            raise ValueError(f"unknown steering op {op!r} at {site}; use one of {OPS}")
        if not isinstance(vector, torch.Tensor):
            raise TypeError(f"steering vector at {site} must be a torch.Tensor, got {type(vector).__name__}")
        if not vector.dtype.is_floating_point:
            raise TypeError(
                f"steering vector at {site} must be a floating tensor [d_model], got dtype {vector.dtype}")
        if vector.dim() not in (1, 2):
            raise ValueError(
                f"steering vector at {site} must be [d_model] or [n_positions, d_model], "
                f"got shape {tuple(vector.shape)}")
        positions = _norm_positions(positions)
        if vector.dim() == 2 and (not isinstance(positions, tuple) or len(positions) != vector.shape[0]):
            raise ValueError(
                f"a per-position steering vector at {site} has shape {tuple(vector.shape)}: "
                f"pass positions as a sequence of {vector.shape[0]} absolute positions")
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale at {site} must be a real number, got {scale!r}")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale at {site} must be finite, got {scale!r}: pass a finite number "
                             "(0 leaves the model unchanged)")
        copy = _frozen_copy(vector)
        data = copy.detach()
        if not bool(torch.isfinite(data).all()):
            raise ValueError(f"steering vector at {site} has non-finite entries")
        if op == "ablate":
            if copy.dim() != 1:
                raise ValueError(f"ablate at {site} takes one direction [d_model], got {tuple(copy.shape)}")
            if not float(data.norm()) > 0:
                raise ValueError(f"ablation direction at {site} has zero norm")
        raw = data.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()  # any float dtype
        digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
        for name, value in (("address", address), ("op", op), ("scale", float(scale)),
                            ("positions", positions), ("_vector", copy),
                            ("_digest", f"{copy.dtype}:{tuple(copy.shape)}:{digest}"),
                            ("_effective", None), ("_placed", {})):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"SteerOp is immutable: build a new one (SteerSpec.add(...)) instead of setting {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("SteerOp is immutable")

    # ---- content --------------------------------------------------------------------
    @property
    def vector(self) -> torch.Tensor:
        """A copy of the op's vector (editing it changes nothing)."""
        return self._vector.detach().clone()

    @property
    def per_position(self) -> bool:
        return self._vector.dim() == 2

    @property
    def width(self) -> int:
        return int(self._vector.shape[-1])

    @property
    def dtype(self) -> torch.dtype:
        return self._vector.dtype

    @property
    def requires_grad(self) -> bool:
        return self._vector.requires_grad

    def _key(self) -> tuple:
        return (self.address, self.op, self.scale, self.positions, self._digest)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SteerOp):
            return NotImplemented
        return self._key() == other._key() and torch.equal(self._vector.detach(), other._vector.detach())

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        shape = "x".join(str(s) for s in self._vector.shape)
        return (f"SteerOp({str(self.address)!r}, {self.op!r}, vector[{shape}] {self._digest[-8:]}, "
                f"scale={self.scale}, positions={self.positions!r})")

    def __reduce__(self):
        return (SteerOp, (self.address, self.op, self._vector.detach(), self.scale, self.positions))

    # ---- what backends use ---------------------------------------------------------
    def effective(self) -> torch.Tensor:
        """What the op uses: scale * vector for add, the unit direction for ablate, the vector
        for set. Computed once (the op is immutable), except for a vector that requires grad,
        whose autograd graph must be fresh for every forward."""
        if self._vector.requires_grad:
            return self._compute_effective()
        if self._effective is None:
            object.__setattr__(self, "_effective", self._compute_effective())
        return self._effective

    def _compute_effective(self) -> torch.Tensor:
        if self.op == "add":
            return self._vector * self.scale
        if self.op == "ablate":
            return self._vector / self._vector.norm()
        return self._vector

    def placed(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """``effective()`` on ``device`` in ``dtype``, made once per (device, dtype)."""
        if self._vector.requires_grad:
            return self._compute_effective().to(device, dtype)
        key = (str(device), dtype)
        found = self._placed.get(key)
        if found is None:
            found = self._placed[key] = self.effective().to(device, dtype)
        return found


@dataclass(frozen=True)
class SteerSpec:
    """Steering as data. Build with ``SteerSpec.add / .ablate / .set``; compose with ``|``.
    Compared by content: two specs with the same ops in the same order are equal."""

    ops: tuple[SteerOp, ...] = ()

    def __post_init__(self) -> None:
        ops = tuple(self.ops)
        for op in ops:
            if not isinstance(op, SteerOp):
                raise TypeError(f"SteerSpec holds SteerOps, got {type(op).__name__}: build specs with "
                                "SteerSpec.add / .ablate / .set")
        object.__setattr__(self, "ops", ops)

    @classmethod
    def add(cls, point: AddressLike, vector: SteerVector, scale: float = 1.0,
            positions: object = "all") -> "SteerSpec":
        """``x + scale * vector`` at ``point``."""
        return cls((SteerOp(point, "add", vector, scale, positions),))

    @classmethod
    def ablate(cls, point: AddressLike, direction: Float[torch.Tensor, "d_model"],
               positions: object = "all") -> "SteerSpec":
        """``x - (x . d) d`` with ``d`` normalised: project the direction out."""
        return cls((SteerOp(point, "ablate", direction, 1.0, positions),))

    @classmethod
    def set(cls, point: AddressLike, vector: SteerVector, positions: object = "all") -> "SteerSpec":
        """``x = vector`` at ``point``."""
        return cls((SteerOp(point, "set", vector, 1.0, positions),))

    def __or__(self, other: "SteerSpec") -> "SteerSpec":
        if not isinstance(other, SteerSpec):
            return NotImplemented
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
    Compared by content."""

    reads: tuple[Address, ...] = ()
    writes: tuple[SteerOp, ...] = ()

    def __or__(self, other: "Plan") -> "Plan":
        return Plan(tuple(dict.fromkeys(self.reads + other.reads)), self.writes + other.writes)

    @property
    def empty(self) -> bool:
        return not self.reads and not self.writes


def capture_plan(graph: ModelGraph, points: Sequence[AddressLike] | AddressLike) -> Plan:
    """Validate the requested points against the graph; return a read-only Plan."""
    if isinstance(points, (str, Address)) or (isinstance(points, tuple) and points and isinstance(points[0], str)
                                              and len(points) in (2, 3) and isinstance(points[1], int)):
        points = [points]  # type: ignore[list-item]
    if isinstance(points, torch.Tensor) or not isinstance(points, Iterable):
        raise TypeError(f"points must be an address or a list of addresses like ['resid_post.1'], got "
                        f"{type(points).__name__}")
    addresses = tuple(dict.fromkeys(graph.check_address(p) for p in points))  # type: ignore[union-attr]
    return Plan(reads=addresses)


def steer_plan(graph: ModelGraph, spec: SteerSpec | None, dtype: torch.dtype | None = None) -> Plan:
    """Validate a SteerSpec against the graph (sites exist and are writable, widths and dtype
    match); return a write-only Plan."""
    if spec is None:
        return Plan()
    if not isinstance(spec, SteerSpec):
        raise TypeError(f"expected a SteerSpec, got {type(spec).__name__}: build one with SteerSpec.add(...)")
    for op in spec.ops:
        graph.check_address(op.address)
        point = graph.point(op.address.name)
        if not point.writable:
            writable = ", ".join(p.name for p in graph.points() if p.writable)
            raise ValueError(f"cannot steer at {op.address}: {op.address.name} is not a steering site "
                             f"on this {graph.arch} model; steerable points: {writable}")
        if op.width != graph.d_model:
            raise ValueError(
                f"steering vector at {op.address} has width {op.width}, expected d_model={graph.d_model} "
                f"(shape [{graph.d_model}] or [n_positions, {graph.d_model}])"
            )
        if dtype is not None and op.dtype != dtype:
            raise TypeError(
                f"steering vector at {op.address} has dtype {op.dtype}, the model runs in {dtype}: "
                f"pass vector.to({dtype})"
            )
    return Plan(writes=spec.ops)
