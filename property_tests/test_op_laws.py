"""Laws of the intervention ops (SteerSpec.add / set / ablate / zero / mean / scale / patch, with
heads= / neurons= selectors), on eager and inside vLLM's workers.

What a write does is read back at the point itself: a capture at the written point sees the
write, and a write at a point never changes that point's value at other positions or entries
(the value there was computed before the write), so the capture under a write is the plain
capture with the op applied by hand at the selected positions and heads / neurons. The
references below are written here, on the captured tensors, without the library's op math,
row selection or selector columns. Outputs are the logits (eager) or the last layer's residual
stream decoded by the model's own head (vLLM, which never ships logits out of its workers)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, strategies as st

from interp_engine import Address, Cache, SteerSpec, run_with_cache
from interp_engine._plan import is_write_site, steer_plan, unit_dims
from interp_engine.testing import VLLM_ARCHS, assert_close_scaled
from strategies import token_ids

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")

# A bounded set: a Llama-family model, Gemma 2 (soft-caps, sandwich norms), GPT-2 (LayerNorm,
# Conv1D projections, a fused qkv); vLLM on the first two.
EAGER_ARCHS = ("qwen3", "gemma2", "gpt2")
ON_VLLM = tuple(a for a in ("qwen3", "gemma2") if a in VLLM_ARCHS)
BACKENDS = [(a, "eager") for a in EAGER_ARCHS] + [
    pytest.param(a, "vllm", marks=[needs_vllm, pytest.mark.vllm]) for a in ON_VLLM]
HEAD_POINTS = ("q", "k", "v", "z")
NEURON_POINTS = ("mlp_pre", "mlp_act")
VECTOR_OPS = ("add", "set", "ablate", "mean")


def _model(model_pool, arch, backend):
    return model_pool.get(arch) if backend == "eager" else model_pool.get(arch, backend)


def _write_sites(model) -> list[Address]:
    """Every (point, layer) this model's backend accepts a write at."""
    sites = []
    for point in model.points():
        if not is_write_site(point):
            continue
        for layer in model.graph.layers_of(point.name):
            address = Address(point.name, layer)
            plan = steer_plan(model.graph, SteerSpec.zero(address))
            if model.backend.refusal(plan, None) is None:
                sites.append(address)
    return sites


def _unit(model, name: str) -> tuple[int, ...]:
    return tuple(model.graph.dim_size(d) for d in unit_dims(name))


def _outputs(model, ids, spec=None) -> torch.Tensor:
    """Logits ``[1, pos, d_vocab]``: eager returns them; on vLLM the last resid_post is decoded
    through vLLM's own final norm and head."""
    if model.backend_name == "eager":
        logits, _ = run_with_cache(model, ids, [], return_logits=True, steer=spec)
        return logits
    last = f"resid_post.{model.n_layers - 1}"
    cache = run_with_cache(model, ids, [last], steer=spec)
    return model.decode_residuals(cache, log_probs=False)[0]


def _read(model, ids, site, spec=None) -> torch.Tensor:
    return run_with_cache(model, ids, [site], steer=spec)[site]


def _same(model, actual, expected, msg=""):
    """Bit for bit on eager (one engine, one kernel order); to fp32 rounding inside vLLM, whose
    fused add+norm writes resid_mid as an offset from the residual it carries."""
    if model.backend_name == "eager":
        assert torch.equal(actual, expected), f"{msg}: max |diff| {float((actual - expected).abs().max()):.3g}"
    else:
        assert_close_scaled(actual, expected, msg=msg)


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) > 1e-4 * max(1.0, float(b.abs().max()))


# ---- what a law draws ------------------------------------------------------------------------

def _positions(n: int):
    return st.one_of(st.sampled_from(["all", "prompt"]),
                     st.lists(st.integers(0, n - 1), min_size=1, max_size=3, unique=True).map(tuple))


