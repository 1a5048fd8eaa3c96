"""The immutable model graph: what a loaded model is, as plain data read from its config.

Built by ``specs/<arch>.py`` from a Hugging Face config; never touches weights or hooks, so
every question it answers is answerable before any forward runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from ._address import Address, AddressLike, to_address
from ._capabilities import CapabilityUnsupported
from ._points import POINTS, PointSpec

__all__ = ["FinalNorm", "GradSupport", "ModelGraph", "ResidualBasis"]


@dataclass(frozen=True)
class ResidualBasis:
    """The shape of the residual stream: one additive stream, or several parallel ones."""

    n_streams: int
    additive: bool
    lens_valid: bool
    note: str = ""
    parallel_block: bool = False  # attention and MLP read the same input: no resid_mid

    def describe(self) -> str:
        if self.n_streams == 1:
            text = ("one additive residual stream: resid_post.L = resid_pre.L + attn_out.L + "
                    "mlp_out.L, read by the final norm and unembedding")
            if self.parallel_block:
                text += ("; parallel blocks: attention and the MLP both read resid_pre, so "
                         "resid_mid has no meaning and is refused (capability sequential_block)")
        else:
            text = (f"{self.n_streams} parallel residual streams mixed by learned hyper-connections; "
                    "resid_* name the [n_streams, d_model] stack, which no sublayer reads directly")
        text += f"; additive={self.additive}; logit lens {'valid' if self.lens_valid else 'not valid'}"
        return text + (f"; {self.note}" if self.note else "")


@dataclass(frozen=True)
class FinalNorm:
    """What the final norm divides by, read from the config (not its weights): ``kind``
    ``"layer"`` (LayerNorm: centre, then divide by ``sqrt(var + eps)``) or ``"rms"`` (RMSNorm,
    Gemma's included: divide by ``sqrt(mean(x^2) + eps)``). Every block's input norm has the
    same kind and epsilon on the architectures in the registry."""

    kind: str
    eps: float

    def __post_init__(self) -> None:
        if self.kind not in ("layer", "rms"):
            raise ValueError(f"FinalNorm.kind is 'layer' or 'rms', got {self.kind!r}")


@dataclass(frozen=True)
class GradSupport:
    """What gradients this loaded instance can produce, known before any forward."""

    through_forward: bool
    to_parameters: bool
    backend: str
    reason: str

    def describe(self) -> str:
        if self.through_forward:
            where = "to the parameters and to captured tensors" if self.to_parameters else \
                "to captured tensors and inputs (parameters are frozen)"
            return f"gradients flow through the {self.backend} forward {where}: {self.reason}"
        return f"no gradients on this instance ({self.backend}): {self.reason}"


@dataclass(frozen=True)
class ModelGraph:
    """Static facts about one architecture instance."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_vocab: int
    d_mlp: int | None
    n_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    residual_basis: ResidualBasis
    final_logit_softcap: float | None = None
    final_norm: FinalNorm | None = None  # None: unknown, so Cache(apply_ln=True) is refused
    point_table: tuple[PointSpec, ...] = field(default=(), repr=False)

    # ---- points -----------------------------------------------------------------
    def points(self) -> tuple[PointSpec, ...]:
        return self.point_table

    @cached_property
    def _by_name(self) -> dict[str, PointSpec]:
        return {spec.name: spec for spec in self.point_table}

    @cached_property
    def _checked(self) -> dict:
        return {}  # addresses already validated against this graph (it is immutable)

    def point(self, name: str) -> PointSpec:
        spec = self._by_name.get(name)
        if spec is not None:
            return spec
        known = POINTS.get(name)
        valid = ", ".join(p.name for p in self.point_table)
        if name == "resid_mid" and self.residual_basis.parallel_block:
            raise CapabilityUnsupported("sequential_block", "any", detail=f"resid_mid on this {self.arch} model")
        if known is None:
            raise ValueError(f"unknown point name {name!r}; points on this {self.arch} model: {valid}")
        raise ValueError(
            f"point {name!r} does not exist on this {self.arch} model "
            f"({known.meaning}); points on this model: {valid}"
        )

    def layers_of(self, name: str) -> tuple[int, ...]:
        return self._layers_of_kind(self.point(name).kind)

    def check_address(self, value: AddressLike) -> Address:
        """Return the Address if it exists on this model; otherwise raise naming what is valid."""
        address = to_address(value)
        if address in self._checked:
            return address
        spec = self.point(address.name)
        layers = self.layers_of(address.name)
        if address.layer not in layers:
            if address.layer >= self.n_layers:
                raise ValueError(
                    f"layer {address.layer} out of range in {address}: this {self.arch} model has "
                    f"{self.n_layers} layers (0..{self.n_layers - 1})"
                )
            raise ValueError(f"{address} does not exist: {address.name} is only at layers {list(layers)}")
        if address.stream is not None and address.stream >= self.residual_basis.n_streams:
            raise ValueError(
                f"stream {address.stream} out of range in {address}: this model has "
                f"{self.residual_basis.n_streams} streams (0..{self.residual_basis.n_streams - 1})"
            )
        del spec
        self._checked[address] = True
        return address

    def shape_of(self, address: Address, batch: int, pos: int) -> tuple[int, ...]:
        # asked per captured point per request (every Cache and capture checks its rows): the
        # shapes asked for are few (points x prompt lengths), kept once worked out
        key = (address.name, address.stream is None, batch, pos)
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= 4096:
                self._shapes.clear()
            shape = self._shapes[key] = self._shape_of(address, batch, pos)
        return shape

    @cached_property
    def _shapes(self) -> dict:
        return {}  # (point name, whole stack, batch, pos) -> shape_of's answer

    def _shape_of(self, address: Address, batch: int, pos: int) -> tuple[int, ...]:
        key = (address.name, address.stream is None)
        sized = self._sized_dims.get(key)
        if sized is None:  # the point's dims, model sizes filled in (batch and pos by name)
            dims = self.point(address.name).dims
            if address.stream is not None:
                dims = tuple(d for d in dims if d != "n_streams")
            sized = self._sized_dims[key] = tuple(d if d in ("batch", "pos", "key_pos") else self.dim_size(d)
                                                  for d in dims)
        sizes = {"batch": batch, "pos": pos, "key_pos": pos}
        return tuple(sizes[d] if d.__class__ is str else d for d in sized)

    @cached_property
    def _sized_dims(self) -> dict:
        return {}  # (point name, whole stack) -> its dims, model sizes filled in (shape_of)

    def dim_size(self, dim: str) -> int:
        """The size of a model dimension (not batch/pos) on this graph."""
        sizes = self._dim_sizes
        if dim not in sizes:
            raise ValueError(f"unknown model dimension {dim!r}; known: {', '.join(sizes)}")
        return sizes[dim]

    @cached_property
    def _dim_sizes(self) -> dict[str, int]:
        return {
            "d_model": self.d_model, "d_vocab": self.d_vocab, "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads, "d_head": self.d_head, "d_mlp": self.d_mlp or 0,
            "n_experts": self.n_experts, "top_k": self.top_k,
            "n_streams": self.residual_basis.n_streams,
        }

    def with_points(self, table: tuple[PointSpec, ...]) -> "ModelGraph":
        """This graph serving ``table``, less the points it has at no layer (the dense-MLP
        points on an all-MoE model, the MoE points on a dense one)."""
        kept = tuple(p for p in table
                     if p.kind not in ("moe", "mlp") or self._layers_of_kind(p.kind))
        return replace(self, point_table=kept)

    def _layers_of_kind(self, kind: str) -> tuple[int, ...]:
        if kind == "moe":
            return self.moe_layers
        if kind == "mlp":
            return tuple(i for i in range(self.n_layers) if i not in self.moe_layers)
        return tuple(range(self.n_layers))

    def describe(self) -> str:
        moe = f", {self.n_experts} experts top-{self.top_k}" if self.n_experts else ""
        return (f"{self.arch}: {self.n_layers} layers, d_model {self.d_model}, {self.n_heads} heads "
                f"({self.n_kv_heads} KV) of {self.d_head}, vocab {self.d_vocab}{moe}")
