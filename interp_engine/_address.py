"""Addresses: the name of one activation point at one layer (and, for parallel residual
streams, one stream). Pure data; no model is needed to build or parse one.

Layer ranges depend on a model, so they are checked by ``ModelGraph.check_address``.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass
from typing import Union

from ._points import POINTS

__all__ = ["Address", "AddressLike", "expand_points", "format_address", "parse_address", "to_address"]

_ADDRESS_RE = re.compile(r"^([a-z_]+)\.(\d+)(?:\.(\d+))?$")


def _valid_names() -> str:
    return ", ".join(sorted(POINTS))


@functools.total_ordering
@dataclass(frozen=True)
class Address:
    """One point: ``Address("resid_post", 10)`` or ``Address("resid_streams", 5, 2)``.
    Ordered by name, layer, then stream (the whole stack before its single streams)."""

    name: str
    layer: int
    stream: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Address name must be a str, got {self.name!r}")
        if self.name not in POINTS:
            raise ValueError(
                f"unknown point name {self.name!r} in Address({self.name!r}, {self.layer!r}); "
                f"valid names: {_valid_names()}"
            )
        if isinstance(self.layer, bool) or not isinstance(self.layer, int):
            raise TypeError(
                f"Address layer must be an int, got {self.layer!r} in Address({self.name!r}, ...)"
            )
        if self.layer < 0:
            raise ValueError(
                f"Address layer must be >= 0, got {self.layer} in Address({self.name!r}, "
                f"{self.layer}); count layers from 0 (negative indices are not accepted)"
            )
        if self.stream is not None:
            if isinstance(self.stream, bool) or not isinstance(self.stream, int):
                raise TypeError(f"Address stream must be an int or None, got {self.stream!r}")
            if not POINTS[self.name].per_stream:
                raise ValueError(
                    f"point {self.name!r} has no stream index (got stream={self.stream}); "
                    f"only {', '.join(n for n, p in POINTS.items() if p.per_stream)} take one"
                )
            if self.stream < 0:
                raise ValueError(f"Address stream must be >= 0, got {self.stream}")

    # hash and text are computed once per Address: plans, caches and row maps key dicts by
    # addresses, dozens of lookups per request. They are kept in the instance's __dict__ (not
    # fields: equality, repr and dataclasses.fields ignore them) and never pickled, since a
    # str's hash differs from one process to the next.
    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash((self.name, self.layer, self.stream))
            object.__setattr__(self, "_hash", value)
            return value

    def __str__(self) -> str:
        try:
            return self.__dict__["_text"]
        except KeyError:
            text = format_address(self)
            object.__setattr__(self, "_text", text)
            return text

    def __reduce__(self):
        return (Address, (self.name, self.layer, self.stream))

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Address):
            return NotImplemented
        return _order_key(self) < _order_key(other)


def _order_key(a: Address) -> tuple:
    return (a.name, a.layer, -1 if a.stream is None else a.stream)


AddressLike = Union[Address, str, tuple]


def format_address(address: Address) -> str:
    """``Address("z", 7)`` -> ``"z.7"``; ``Address("resid_streams", 5, 2)`` -> ``"resid_streams.5.2"``."""
    if not isinstance(address, Address):
        raise TypeError(f"format_address takes an Address, got {address!r}")
    if address.stream is None:
        return f"{address.name}.{address.layer}"
    return f"{address.name}.{address.layer}.{address.stream}"


def parse_address(text: str) -> Address:
    """``"resid_post.10"`` -> ``Address("resid_post", 10)``; the inverse of ``format_address``."""
    if not isinstance(text, str):
        raise TypeError(f"parse_address takes a str, got {text!r}")
    match = _ADDRESS_RE.match(text)
    if match is None and (text.startswith("blocks.") or text.startswith("hook_")):
        raise ValueError(f"cannot parse address {text!r}: it looks like a TransformerLens hook "
                         f"name; use interp_engine.from_tl({text!r})")
    if match is None:
        raise ValueError(
            f"cannot parse address {text!r}: expected 'name.layer' or 'name.layer.stream' "
            f"with a non-negative layer, for example 'resid_post.10'; valid names: {_valid_names()}"
        )
    name, layer, stream = match.groups()
    if name not in POINTS:
        raise ValueError(f"unknown point name {name!r} in address {text!r}; valid names: {_valid_names()}")
    if str(int(layer)) != layer or (stream is not None and str(int(stream)) != stream):
        raise ValueError(f"cannot parse address {text!r}: numbers must not have leading zeros")
    return Address(name, int(layer), None if stream is None else int(stream))


def to_address(value: AddressLike) -> Address:
    """Accept an Address, its string form, or a ``(name, layer[, stream])`` tuple."""
    if isinstance(value, Address):
        return value
    if isinstance(value, str):
        return parse_address(value)
    if isinstance(value, tuple):
        if len(value) not in (2, 3):
            raise ValueError(f"an address tuple is (name, layer) or (name, layer, stream), got {value!r}")
        return Address(*value)
    raise TypeError(
        f"cannot use {value!r} as an address: pass an Address, a string like 'resid_post.10', "
        f"or a tuple like ('resid_post', 10)"
    )


def _is_pattern(value: object) -> bool:
    return isinstance(value, str) and any(c in value for c in "*?[")


def expand_points(graph, points):
    """Expand glob patterns (``"resid_post.*"``, ``"*.3"``) among ``points`` into the model's
    addresses (``name.layer``, in the graph's order); other items pass through unchanged.
    A pattern that matches nothing on this model is refused, naming what exists."""
    if points is None:
        return None
    single = isinstance(points, (str, Address)) or (isinstance(points, tuple) and points
                                                     and isinstance(points[0], str) and not _is_pattern(points[0])
                                                     and len(points) in (2, 3) and not isinstance(points[1], str))
    items = [points] if single else list(points)
    if not any(_is_pattern(item) for item in items):
        return points
    every = [f"{spec.name}.{layer}" for spec in graph.points() for layer in graph.layers_of(spec.name)]
    out: list = []
    for item in items:
        if not _is_pattern(item):
            out.append(item)
            continue
        matched = [a for a in every if fnmatch.fnmatchcase(a, item)]
        if not matched:
            names = ", ".join(sorted({spec.name for spec in graph.points()}))
            raise ValueError(f"point pattern {item!r} matches no point of this {graph.arch} model "
                             f"({graph.n_layers} layers; points: {names})")
        out.extend(parse_address(a) for a in matched)
    return list(dict.fromkeys(out))