@st.composite
def writes(draw, model, sites, n: int, names=None):
    """``(site, positions, selector kwargs)``: a site this backend writes, positions inside an
    ``n``-token forward, and (where the point has heads or neurons) maybe a subset of them."""
    pool = [s for s in sites if names is None or s.name in names]
    site = draw(st.sampled_from(pool))
    positions = draw(_positions(n))
    units = _unit(model, site.name)[0]
    select = {}
    if site.name in HEAD_POINTS and draw(st.booleans()):
        select = {"heads": sorted(draw(st.lists(st.integers(0, units - 1), min_size=1, max_size=units, unique=True)))}
    elif site.name in NEURON_POINTS and draw(st.booleans()):
        select = {"neurons": sorted(draw(st.lists(st.integers(0, units - 1), min_size=1, max_size=6, unique=True)))}
    return site, positions, select


def _patch_positions(positions):
    return "all" if positions == "prompt" else positions  # a patch takes the source's positions


def _rows(positions, n: int) -> list[int]:
    return list(range(n)) if positions in ("all", "prompt") else list(positions)


def _mask(shape, positions, select) -> torch.Tensor:
    """Which entries of a capture ``[1, pos, *unit]`` a write at ``positions`` on the selected
    heads / neurons touches, by hand."""
    mask = torch.zeros(shape, dtype=torch.bool)
    chosen = select.get("heads", select.get("neurons"))
    for p in _rows(positions, shape[1]):
        if chosen is None:
            mask[0, p] = True
        else:
            for i in chosen:
                mask[0, p, i] = True
    return mask


def _randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---- scale -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,backend", BACKENDS)
def test_scale_by_one_is_the_identity_and_by_s_multiplies_the_point(model_pool, arch, backend):
    model = _model(model_pool, arch, backend)
    sites = _write_sites(model)

    @given(ids=token_ids(model, 2, 10), data=st.data(), s=st.sampled_from([-1.0, 0.0, 0.5, 3.0]))
    def law(ids, data, s):
        site, positions, select = data.draw(writes(model, sites, len(ids)))
        plain = _read(model, ids, site)
        one = SteerSpec.scale(site, 1.0, positions=positions, **select)
        assert_close_scaled(_outputs(model, ids, one), _outputs(model, ids), msg=f"scale 1 at {site}")
        _same(model, _read(model, ids, site, one), plain, f"scale 1 at {site}")
        got = _read(model, ids, site, SteerSpec.scale(site, s, positions=positions, **select))
        mask = _mask(plain.shape, positions, select)
        _same(model, got[~mask], plain[~mask], f"scale at {site} {positions} {select} changed unselected entries")
        assert_close_scaled(got[mask], plain[mask] * s, msg=f"scale {s} at {site}")
    law()


# ---- set and mean ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch,backend", BACKENDS)
def test_set_then_capture_reads_the_set_value(model_pool, arch, backend):
    """One vector for every written position, or one row per position; mean is set with a
    mean the caller computed, so it reads back the same way."""
    model = _model(model_pool, arch, backend)
    sites = _write_sites(model)

    @given(ids=token_ids(model, 2, 10), data=st.data(), seed=st.integers(0, 999),
           op=st.sampled_from(["set", "mean"]), per_position=st.booleans())
    def law(ids, data, seed, op, per_position):
        site, positions, select = data.draw(writes(model, sites, len(ids)))
        unit = _unit(model, site.name)
        rows = _rows(positions, len(ids))
        per_position = per_position and isinstance(positions, tuple)
        v = _randn(((len(rows),) if per_position else ()) + unit, seed) * 3
        plain = _read(model, ids, site)
        got = _read(model, ids, site, getattr(SteerSpec, op)(site, v, positions=positions, **select))
        mask = _mask(plain.shape, positions, select)
        expected = plain.clone()
        for i, p in enumerate(rows):
            expected[0, p] = torch.where(mask[0, p], v[i] if per_position else v, plain[0, p])
        _same(model, got[~mask], plain[~mask], f"{op} at {site} changed unselected entries")
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    law()


