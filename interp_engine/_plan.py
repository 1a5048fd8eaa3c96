"""Plans and steering specs: pure data describing what a run reads and writes.

Transforms (``capture_plan``, ``steer_plan``) take the immutable model graph and return a Plan;
they never touch hooks and never mutate their inputs. A backend lowers a Plan onto its engine.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

import torch

from ._address import Address, AddressLike, to_address
from ._graph import ModelGraph

__all__ = ["Plan", "Positions", "SteerOp", "SteerSpec", "capture_plan", "steer_plan"]

Positions = Union[str, tuple[int, ...]]
_POSITION_WORDS = ("all", "prompt", "generated")
OPS = ("add", "set", "ablate")


def _norm_positions(positions: object) -> Positions:
    if isinstance(positions, str):
        if positions not in _POSITION_WORDS:
            raise ValueError(
                f"positions={positions!r} is not valid: use 'all', 'prompt', 'generated' or a "
                "sequence of absolute positions like [4, 5]"
            )
        return positions
    if isinstance(positions, torch.Tensor):
        positions = positions.tolist()
    if isinstance(positions, Iterable):
        out = tuple(positions)
        if not out:
            raise ValueError("positions is an empty sequence: pass at least one position or 'all'")
        for p in out:
            if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                raise ValueError(f"positions must be non-negative ints, got {p!r} in {list(out)}")
        if len(set(out)) != len(out):
            raise ValueError(f"positions has repeats: {list(out)}")
        return out
    raise TypeError(f"positions must be a str or a sequence of ints, got {positions!r}")


@dataclass(frozen=True, eq=False)
class SteerOp:
    """One write: ``op`` at ``address`` with ``vector`` (``[d_model]`` or ``[n_positions, d_model]``)."""

    address: Address
    op: str
    vector: torch.Tensor
    scale: float = 1.0
    positions: Positions = "all"

    def __post_init__(self) -> None:
        site = str(self.address)
        if self.op not in OPS:
            raise ValueError(f"unknown steering op {self.op!r} at {site}; use one of {OPS}")
        if not isinstance(self.vector, torch.Tensor):
            raise TypeError(f"steering vector at {site} must be a torch.Tensor, got {type(self.vector).__name__}")
        if not self.vector.dtype.is_floating_point:
            raise TypeError(
                f"steering vector at {site} must be a floating tensor [d_model], got dtype {self.vector.dtype}"
            )
        if self.vector.dim() not in (1, 2):
            raise ValueError(
                f"steering vector at {site} must be [d_model] or [n_positions, d_model], "
                f"got shape {tuple(self.vector.shape)}"
            )
        if self.vector.dim() == 2:
            if not isinstance(self.positions, tuple) or len(self.positions) != self.vector.shape[0]:
                raise ValueError(
                    f"a per-position steering vector at {site} has shape {tuple(self.vector.shape)}: "
                    f"pass positions as a sequence of {self.vector.shape[0]} absolute positions"
                )
        if self.op == "ablate":
            if self.vector.dim() != 1:
                raise ValueError(f"ablate at {site} takes one direction [d_model], got {tuple(self.vector.shape)}")
            norm = float(self.vector.norm())
            if not norm > 0 or norm != norm:
                raise ValueError(f"ablation direction at {site} has zero (or NaN) norm")
        if isinstance(self.scale, bool) or not isinstance(self.scale, numbers.Real):
            raise TypeError(f"scale at {site} must be a real number, got {self.scale!r}")
        if not torch.isfinite(self.vector).all():
            raise ValueError(f"steering vector at {site} has non-finite entries")

    @property
    def width(self) -> int:
        return int(self.vector.shape[-1])

    def effective(self) -> torch.Tensor:
        """What the op uses: scale * vector for add, the unit direction for ablate."""
        if self.op == "add":
            return self.vector * float(self.scale)
        if self.op == "ablate":
            return self.vector / self.vector.norm()
        return self.vector


@dataclass(frozen=True, eq=False)
class SteerSpec:
    """Steering as data. Build with ``SteerSpec.add / .ablate / .set``; compose with ``|``."""

    ops: tuple[SteerOp, ...] = ()

    @classmethod
    def add(cls, point: AddressLike, vector: torch.Tensor, scale: float = 1.0,
            positions: object = "all") -> "SteerSpec":
        """``x + scale * vector`` at ``point``."""
        return cls((SteerOp(to_address(point), "add", vector, scale, _norm_positions(positions)),))

    @classmethod
    def ablate(cls, point: AddressLike, direction: torch.Tensor, positions: object = "all") -> "SteerSpec":
        """``x - (x . d) d`` with ``d`` normalised: project the direction out."""
        return cls((SteerOp(to_address(point), "ablate", direction, 1.0, _norm_positions(positions)),))

    @classmethod
    def set(cls, point: AddressLike, vector: torch.Tensor, positions: object = "all") -> "SteerSpec":
        """``x = vector`` at ``point``."""
        return cls((SteerOp(to_address(point), "set", vector, 1.0, _norm_positions(positions)),))

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


@dataclass(frozen=True, eq=False)
class Plan:
    """What one run reads (captures) and writes (steering), in order of application."""

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
        if dtype is not None and op.vector.dtype != dtype:
            raise TypeError(
                f"steering vector at {op.address} has dtype {op.vector.dtype}, the model runs in {dtype}: "
                f"pass vector.to({dtype})"
            )
    return Plan(writes=spec.ops)
