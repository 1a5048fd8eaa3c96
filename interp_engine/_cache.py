"""An immutable activation cache keyed by Address, whose every tensor has its point's shape."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterator, Mapping

import torch

from ._address import Address, AddressLike, to_address
from ._points import POINTS

__all__ = ["Cache"]

_MASK_KEY = "__attention_mask__"

# positions to keep (TransformerLens's pos_slice): None keeps all; an int keeps one and drops
# the position axis; a slice, list or tuple of ints keeps those and the axis
PosSlice = int | slice | list | tuple | None


def _positions(t: torch.Tensor, pos_slice: PosSlice, keepdim: bool = False) -> torch.Tensor:
    """``t`` ``[batch, pos, ...]`` at the positions ``pos_slice`` names (``keepdim``: an int keeps
    a length-1 position axis)."""
    if pos_slice is None:
        return t
    if isinstance(pos_slice, bool) or not isinstance(pos_slice, (int, slice, list, tuple)) or (
            isinstance(pos_slice, (list, tuple)) and not all(isinstance(i, int) and not isinstance(i, bool)
                                                            for i in pos_slice)):
        raise TypeError(f"pos_slice must be an int, a slice, or a list/tuple of ints, got {pos_slice!r}")
    n = t.shape[1]
    picks = [pos_slice] if isinstance(pos_slice, int) else pos_slice
    if not isinstance(picks, slice):
        bad = [i for i in picks if not -n <= i < n]
        if bad:
            raise IndexError(f"pos_slice {pos_slice!r} names positions {bad} outside the {n} this cache holds")
    if isinstance(pos_slice, int):
        return t[:, pos_slice:pos_slice + 1 or None] if keepdim else t[:, pos_slice]
    if isinstance(pos_slice, slice):
        return t[:, pos_slice]
    return t[:, list(pos_slice)]


def _dims_of(address: Address, graph: Any) -> tuple[str, ...]:
    dims = (graph.point(address.name) if graph is not None else POINTS[address.name]).dims
    if address.stream is not None:
        dims = tuple(d for d in dims if d != "n_streams")
    return dims


def _exact_shapes(values: Mapping[Address, Any], graph: Any, batch: int, pos: int) -> bool:
    """Whether every value is a tensor of exactly ``graph.shape_of`` its (existing) address at
    ``batch`` and ``pos``."""
    for address, t in values.items():
        graph.check_address(address)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != graph.shape_of(address, batch, pos):
            return False
    return True


def check_shapes(values: Mapping[Address, Any], graph: Any, batch: int, pos: int) -> None:
    """Raise as ``Cache(values, <a [batch, pos] mask>, graph)`` would, without building one:
    for a capture that returns a plain dict (the async capture method). Exact shapes pass at a
    lookup and a compare each; anything else goes through Cache, which says what is wrong."""
    if not _exact_shapes(values, graph, batch, pos):
        Cache(values, torch.ones((batch, pos), dtype=torch.long), graph)


@dataclass(frozen=True, eq=False)
class Cache:
    """Captured activations, ``[batch, pos, ...]`` per Address.

    Lookup by ``Address`` or its string form (``cache["resid_post.3"]``), or ``get(name, layer)``.
    ``attention_mask`` is ``[batch, pos]`` (1 on real tokens); padded positions hold zeros.
    Built with ``graph`` (as every cache the library returns is), each tensor must have exactly
    ``graph.shape_of`` its address; without one, the tensors must at least agree with each other
    on every named dimension (one batch, one pos, one d_model...).
    """

    _values: Mapping[Address, torch.Tensor] = field(repr=False)
    attention_mask: torch.Tensor | None = field(default=None, repr=False)
    graph: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        values = {to_address(a): t for a, t in dict(self._values).items()}
        if not self._shapes_match(values):
            self._check_dims(values)
        object.__setattr__(self, "_values", MappingProxyType(values))

    def _shapes_match(self, values: dict[Address, Any]) -> bool:
        """Whether every value is a tensor of exactly the shape the graph gives its address at
        the mask's batch and pos: the usual case, checked by comparing whole shapes. False
        sends the values through ``_check_dims``, which says what is wrong (or accepts what
        only agrees by dimension name: no graph, no mask, a dimension the graph sizes 0)."""
        graph, mask = self.graph, self.attention_mask
        if graph is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return False
        return _exact_shapes(values, graph, int(mask.shape[0]), int(mask.shape[1]))

    def _check_dims(self, values: dict[Address, Any]) -> None:
        sizes: dict[str, int] = {}
        if self.graph is not None:
            from ._shapes import model_dims

            sizes.update(model_dims(self.graph))
        if self.attention_mask is not None:
            mask = self.attention_mask
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                raise ValueError(f"attention_mask must be a [batch, pos] tensor, got "
                                 f"{getattr(mask, 'shape', type(mask).__name__)}")
            sizes["batch"], sizes["pos"] = int(mask.shape[0]), int(mask.shape[1])
        for address, t in values.items():
            if self.graph is not None:
                self.graph.check_address(address)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"cache value for {address} must be a torch.Tensor, got {type(t).__name__}")
            dims = _dims_of(address, self.graph)
            if t.dim() != len(dims):
                raise ValueError(f"cache value for {address} has shape {list(t.shape)}, expected "
                                 f"[{', '.join(dims)}] ({len(dims)} dims)")
            for dim, size in zip(dims, t.shape):
                dim = "pos" if dim == "key_pos" else dim
                if sizes.setdefault(dim, int(size)) != size:
                    expected = [sizes.get("pos" if d == "key_pos" else d, d) for d in dims]
                    raise ValueError(f"cache value for {address} has shape {list(t.shape)}, expected "
                                     f"{expected} ([{', '.join(dims)}]); {dim} is {sizes[dim]} here")

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
        return Cache({a: t.to(device) for a, t in self._values.items()}, mask, self.graph)

    def _n_layers(self, layer: int | None, what: str, mlp_input: bool = False) -> int:
        if self.graph is None:
            raise ValueError(f"{what} needs the model's graph: use a cache the library returned, or "
                             "Cache.load(path, graph=model.graph)")
        n = self.graph.n_layers
        top = n - 1 if mlp_input else n
        if mlp_input and layer is None:
            raise ValueError(f"{what}: mlp_input=True needs the layer whose MLP input you want, an int in "
                             f"[0, {top}]")
        if layer is None:
            return n
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= top:
            raise ValueError(f"{what}: layer must be an int in [0, {top}]"
                             + (" with mlp_input=True" if mlp_input else f" (or None for {n})") + f", got {layer!r}")
        if mlp_input and self.graph.residual_basis.parallel_block:
            raise ValueError(f"{what}: mlp_input=True has no meaning on {self.graph.arch}: its attention and MLP "
                             "read the same stream in parallel (resid_mid does not exist); leave mlp_input off")
        return layer

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: PosSlice = None, mlp_input: bool = False, return_labels: bool = False):
        """The residual stream as it stands before each layer below ``layer`` (TransformerLens
        semantics): ``resid_pre.0 .. resid_pre.{layer-1}`` (with ``resid_mid`` after each when
        ``incl_mid``), and when ``layer`` is the number of layers (the default) the last
        ``resid_post`` too (before the final norm). Returns ``[component, batch, pos, d_model]``
        (and the labels with ``return_labels``). ``apply_ln=True`` normalises each entry as
        the norm reading the stream at ``layer`` would (see ``apply_ln_to_stack``).
        ``mlp_input=True``: the stream as block ``layer``'s MLP reads it, so ``resid_pre.{layer}``
        and ``resid_mid.{layer}`` come last, and apply_ln uses that MLP's input norm.
        ``pos_slice`` keeps some positions (TransformerLens: an int drops the position axis; a
        list, tuple or slice keeps it)."""
        n = self._n_layers(layer, "accumulated_resid", mlp_input)
        names: list[str] = []
        for i in range(n):
            names.append(f"resid_pre.{i}")
            if incl_mid:
                names.append(f"resid_mid.{i}")
        if mlp_input:
            names += [f"resid_pre.{n}", f"resid_mid.{n}"]
        elif n == self.graph.n_layers:
            names.append(f"resid_post.{n - 1}")
        return self._stack(names, "accumulated_resid", return_labels, n if apply_ln else None, pos_slice, mlp_input)

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, apply_ln: bool = False,
                        pos_slice: PosSlice = None, return_labels: bool = False):
        """The residual stream before ``layer`` split into what wrote it (TransformerLens
        semantics): the embedding (``resid_pre.0``), then ``attn_out`` and ``mlp_out`` of every
        layer below ``layer``; on sequential-residual models they sum to ``resid_pre.{layer}``
        (the last ``resid_post`` for the default, all layers). Returns ``[component, batch,
        pos, d_model]`` (and the labels with ``return_labels``). ``apply_ln=True`` normalises
        each component as the norm reading the stream at ``layer`` would (see
        ``apply_ln_to_stack``): the components then sum to that norm's output less its weight
        and bias. ``mlp_input=True``: what block ``layer``'s MLP reads, so ``attn_out.{layer}``
        comes last and apply_ln uses that MLP's input norm; ``pos_slice`` as in
        ``accumulated_resid``."""
        n = self._n_layers(layer, "decompose_resid", mlp_input)
        names = ["resid_pre.0"] + [f"{kind}.{i}" for i in range(n) for kind in ("attn_out", "mlp_out")]
        if mlp_input:
            names.append(f"attn_out.{n}")
        return self._stack(names, "decompose_resid", return_labels, n if apply_ln else None, pos_slice, mlp_input)

    def apply_ln_to_stack(self, stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice: PosSlice = None) -> torch.Tensor:
        """``stack`` ``[component, batch, pos, d_model]`` (pieces of the residual stream) as the
        norm that reads the stream at ``layer`` sees each piece (TransformerLens'
        ``apply_ln_to_stack``): centred on LayerNorm models, then divided by that norm's scale,
        ``sqrt(var + eps)`` (LayerNorm) or ``sqrt(mean(x^2) + eps)`` (RMSNorm), computed over
        the whole residual stream it reads. The norm's weight and bias are not applied
        (TransformerLens folds them into the next matrix), so ``weight * sum(pieces) + bias`` is
        the norm's output on their sum.

        ``layer`` = the number of layers (the default): the final norm, on the last
        ``resid_post``; a lower ``layer``: that block's input norm, on ``resid_pre.{layer}``.
        TransformerLens reads the scale its ln hooks cached; this cache holds the residual
        stream itself, so the scale is recomputed from it, exactly as the norm computes it (in
        float32 for half-precision streams), with the kind and epsilon of ``graph.final_norm``
        (every block's input norm shares them on the architectures in the registry).
        ``mlp_input=True``: block ``layer``'s MLP input norm, on ``resid_mid.{layer}``.
        ``pos_slice``: the positions ``stack`` holds (as ``accumulated_resid`` took them), so
        each keeps its own scale."""
        n = self._n_layers(layer, "apply_ln_to_stack", mlp_input)
        norm = self.graph.final_norm
        basis = self.graph.residual_basis
        if norm is None or basis.n_streams != 1 or not basis.lens_valid:
            from ._capabilities import CapabilityUnsupported

            raise CapabilityUnsupported("logit_lens", "any", detail=f"apply_ln on {self.graph.arch}: "
                                        f"{basis.describe()}" + ("" if norm else "; the final norm is unknown"))
        if mlp_input:
            source = f"resid_mid.{n}"
        else:
            source = f"resid_post.{n - 1}" if n == self.graph.n_layers else f"resid_pre.{n}"
        if source not in self:
            raise KeyError(f"apply_ln at layer {n} divides by the norm's scale over {source}, which this cache "
                           f"does not hold: capture it too, e.g. run_with_cache(model, tokens, [..., '{source}'])")
        resid = _positions(self[source], pos_slice, keepdim=True)
        work = torch.float32 if resid.dtype in (torch.float16, torch.bfloat16) else resid.dtype
        resid = resid.to(work)
        if norm.kind == "layer":
            variance = resid.var(-1, keepdim=True, unbiased=False)
        else:
            variance = resid.pow(2).mean(-1, keepdim=True)
        scale = (variance + norm.eps).sqrt()
        if isinstance(pos_slice, int) and not isinstance(pos_slice, bool):
            scale = scale.squeeze(-2)  # the stack has no position axis left
        pieces = stack.to(work)
        if norm.kind == "layer":
            pieces = pieces - pieces.mean(-1, keepdim=True)
        return (pieces / scale).to(stack.dtype)

    def _stack(self, names: list[str], what: str, return_labels: bool, ln_layer: int | None = None,
               pos_slice: PosSlice = None, mlp_input: bool = False):
        missing = [n for n in names if n not in self]
        if missing:
            raise KeyError(f"{what} needs {', '.join(missing)}, which this cache does not hold: capture "
                           f"them, for example run_with_cache(model, tokens, {sorted(set(missing))!r})")
        stacked = torch.stack([_positions(self[n], pos_slice) for n in names])
        if ln_layer is not None:
            stacked = self.apply_ln_to_stack(stacked, ln_layer, mlp_input, pos_slice)
        return (stacked, names) if return_labels else stacked

    def __reduce__(self):
        # the mapping proxy cannot be pickled; rebuild (and re-check) from a plain dict
        return (Cache, (dict(self._values), self.attention_mask, self.graph))

    def save(self, path: str | os.PathLike) -> None:
        """Write every tensor and the attention mask to a safetensors file at ``path``.

        Addresses are the tensor names; the graph is not written (``Cache.load`` takes one back).
        """
        from safetensors.torch import save_file

        tensors = {str(a): t.detach().contiguous().cpu() for a, t in self._values.items()}
        if _MASK_KEY in tensors:
            raise ValueError(f"an address is named {_MASK_KEY!r}, which save() reserves for the mask")
        if self.attention_mask is not None:
            tensors[_MASK_KEY] = self.attention_mask.detach().contiguous().cpu()
        save_file(tensors, os.fspath(path), metadata={"format": "interp_engine.Cache", "version": "1"})

    @classmethod
    def load(cls, path: str | os.PathLike, graph: Any = None) -> "Cache":
        """Read a file written by ``save``; with ``graph`` every shape is checked against the model."""
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt") as f:
            if (f.metadata() or {}).get("format") != "interp_engine.Cache":
                raise ValueError(f"{path} was not written by Cache.save (no interp_engine.Cache metadata)")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        mask = tensors.pop(_MASK_KEY, None)
        return cls(tensors, mask, graph)

    def __repr__(self) -> str:
        inner = ", ".join(f"{a}: {tuple(t.shape)}" for a, t in self._values.items())
        return f"Cache({inner})"