@pytest.mark.parametrize("arch,backend", BACKENDS)
def test_mean_with_the_captured_mean_of_one_position_is_the_identity_there(model_pool, arch, backend):
    model = _model(model_pool, arch, backend)
    sites = _write_sites(model)

    @given(ids=token_ids(model, 2, 10), data=st.data())
    def law(ids, data):
        site, _, select = data.draw(writes(model, sites, len(ids)))
        p = data.draw(st.integers(0, len(ids) - 1))
        plain = _read(model, ids, site)
        mean = plain[:, p:p + 1].mean(dim=(0, 1))  # the mean over one position: its value
        spec = SteerSpec.mean(site, mean, positions=[p], **select)
        _same(model, _read(model, ids, site, spec), plain, f"mean of position {p} at {site}")
        assert_close_scaled(_outputs(model, ids, spec), _outputs(model, ids), msg=f"mean at {site}")
    law()


# ---- ablate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,backend", BACKENDS)
def test_ablate_leaves_the_point_orthogonal_to_the_direction(model_pool, arch, backend):
    """At each written position the selected entries lose exactly their component along the
    direction (restricted to the selected heads / neurons): what is left is orthogonal to it and
    the rest of the vector is untouched."""
    model = _model(model_pool, arch, backend)
    sites = _write_sites(model)

    @given(ids=token_ids(model, 2, 10), data=st.data(), seed=st.integers(0, 999))
    def law(ids, data, seed):
        site, positions, select = data.draw(writes(model, sites, len(ids)))
        d = _randn(_unit(model, site.name), seed)
        plain = _read(model, ids, site)
        got = _read(model, ids, site, SteerSpec.ablate(site, d, positions=positions, **select))
        mask = _mask(plain.shape, positions, select)
        _same(model, got[~mask], plain[~mask], f"ablate at {site} changed unselected entries")
        for p in _rows(positions, len(ids)):
            m = mask[0, p]
            u = d[m] / d[m].norm()
            x, y = plain[0, p][m], got[0, p][m]
            scale = float(x.abs().max())
            assert abs(float(y @ u)) <= 1e-4 * max(1.0, scale) * len(u) ** 0.5, f"position {p}: not orthogonal"
            torch.testing.assert_close(y, x - (x @ u) * u, rtol=1e-5, atol=1e-5 * max(1.0, scale))
    law()


# ---- zero ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,backend", BACKENDS)
def test_zero_on_heads_zeroes_exactly_those_heads_and_nothing_else(model_pool, arch, backend):
    model = _model(model_pool, arch, backend)
    sites = [s for s in _write_sites(model) if s.name in HEAD_POINTS + NEURON_POINTS]
    if not sites:
        pytest.skip("no head or neuron write sites")

    @given(ids=token_ids(model, 2, 10), data=st.data())
    def law(ids, data):
        site, positions, select = data.draw(writes(model, sites, len(ids)))
        if not select:
            key = "heads" if site.name in HEAD_POINTS else "neurons"
            select = {key: [data.draw(st.integers(0, _unit(model, site.name)[0] - 1))]}
        plain = _read(model, ids, site)
        got = _read(model, ids, site, SteerSpec.zero(site, positions=positions, **select))
        mask = _mask(plain.shape, positions, select)
        assert torch.count_nonzero(got[mask]) == 0, f"zero at {site} {select} left non-zeros"
        _same(model, got[~mask], plain[~mask], f"zero at {site} {select} {positions} touched other entries")
    law()


# ---- patch -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,backend", BACKENDS)
def test_patch_from_the_same_run_is_the_identity_and_from_another_reproduces_it(model_pool, arch, backend):
    """Patching a run's own values back changes nothing; patching every position of the first
    layer's input from another prompt of the same length turns the run into that prompt's run."""
    model = _model(model_pool, arch, backend)
    sites = _write_sites(model)

    @given(ids=token_ids(model, 2, 10), data=st.data())
    def law(ids, data):
        site, positions, select = data.draw(writes(model, sites, len(ids)))
        source = run_with_cache(model, ids, [site])
        spec = SteerSpec.patch(site, source, positions=_patch_positions(positions), **select)
        _same(model, _read(model, ids, site, spec), source[site], f"patch from the same run at {site}")
        plain = _outputs(model, ids)
        assert_close_scaled(_outputs(model, ids, spec), plain, msg=f"patch from the same run at {site}")
        other = [(t + 1 + i) % model.d_vocab for i, t in enumerate(ids)]
        theirs = run_with_cache(model, other, ["resid_pre.0"])
        patched = _outputs(model, ids, SteerSpec.patch("resid_pre.0", theirs))
        assert_close_scaled(patched, _outputs(model, other), msg="patched resid_pre.0 from another prompt")
        assert _differs(patched, plain), "the other prompt's run is not this one's (the law needs them apart)"
    law()


