"""An immutable activation cache keyed by Address."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping

import torch

from ._address import Address, AddressLike, to_address

__all__ = ["Cache"]


@dataclass(frozen=True, eq=False)
class Cache:
    """Captured activations, ``[batch, pos, ...]`` per Address.

    Lookup by ``Address`` or its string form (``cache["resid_post.3"]``), or ``get(name, layer)``.
    ``attention_mask`` is ``[batch, pos]`` (1 on real tokens); padded positions hold zeros.
    """

    _values: Mapping[Address, torch.Tensor] = field(repr=False)
    attention_mask: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_values", MappingProxyType(dict(self._values)))

    def __getitem__(self, key: AddressLike) -> torch.Tensor:
        address = to_address(key)
        try:
            return self._values[address]
        except KeyError:
            held = ", ".join(str(a) for a in self._values) or "nothing"
            raise KeyError(f"{address} was not captured; this cache holds: {held}") from None

    def get(self, name: str, layer: int, stream: int | None = None) -> torch.Tensor:
        return self[Address(name, layer, stream)]

    def __contains__(self, key: object) -> bool:
        try:
            return to_address(key) in self._values  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False

    def __iter__(self) -> Iterator[Address]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def keys(self):
        return self._values.keys()

    def items(self):
        return self._values.items()

    def values(self):
        return self._values.values()

    @property
    def lengths(self) -> list[int] | None:
        if self.attention_mask is None:
            return None
        return [int(n) for n in self.attention_mask.sum(dim=1)]

    def to(self, device: torch.device | str) -> "Cache":
        """A copy with every tensor on ``device``; the original is unchanged."""
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return Cache({a: t.to(device) for a, t in self._values.items()}, mask)

    def __repr__(self) -> str:
        inner = ", ".join(f"{a}: {tuple(t.shape)}" for a, t in self._values.items())
        return f"Cache({inner})"
