"""Strategies for what users pass: token sequences, points valid for a model, steering specs,
sampling parameters, address strings."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from interp_engine import POINTS, Address, SteerSpec


def token_ids(model, min_size: int = 1, max_size: int = 24):
    return st.lists(st.integers(0, model.d_vocab - 1), min_size=min_size, max_size=max_size)


def token_batches(model, max_batch: int = 3, max_size: int = 16):
    return st.lists(token_ids(model, 1, max_size), min_size=1, max_size=max_batch)


def addresses(model, backend: str | None = None, writable: bool = False):
    points = [p for p in model.points()
              if (backend is None or p.served_by(backend)) and (p.writable or not writable)]
    return st.sampled_from(points).flatmap(
        lambda p: st.sampled_from(model.graph.layers_of(p.name)).map(lambda layer: Address(p.name, layer)))


def vectors(d_model: int, rows: int | None = None):
    shape = (d_model,) if rows is None else (rows, d_model)
    return st.integers(0, 2**31 - 1).map(
        lambda seed: torch.randn(shape, generator=torch.Generator().manual_seed(seed)))


@st.composite
def steer_recipes(draw, model, max_ops: int = 3, max_pos: int = 24, one_per_site: bool = False):
    """What a caller builds a spec from: a list of ``(op, site, vector, scale, positions)``.
    The vectors are the caller's own tensors (laws check that nothing edits them).
    ``one_per_site``: every op at its own site (vllm-static compiles one op per site and request)."""
    recipe = []
    for _ in range(draw(st.integers(1, max_ops))):
        site = draw(addresses(model, writable=True))
        if one_per_site and any(site == r[1] for r in recipe):
            continue
        op = draw(st.sampled_from(["add", "ablate", "set"]))
        positions = draw(st.one_of(
            st.sampled_from(["all", "prompt", "generated"]),
            st.lists(st.integers(0, max_pos), min_size=1, max_size=3, unique=True).map(tuple)))
        if op == "add":
            per_position = isinstance(positions, tuple) and draw(st.booleans())
            vec = draw(vectors(model.d_model, len(positions) if per_position else None))
            scale = draw(st.floats(-4.0, 4.0, allow_nan=False))
            recipe.append(("add", site, vec, scale, positions))
        elif op == "ablate":
            recipe.append(("ablate", site, draw(vectors(model.d_model)), 1.0, positions))
        else:
            recipe.append(("set", site, draw(vectors(model.d_model)) * 3, 1.0, positions))
    return recipe


def build_spec(recipe) -> SteerSpec:
    spec = SteerSpec()
    for op, site, vec, scale, positions in recipe:
        if op == "add":
            spec = spec | SteerSpec.add(site, vec, scale=scale, positions=positions)
        elif op == "ablate":
            spec = spec | SteerSpec.ablate(site, vec, positions=positions)
        else:
            spec = spec | SteerSpec.set(site, vec, positions=positions)
    return spec


def steer_specs(model, max_ops: int = 3, max_pos: int = 24, one_per_site: bool = False):
    return steer_recipes(model, max_ops, max_pos, one_per_site).map(build_spec)


def sampling(max_tokens: int = 8):
    return st.fixed_dictionaries({
        "max_tokens": st.integers(1, max_tokens),
        "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.3]),
        "top_k": st.sampled_from([0, 1, 5, 50]),
        "top_p": st.sampled_from([1.0, 0.9, 0.5]),
        "seed": st.integers(0, 2**16),
    })


def valid_address_strings():
    names = st.sampled_from(sorted(POINTS))
    return st.tuples(names, st.integers(0, 200), st.none() | st.integers(0, 8)).map(
        lambda t: f"{t[0]}.{t[1]}" + (f".{t[2]}" if t[2] is not None and POINTS[t[0]].per_stream else ""))