# ---- every op: neutral setting, non-neutral setting --------------------------------------------

def _neutral_and_not(model, ids, kind, site, p, select, plain, seed):
    """``kind`` at ``site``, position ``p``: a setting that leaves the run as it is, and one that
    does not (zero has no neutral setting: None)."""
    value = plain[0, p]
    unit = value.shape
    v = _randn(unit, seed)
    chosen = select.get("heads", select.get("neurons"))
    if kind == "add":
        return (SteerSpec.add(site, v, scale=0.0, positions=[p], **select),
                SteerSpec.add(site, v, scale=4.0, positions=[p], **select))
    if kind == "set":
        return (SteerSpec.set(site, value, positions=[p], **select),
                SteerSpec.set(site, v * 3, positions=[p], **select))
    if kind == "mean":
        return (SteerSpec.mean(site, plain[:, p:p + 1].mean((0, 1)), positions=[p], **select),
                SteerSpec.mean(site, v * 3, positions=[p], **select))
    if kind == "ablate":
        m = torch.zeros(unit, dtype=torch.bool)
        m[slice(None) if chosen is None else chosen] = True
        x = value[m] / value[m].norm()
        ortho = v.clone()
        ortho[m] = v[m] - (v[m] @ x) * x  # a direction the value has no component along
        return (SteerSpec.ablate(site, ortho, positions=[p], **select),
                SteerSpec.ablate(site, value, positions=[p], **select))
    if kind == "scale":
        return (SteerSpec.scale(site, 1.0, positions=[p], **select),
                SteerSpec.scale(site, 3.0, positions=[p], **select))
    if kind == "patch":
        other = [(t + 1 + i) % model.d_vocab for i, t in enumerate(ids)]
        return (SteerSpec.patch(site, run_with_cache(model, ids, [site]), positions=[p], **select),
                SteerSpec.patch(site, run_with_cache(model, other, [site]), positions=[p], **select))
    assert kind == "zero"
    return None, SteerSpec.zero(site, positions=[p], **select)


def distinct_ids(model):
    """Prompts of distinct tokens: over repeated tokens the values attention mixes can all be
    equal, and then a write to q or k rightly changes nothing."""
    return st.lists(st.integers(0, model.d_vocab - 1), min_size=2, max_size=10, unique=True)


@pytest.mark.parametrize("arch,backend", BACKENDS)
def test_every_op_at_its_neutral_setting_is_the_plain_run_and_otherwise_is_not(model_pool, arch, backend):
    model = _model(model_pool, arch, backend)
    sites = _write_sites(model)

    @given(ids=distinct_ids(model), data=st.data(), seed=st.integers(0, 999),
           kind=st.sampled_from(["add", "set", "mean", "ablate", "scale", "patch", "zero"]))
    def law(ids, data, seed, kind):
        site, _, select = data.draw(writes(model, sites, len(ids)))
        # a query or key at position 0 meets one key, whose weight is 1 whatever they hold
        p = data.draw(st.integers(1 if site.name in ("q", "k") else 0, len(ids) - 1))
        plain_site = _read(model, ids, site)
        neutral, active = _neutral_and_not(model, ids, kind, site, p, select, plain_site, seed)
        plain = _outputs(model, ids)
        if neutral is not None:
            assert_close_scaled(_outputs(model, ids, neutral), plain, msg=f"neutral {kind} at {site}")
        assert _differs(_read(model, ids, site, active), plain_site), f"{kind} at {site} wrote nothing"
        assert _differs(_outputs(model, ids, active), plain), f"{kind} at {site} position {p} changed no output"
    law()


