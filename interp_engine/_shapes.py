"""Shape checks at the public entry points.

Public functions carry jaxtyping annotations in one vocabulary of dimension names
(``batch pos key_pos d_model d_vocab n_heads n_kv_heads d_head d_mlp n_experts top_k
n_streams``). ``@entry`` checks them with beartype when the function is called, inside one
jaxtyping memo in which the names the annotations use are first bound to the loaded model's
own sizes, so a wrong width is reported against the model's ``d_model`` (not against whatever
the first argument happened to be). Checks run once per public call: never inside hook
closures or decode steps.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Callable

import torch
from beartype.door import is_bearable
from jaxtyping import AbstractArray, Shaped, jaxtyped

__all__ = ["DIMS", "ShapeError", "describe_hint", "entry", "model_dims"]

DIMS = ("batch", "pos", "key_pos", "d_model", "d_vocab", "n_heads", "n_kv_heads", "d_head",
        "d_mlp", "n_experts", "top_k", "n_streams")
MODEL_DIMS = ("d_model", "d_vocab", "n_heads", "n_kv_heads", "d_head", "d_mlp", "n_experts",
              "top_k", "n_streams")


class ShapeError(ValueError, TypeError):
    """A tensor argument has the wrong shape or dtype for the model it is used with (a
    ValueError and a TypeError: catch either)."""


def model_dims(graph) -> dict[str, int]:
    """The model-bound dimension names and their sizes (0-sized ones left out: a dense model
    has no ``n_experts``)."""
    sizes = {
        "d_model": graph.d_model, "d_vocab": graph.d_vocab, "n_heads": graph.n_heads,
        "n_kv_heads": graph.n_kv_heads, "d_head": graph.d_head, "d_mlp": graph.d_mlp or 0,
        "n_experts": graph.n_experts, "top_k": graph.top_k,
        "n_streams": graph.residual_basis.n_streams,
    }
    return {k: v for k, v in sizes.items() if v}


@functools.lru_cache(maxsize=None)
def _probe_hint(dim: str):
    return Shaped[torch.Tensor, dim]


@functools.lru_cache(maxsize=4096)
def _probe(size: int) -> torch.Tensor:
    return torch.empty(size, device="meta")


def _array_hints(hint) -> list:
    """The jaxtyping array types inside ``hint`` (through Union / Optional / Sequence...)."""
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        return [hint]
    return [h for arg in typing.get_args(hint) for h in _array_hints(arg)]


def _dim_names(hint) -> set[str]:
    names: set[str] = set()
    for array in _array_hints(hint):
        for part in array.dim_str.split():
            names.add(part.lstrip("*#_").split("=")[0])
    return names


def describe_hint(hint) -> str:
    arrays = _array_hints(hint)
    if not arrays:
        return getattr(hint, "__name__", str(hint))
    kinds = []
    for a in arrays:
        kind = a.__name__.split("[")[0].lower()  # Float / Int / Shaped ...
        kinds.append(f"{kind} [{', '.join(a.dim_str.split())}]")
    return " or ".join(dict.fromkeys(kinds))


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} and dtype {value.dtype}"
    return f"a {type(value).__name__}"


def _tensor_only(hint) -> bool:
    """True when every alternative of ``hint`` is a tensor type."""
    args = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,)
    return all(_array_hints(a) for a in args)


def entry(fn: Callable | None = None, *, model: str = "model", name: str | None = None) -> Callable:
    """Decorate a public function whose parameters carry jaxtyping annotations: at call time
    bind the model-bound dimension names to the sizes of the argument named ``model`` (a
    Model, or ``self`` for methods), then check every annotated tensor parameter, raising
    ShapeError naming the parameter, what it got, and what this model expects."""
    if fn is None:
        return functools.partial(entry, model=model, name=name)
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn, include_extras=True)
    checked = [(param, hint, _tensor_only(hint)) for param, hint in hints.items()
               if param in sig.parameters and _array_hints(hint)]
    used = sorted(set().union(*(_dim_names(h) for _, h, _ in checked)) & set(MODEL_DIMS)) if checked else []
    label = name or fn.__qualname__.lstrip("_")
    # every checked parameter also takes non-tensors (token lists...): a call passing no tensor
    # at all has nothing to check, known without binding its arguments (~10 us a call)
    lenient = all(not tensor_only for _, _, tensor_only in checked)

    def check(args: tuple, kwargs: dict) -> None:
        if not checked:
            return
        if lenient and not any(isinstance(a, torch.Tensor) for a in args) \
                and not any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return
        bound = sig.bind(*args, **kwargs)
        # lists, batches...: the function checks those itself, by name
        todo = [(param, hint, bound.arguments[param]) for param, hint, tensor_only in checked
                if param in bound.arguments and (tensor_only or isinstance(bound.arguments[param], torch.Tensor))]
        if not todo:
            return  # no tensor to check: no dimension to bind either
        owner = bound.arguments.get(model)
        graph = getattr(owner, "graph", None)
        sizes = model_dims(graph) if graph is not None else {}
        with jaxtyped("context"):
            for dim in used:
                if dim in sizes:
                    isinstance(_probe(sizes[dim]), _probe_hint(dim))
            for param, hint, value in todo:
                if not is_bearable(value, hint):
                    bound_dims = ", ".join(f"{d}={sizes[d]}" for d in used if d in sizes)
                    where = f" with {bound_dims} on this {graph.arch} model" if bound_dims else ""
                    raise ShapeError(
                        f"{label}: {param} is {_describe_value(value)}, expected "
                        f"{describe_hint(hint)}{where}")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        check(args, kwargs)  # at the call: before a coroutine or generator it returns first runs
        return fn(*args, **kwargs)

    wrapper.__entry_checked__ = tuple(param for param, _, _ in checked)  # type: ignore[attr-defined]
    return wrapper
