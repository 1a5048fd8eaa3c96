"""A steered view of a model: the functional form of ``steer(model, spec)``.

``steered(model, spec)`` returns a Model that shares everything with ``model`` (its backend,
graph, tokenizer: no copy, no reload) and applies ``spec`` to every forward run on it, before
any ``steer`` block entered on it or on ``model``. ``model`` itself is unchanged, so code that
passes models around can hold a steered one and a plain one side by side.
"""

from __future__ import annotations

from ._model import Model
from ._plan import Plan, SteerSpec, steer_plan

__all__ = ["SteeredModel", "steered"]


class SteeredModel(Model):
    """``base`` with ``view_spec`` applied on every call (see ``steered``)."""

    base: Model
    view_spec: SteerSpec

    def __repr__(self) -> str:
        return f"SteeredModel({self.name!r}, {len(self.view_spec)} ops)"


def steered(model: Model, spec: SteerSpec) -> SteeredModel:
    """A view of ``model`` that applies ``spec`` to everything run on it (``run_with_cache``,
    generation, ``run``); a view of a view composes (inner spec first). Checked against the
    model before any forward."""
    if isinstance(spec, Plan):
        spec = spec.steering
    if not isinstance(spec, SteerSpec):
        raise TypeError(f"steered takes a SteerSpec, got {type(spec).__name__}: build one with "
                        "SteerSpec.add / .zero / .patch ...")
    if not isinstance(model, Model):
        raise TypeError(f"steered takes a loaded Model first, got {type(model).__name__}")
    base, inner = (model.base, model.view_spec) if isinstance(model, SteeredModel) else (model, SteerSpec())
    composed = inner | spec
    steer_plan(base.graph, composed, base.dtype)  # raise now, before any forward
    refusal = base.backend.refusal(Plan(writes=composed.ops), None)
    if refusal is not None:
        raise refusal
    view = object.__new__(SteeredModel)
    view.__dict__.update(base.__dict__)
    view.base, view.view_spec = base, composed
    return view