# ---- inputs are never edited ------------------------------------------------------------------

@pytest.mark.parametrize("arch,backend", BACKENDS)
def test_ops_never_mutate_their_inputs(model_pool, arch, backend):
    """Building, planning, composing and running a spec leaves the caller's vectors and the patch
    source Cache as they were; editing them afterwards leaves the spec (and its effect) as built."""
    model = _model(model_pool, arch, backend)
    sites = _write_sites(model)

    @given(ids=token_ids(model, 2, 10), data=st.data(), seed=st.integers(0, 999))
    def law(ids, data, seed):
        site, positions, select = data.draw(writes(model, sites, len(ids)))
        unit = _unit(model, site.name)
        vectors = {op: _randn(unit, seed + i) for i, op in enumerate(VECTOR_OPS)}
        kept = {op: v.clone() for op, v in vectors.items()}
        source = run_with_cache(model, ids, [site])
        source_kept = source[site].clone()

        def build(vs, src):
            spec = SteerSpec()
            for op in VECTOR_OPS:
                spec = spec | getattr(SteerSpec, op)(site, vs[op], positions=positions, **select)
            return (spec | SteerSpec.scale(site, 0.5, positions=positions, **select)
                    | SteerSpec.patch(site, src, positions=_patch_positions(positions), **select)
                    | SteerSpec.zero(site, positions=positions, **select))

        spec = build(vectors, source)
        steer_plan(model.graph, spec, model.dtype)
        before = _outputs(model, ids, spec)
        assert all(torch.equal(vectors[op], kept[op]) for op in VECTOR_OPS), "a caller's vector changed"
        assert torch.equal(source[site], source_kept), "the patch source changed"
        for v in vectors.values():
            v.mul_(-2.0).add_(1.0)  # the caller reuses its tensors
        source[site].mul_(3.0)
        twin = build(kept, Cache({site: source_kept}, graph=model.graph))
        assert spec == twin, "editing the caller's tensors changed the spec"
        _same(model, _outputs(model, ids, spec), before, "a spec's effect after its inputs were edited")
    law()


# ---- the engines agree ----------------------------------------------------------------------

@pytest.fixture(params=[pytest.param(a, marks=[needs_vllm, pytest.mark.vllm]) for a in ON_VLLM])
def pair(request, model_pool):
    return model_pool.get(request.param), model_pool.get(request.param, "vllm")


def test_eager_and_vllm_agree_on_every_op(pair):
    """The same op, site, positions and selector on both engines: the same value at the written
    point and the same last residual stream (a patch takes its source from the eager run)."""
    eager, vllm = pair
    sites = _write_sites(vllm)
    last = f"resid_post.{eager.n_layers - 1}"

    @given(ids=token_ids(eager, 2, 10), data=st.data(), seed=st.integers(0, 999),
           kind=st.sampled_from(["add", "set", "mean", "ablate", "scale", "patch", "zero"]))
    def law(ids, data, seed, kind):
        site, positions, select = data.draw(writes(eager, sites, len(ids)))
        unit = _unit(eager, site.name)
        v = _randn(unit, seed)
        if kind in VECTOR_OPS:
            spec = getattr(SteerSpec, kind)(site, v * (3 if kind in ("set", "mean") else 1), positions=positions,
                                            **select)
        elif kind == "scale":
            spec = SteerSpec.scale(site, 2.5, positions=positions, **select)
        elif kind == "zero":
            spec = SteerSpec.zero(site, positions=positions, **select)
        else:
            other = [(t + 3) % eager.d_vocab for t in ids]
            spec = SteerSpec.patch(site, run_with_cache(eager, other, [site]), positions=_patch_positions(positions),
                                   **select)
        ce = run_with_cache(eager, ids, [site, last], steer=spec)
        cv = run_with_cache(vllm, ids, [site, last], steer=spec)
        assert_close_scaled(cv[site], ce[site], msg=f"{kind} at {site}: the written point")
        assert_close_scaled(cv[last], ce[last], msg=f"{kind} at {site}: {last}")
    law()
