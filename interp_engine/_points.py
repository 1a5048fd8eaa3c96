"""The global point table: every activation point the library knows, its shape in the fixed
dimension vocabulary, what it means, and which backends can serve it.

Dimension names (one vocabulary everywhere): batch, pos, key_pos, d_model, d_vocab, n_heads,
n_kv_heads, d_head, d_mlp, n_experts, top_k, n_streams.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

__all__ = ["POINTS", "PointSpec", "BACKENDS", "Split"]

BACKENDS = ("eager", "vllm", "vllm-static")


@dataclass(frozen=True)
class PointSpec:
    """One point: its name, its shape as named dims, its meaning and where it is served."""

    name: str
    dims: tuple[str, ...]
    meaning: str
    eager: bool
    vllm: bool
    vllm_static: bool
    writable: bool = False  # can a SteerSpec write here (d_model-wide points only)
    per_stream: bool = False  # takes Address(name, layer, stream)
    capability: str | None = None  # the CAPABILITIES entry that explains a refusal
    kind: str = "dense"  # "dense": every model; "mlp": dense-MLP layers; "moe": MoE layers; "streams"

    def served_by(self, backend: str) -> bool:
        return {"eager": self.eager, "vllm": self.vllm, "vllm-static": self.vllm_static}[backend]

    def with_backends(self, **flags: object) -> "PointSpec":
        return replace(self, **flags)


@dataclass(frozen=True)
class Split:
    """One part of a fused output (``qkv_proj``, ``gate_up_proj``, ``c_attn``): the last dim
    holds ``parts`` side by side, each as wide as the product of its graph dims, and the point
    is part ``index``. With ``per`` (a graph dim, e.g. ``n_heads``) the last dim is that many
    groups each laid out as ``parts`` (GPT-NeoX's per-head q | k | v), and the part is taken
    from every group. Declared in a spec's tap; the bridge applies it to the raw tensor."""

    parts: tuple[tuple[str, ...], ...]
    index: int
    per: str | None = None

    def __post_init__(self) -> None:
        parts = tuple(tuple(p) for p in self.parts)
        object.__setattr__(self, "parts", parts)
        if not 0 <= self.index < len(parts):
            raise ValueError(f"Split index {self.index} out of range for {len(parts)} parts")

    def _widths(self, graph) -> list[int]:
        widths = []
        for dims in self.parts:
            width = 1
            for dim in dims:
                width *= graph.dim_size(dim)
            widths.append(width)
        return widths

    def bounds(self, graph) -> tuple[int, int]:
        """(start, stop) of the part along the last dim (within each group, with ``per``), for
        ``graph``'s sizes."""
        widths = self._widths(graph)
        start = sum(widths[: self.index])
        return start, start + widths[self.index]

    def columns(self, graph, cols: "tuple[int, ...] | None" = None) -> list[int]:
        """Where columns ``cols`` of the part's flat row (every column with None) sit in the
        fused row: what a write at the part edits of the fused output."""
        widths = self._widths(graph)
        start = sum(widths[: self.index])
        width = widths[self.index]
        groups = 1 if self.per is None else graph.dim_size(self.per)
        every = range(groups * width) if cols is None else cols
        return [(c // width) * sum(widths) + start + c % width for c in every]

    def take(self, t, graph):
        start, stop = self.bounds(graph)
        if self.per is None:
            return t[..., start:stop]
        groups = t.unflatten(-1, (graph.dim_size(self.per), -1))
        return groups[..., start:stop].flatten(-2)


_R = ("batch", "pos", "d_model")


def _p(*args, **kwargs) -> PointSpec:
    return PointSpec(*args, **kwargs)


POINTS = MappingProxyType(
    {
        p.name: p
        for p in (
            _p("resid_pre", _R, "residual stream entering the layer (embeddings for layer 0)",
               True, True, True, writable=True),
            _p("resid_mid", _R, "residual stream after attention is added, before the MLP",
               True, True, True, writable=True),
            _p("resid_post", _R, "residual stream leaving the layer",
               True, True, True, writable=True),
            _p("attn_out", _R, "what the attention block adds to the residual stream",
               True, True, True, writable=True),
            _p("mlp_out", _R, "what the MLP (or MoE) block adds to the residual stream",
               True, True, True, writable=True),
            _p("q", ("batch", "pos", "n_heads", "d_head"),
               "queries per head, after any per-head norm and before rotary embedding",
               True, True, False, capability="attention_internals"),
            _p("k", ("batch", "pos", "n_kv_heads", "d_head"),
               "keys per KV head, after any per-head norm and before rotary embedding",
               True, True, False, capability="attention_internals"),
            _p("v", ("batch", "pos", "n_kv_heads", "d_head"), "values per KV head",
               True, True, False, capability="attention_internals"),
            _p("z", ("batch", "pos", "n_heads", "d_head"),
               "attention output per head, before the output projection",
               True, True, False),
            _p("pattern", ("batch", "n_heads", "pos", "key_pos"),
               "attention probabilities (query position by key position) per head",
               True, True, False, capability="attention_pattern"),
            _p("mlp_pre", ("batch", "pos", "d_mlp"),
               "MLP gate pre-activation (gate_proj output)",
               True, True, False, capability="mlp_internals", kind="mlp"),
            _p("mlp_act", ("batch", "pos", "d_mlp"),
               "MLP hidden activation entering down_proj (act(gate) * up)",
               True, True, False, capability="mlp_internals", kind="mlp"),
            _p("router_logits", ("batch", "pos", "n_experts"), "MoE router logits per expert",
               True, True, False, kind="moe"),
            _p("expert_weights", ("batch", "pos", "top_k"),
               "routing weights of the selected experts, as the model applies them",
               True, True, False, capability="expert_selection", kind="moe"),
            _p("expert_indices", ("batch", "pos", "top_k"), "indices of the selected experts",
               True, True, False, capability="expert_selection", kind="moe"),
            _p("resid_streams", ("batch", "pos", "n_streams", "d_model"),
               "the parallel residual streams leaving the layer (one stream with a stream index)",
               True, False, False, per_stream=True, capability="parallel_residual_streams",
               kind="streams"),
        )
    }
)
