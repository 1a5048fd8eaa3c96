"""What a vllm-static engine compiles in: the declared taps and steering sites, checked against
the architecture before any engine starts, and carried to the workers as plain data in vLLM's
``additional_config`` (which vLLM hashes into its compile-cache key, so a cached graph built
with another set, or with none, is never loaded).

``static_points="auto"`` declares resid_post, attn_out and mlp_out at every layer, and (unless
``static_writes`` says otherwise) resid_post at every layer as a steering site. A list declares
exactly those addresses ("resid_post.3", ``Address``...); ``static_writes`` defaults to none.
Only residual-width points (resid_pre, resid_mid, resid_post, attn_out, mlp_out) compile in.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from interp_engine._address import Address, to_address
from interp_engine._points import POINTS

__all__ = ["AUTO_POINTS", "AUTO_WRITES", "CONFIG_KEY", "STATIC_SOURCES", "StaticDeclaration", "declare"]

CONFIG_KEY = "static"
VERSION = 2  # bump when the compiled ops change: old cached graphs must not load
AUTO_POINTS = ("resid_post", "attn_out", "mlp_out")
AUTO_WRITES = ("resid_post",)
DEFAULT_SLOTS = 64
# where a tap or steering site can be compiled in (the fused-layer sources static_taps patches)
STATIC_SOURCES = frozenset({"layer_in", "layer_sum", "layer_h", "layer_r", "module_out", "fused_in_sum"})


@dataclass(frozen=True)
class StaticDeclaration:
    points: tuple[Address, ...]
    writes: tuple[Address, ...]
    slots: int = DEFAULT_SLOTS

    def to_config(self) -> dict:
        return {"v": VERSION, "points": [str(a) for a in self.points], "writes": [str(a) for a in self.writes],
                "slots": self.slots}

    @classmethod
    def from_config(cls, data: dict) -> "StaticDeclaration":
        if data.get("v") != VERSION:
            raise ValueError(f"static declaration version {data.get('v')!r}, this worker speaks {VERSION}")
        return cls(tuple(to_address(a) for a in data["points"]), tuple(to_address(a) for a in data["writes"]),
                   int(data["slots"]))

    def buffer_bytes(self, max_num_batched_tokens: int, d_model: int, itemsize: int) -> int:
        """The persistent memory the declared set takes in each worker (see static_taps)."""
        taps = len(self.points) * (max_num_batched_tokens + 1) * d_model
        sites = len(self.writes) * (self.slots + 1) * (2 * d_model + 2)
        return (taps + sites) * itemsize

    # every request's plan is checked against the declared set before it is sent (the client's
    # refusal): a set lookup per address, not a scan of the tuple (with resid_post, attn_out and
    # mlp_out at each of 36 layers, scanning the tuple took 0.67 ms a check in a tight loop, 12 us as a set)
    @cached_property
    def point_set(self) -> frozenset[Address]:
        return frozenset(self.points)

    @cached_property
    def write_set(self) -> frozenset[Address]:
        return frozenset(self.writes)


def _addresses(value: Any, default_names: tuple[str, ...], graph, what: str) -> tuple[Address, ...]:
    if value is None:
        return ()
    if isinstance(value, str) and value == "auto":
        names = {p.name for p in graph.points()}
        return tuple(Address(name, layer) for layer in range(graph.n_layers) for name in default_names
                     if name in names)
    if isinstance(value, (str, Address)):
        value = [value]
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{what} must be 'auto' or a list of points like 'resid_post.3', got {value!r}") from None
    return tuple(dict.fromkeys(to_address(item) for item in items))


def declare(spec, graph, static_points: Any, static_writes: Any, slots: int = DEFAULT_SLOTS) -> StaticDeclaration:
    """The declared set, or a clear error naming what cannot be compiled in and why."""
    from interp_engine._capabilities import CapabilityUnsupported

    if static_points is None:
        static_points = "auto"
    if static_writes is None and static_points == "auto":
        static_writes = "auto"
    points = _addresses(static_points, AUTO_POINTS, graph, "static_points")
    writes = _addresses(static_writes, AUTO_WRITES, graph, "static_writes")
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 4096:
        raise ValueError(f"static_slots must be an int in [1, 4096], got {slots!r}")
    for address, writing in [(a, False) for a in points] + [(a, True) for a in writes]:
        graph.check_address(address)  # names what exists on this model when it does not
        point = POINTS[address.name]
        tap = (spec.vllm_writes.get(address.name) if writing else None) or spec.vllm.get(address.name)
        if not point.vllm_static or tap is None or tap.source not in STATIC_SOURCES or tap.sharded:
            raise CapabilityUnsupported(
                "static_point", "vllm-static", detail=f"{address} on {spec.arch}",
                why=f"only residual-width points ({', '.join(sorted(n for n, p in POINTS.items() if p.vllm_static))}) "
                    "are compiled into vLLM's graph as taps",
                instead=f"declare only those, or use backend='vllm' (hooks) for {address.name}")
        if writing and not point.writable:
            raise ValueError(f"{address} cannot be steered: static_writes takes writable points")
    return StaticDeclaration(points, writes, slots)
