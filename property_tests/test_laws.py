"""The laws (on eager, vLLM with hooks, and vllm-static where a law is portable): backends
agree, capture never changes outputs, steering at scale 0 is the identity, steering composes,
the lens at the last layer is the logits, expert_assignment is the router's top-k,
capture_generation rows are a forward over prompt + generated[:-1], streamed deltas are the
text, seeded sampling repeats, transforms never mutate their inputs, addresses round-trip,
and refusals happen exactly where the capability table says."""

from __future__ import annotations

import asyncio
import importlib.util
import string

import pytest
import torch
from hypothesis import assume, example, given, settings, strategies as st

from interp_engine import (CAPABILITIES, POINTS, Address, CapabilityUnsupported, SteerSpec,
                           capture_generation, capture_plan, expert_assignment, format_address,
                           generate_stream, parse_address, run_with_cache, steer, steer_plan)
from interp_engine.testing import MOE_ARCHS, TINY_ARCHS, VLLM_ARCHS, assert_close_scaled
from strategies import (addresses, build_spec, sampling, steer_recipes, steer_specs, token_batches,
                        token_ids, valid_address_strings)

EAGER_ARCHS = TINY_ARCHS  # every architecture in the spec registry (specs/)
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
ATOL, RTOL = 3e-5, 1e-5
# vllm-static runs the portable laws on a dense and an MoE architecture (each engine is one
# compile, shared with tests/bridge/vllm/test_static.py through the same declared set)
STATIC_ARCHS = tuple(a for a in ("qwen3", "qwen3_moe") if a in VLLM_ARCHS)
STATIC_NAMES = tuple(name for name, point in POINTS.items() if point.vllm_static)


def static_options(n_layers: int) -> dict:
    """Every residual-width point at every layer, as taps and as steering sites."""
    every = tuple(f"{name}.{layer}" for layer in range(n_layers) for name in STATIC_NAMES)
    return {"static_points": every, "static_writes": every}


def bounded(backend: str):
    """The profile's settings, with half the examples on vllm-static (at least 2): its laws
    share the row mapping with the hook-based backend, which runs the full count, so what they
    add is the compiled ops (and CI time grows little)."""
    if backend != "vllm-static":
        return settings()
    return settings(max_examples=max(2, settings.default.max_examples // 2))


def _logits(model, ids):
    logits, _ = run_with_cache(model, ids, [], return_logits=True)
    return logits


def _greedy(model, ids, n, **kw):
    return list(generate_stream(model, ids, max_tokens=n, temperature=0.0, n_logprobs=2, **kw))


def _assert_same_greedy(a_steps, b_steps, atol=2e-5):
    """Equal tokens and logprobs; a divergence is only allowed at a true near-tie."""
    for a, b in zip(a_steps, b_steps):
        if a.token_id != b.token_id:
            top = a.logprobs
            assert len(top) > 1 and abs(top[0]["logprob"] - top[1]["logprob"]) < 1e-4, \
                f"tokens diverge ({a.token_id} vs {b.token_id}) without a near-tie: {top}"
            return
        assert b.logprob == pytest.approx(a.logprob, abs=atol)
    assert len(a_steps) == len(b_steps)


_SELECTION = ("expert_indices", "expert_weights")


def _assert_same_point(actual, expected, point, model, ids):
    """assert_close_scaled, except that the expert selection is discrete: where two of the
    router's top k + 1 logits (on ``model`` over ``ids``) are closer than a rounding-level
    margin, the engines (or a decode step and a full forward) may honestly pick or order
    differently. Those positions alone are left out; everywhere else indices are equal exactly."""
    if point.name not in _SELECTION:
        assert_close_scaled(actual, expected, msg=str(point))
        return
    logits = run_with_cache(model, ids, [Address("router_logits", point.layer)])[Address("router_logits", point.layer)]
    top = torch.topk(logits.float(), actual.shape[-1] + 1, dim=-1).values
    clear = ((top[..., :-1] - top[..., 1:]).min(-1).values > 1e-4 * max(1.0, float(logits.abs().max())))
    if point.name == "expert_indices":
        assert torch.equal(actual[clear], expected[clear]), str(point)
    else:
        assert_close_scaled(actual[clear], expected[clear], msg=str(point))


# ---- backends agree ----------------------------------------------------------------------

_PAIRS = [pytest.param((a, "vllm"), marks=[needs_vllm, pytest.mark.vllm], id=a) for a in VLLM_ARCHS] + [
    pytest.param((a, "vllm-static"), marks=[needs_vllm, pytest.mark.vllm], id=f"{a}-static") for a in STATIC_ARCHS]


@pytest.fixture(params=_PAIRS)
def pair(request, model_pool):
    """(eager, vllm or vllm-static) on the same tiny weights; one engine per architecture and
    backend for the session."""
    arch, backend = request.param
    return model_pool.get(arch), _model(model_pool, arch, backend)


def test_backends_agree_on_every_served_point(pair):
    eager, vllm = pair
    backend = vllm.backend_name

    @bounded(backend)
    @given(ids=token_ids(eager), points=st.lists(addresses(vllm, backend), min_size=1, max_size=4, unique=True))
    def law(ids, points):
        ce, cv = run_with_cache(eager, ids, points), run_with_cache(vllm, ids, points)
        for p in points:
            _assert_same_point(cv[p], ce[p], p, eager, ids)
    law()


def test_backends_agree_on_greedy_tokens_logprobs_and_steering(pair):
    eager, vllm = pair
    static = vllm.backend_name == "vllm-static"
    direction = torch.randn(eager.d_model, generator=torch.Generator().manual_seed(1))

    @bounded(vllm.backend_name)
    # an add and an ablation every run, whatever the few drawn examples hold
    @example(ids=[5, 9, 14, 3, 7, 11], spec=SteerSpec.add("resid_post.1", direction, scale=4.0), n=3)
    @example(ids=[5, 9, 14, 3, 7, 11], spec=SteerSpec.ablate("resid_post.1", direction), n=3)
    @given(ids=token_ids(eager, max_size=12), spec=st.none() | steer_specs(eager, one_per_site=static),
           n=st.integers(1, 6))
    def law(ids, spec, n):
        if spec is None:
            _assert_same_greedy(_greedy(eager, ids, n), _greedy(vllm, ids, n))
            return
        with steer(eager, spec):
            se = _greedy(eager, ids, n)
        with steer(vllm, spec):
            sv = _greedy(vllm, ids, n)
        _assert_same_greedy(se, sv, atol=1e-4)
    law()


def test_capture_generation_rows_equal_across_backends(pair):
    eager, vllm = pair

    @bounded(vllm.backend_name)
    @given(ids=token_ids(eager, max_size=10), point=addresses(vllm, vllm.backend_name), n=st.integers(1, 5))
    def law(ids, point, n):
        ce_c, ce = capture_generation(eager, ids, [point], max_tokens=n, temperature=0.0)
        cv_c, cv = capture_generation(vllm, ids, [point], max_tokens=n, temperature=0.0)
        assume(ce_c.token_ids == cv_c.token_ids)  # a near-tie divergence is covered above
        _assert_same_point(cv[point], ce[point], point, eager, list(ids) + list(ce_c.token_ids[:-1]))
    law()


# ---- capture and steering laws (every backend) ----------------------------------------------

def _backends(arch):
    out = [(arch, "eager")]
    if arch in VLLM_ARCHS:
        out.append(pytest.param(arch, "vllm", marks=[needs_vllm, pytest.mark.vllm]))
    if arch in STATIC_ARCHS:
        out.append(pytest.param(arch, "vllm-static", marks=[needs_vllm, pytest.mark.vllm]))
    return out


ALL_BACKENDS = [b for arch in EAGER_ARCHS for b in _backends(arch)]


def _model(model_pool, arch, backend):
    if backend == "eager":
        return model_pool.get(arch)
    if backend == "vllm-static":
        return model_pool.get(arch, backend, **static_options(model_pool.get(arch).n_layers))
    return model_pool.get(arch, backend, enable_prompt_embeds=True)


@pytest.mark.parametrize("arch,backend", ALL_BACKENDS)
def test_capture_never_changes_outputs(model_pool, arch, backend):
    model = _model(model_pool, arch, backend)

    @bounded(backend)
    @given(ids=token_ids(model, max_size=12), points=st.lists(addresses(model, backend), min_size=1, max_size=4))
    def law(ids, points):
        if backend == "eager":
            plain = _logits(model, ids)
            with_capture, _ = run_with_cache(model, ids, points, return_logits=True)
            if any(p.name == "pattern" for p in points) and model.backend.attention != "eager":
                # only the eager attention kernel forms the pattern: the same numbers as the fast
                # kernel to fp32 rounding, not bit for bit
                assert_close_scaled(with_capture, plain, msg="logits with pattern captured")
            else:
                assert torch.equal(plain, with_capture)
        else:
            plain = _greedy(model, ids, 4)
            completion, _ = capture_generation(model, ids, points, max_tokens=4, temperature=0.0, n_logprobs=2)
            assert list(completion.token_ids) == [s.token_id for s in plain]
            assert list(completion.logprobs) == [s.logprobs for s in plain]
    law()


def _observed(model, ids, n=4):
    """What greedy generation shows of a model: each step's token and top-2 logprobs."""
    return [(s.token_id, s.logprobs) for s in _greedy(model, ids, n)]


@pytest.mark.parametrize("arch,backend", ALL_BACKENDS)
def test_steering_at_scale_zero_is_the_identity_and_nonzero_steering_is_not(model_pool, arch, backend):
    """Scale 0 changes nothing, bit for bit; the same op at scale 4 changes what generation
    shows (so the first half cannot pass by steering doing nothing at all). Four greedy steps
    feed positions 0..len(ids)+2, and every positions choice below selects a row whose change
    can show: the last prompt row or a generated one (explicit positions: the first row and the
    row that makes the third step's logprobs; rows 0 and 2 alone, at the last layer, reach no
    logit generation shows)."""
    model = _model(model_pool, arch, backend)
    if not any(p.writable for p in model.points()):
        pytest.skip("no steering sites")

    @bounded(backend)
    @given(ids=token_ids(model, max_size=12), site=addresses(model, backend, writable=True), seed=st.integers(0, 999),
           positions=st.sampled_from(["all", "prompt", "generated", "explicit"]))
    def law(ids, site, seed, positions):
        if positions == "explicit":
            positions = (0, len(ids) + 1)
        v = torch.randn(model.d_model, generator=torch.Generator().manual_seed(seed))
        zero = SteerSpec.add(site, v, scale=0.0, positions=positions)
        before = _observed(model, ids)
        with steer(model, zero):
            inside = _observed(model, ids)
        assert inside == before, f"scale 0 at {site} {positions} changed generation"
        if backend == "eager":
            plain = _logits(model, ids)
            with steer(model, zero):
                assert torch.equal(_logits(model, ids), plain)
        with steer(model, SteerSpec.add(site, v, scale=4.0, positions=positions)):
            steered = _observed(model, ids)
        assert steered != before, f"adding 4 * v at {site} {positions} changed nothing"
    law()


@pytest.mark.parametrize("arch,backend", [("qwen3_moe", "eager"),
                                          pytest.param("qwen3_moe", "vllm", marks=[needs_vllm, pytest.mark.vllm])])
def test_expert_writes_agree_with_eager_scale_one_is_the_identity_and_zero_is_not(model_pool, arch, backend):
    """experts= writes: scaling by 1 changes nothing, bit for bit; zeroing every expert at the
    prompt changes what generation shows; any zero / scale of drawn experts gives eager's greedy
    tokens and logprobs on vLLM."""
    eager, model = model_pool.get(arch), _model(model_pool, arch, backend)
    g = eager.graph

    @bounded(backend)
    @given(ids=token_ids(eager, max_size=12), layer=st.sampled_from(g.moe_layers),
           experts=st.lists(st.integers(0, g.n_experts - 1), min_size=1, max_size=3, unique=True),
           factor=st.sampled_from([0.0, 0.5, 2.0]), positions=st.sampled_from(["all", "prompt", "generated", (0, 2)]))
    def law(ids, layer, experts, factor, positions):
        site = f"mlp_out.{layer}"
        before = _observed(model, ids)
        with steer(model, SteerSpec.scale(site, 1.0, positions=positions, experts=experts)):
            assert _observed(model, ids) == before
        if run_with_cache(eager, ids, [site])[site].abs().max() > 0:  # (a zero input, e.g. pad's embedding, stays zero)
            with steer(model, SteerSpec.zero(site, positions="prompt", experts=list(range(g.n_experts)))):
                assert _observed(model, ids) != before
        if backend == "eager":
            return
        spec = (SteerSpec.zero(site, positions=positions, experts=experts) if factor == 0.0 else
                SteerSpec.scale(site, factor, positions=positions, experts=experts))
        with steer(eager, spec):
            se = _greedy(eager, ids, 4)
        with steer(model, spec):
            sv = _greedy(model, ids, 4)
        _assert_same_greedy(se, sv, atol=1e-4)
    law()


def _changes_a_forward(spec: SteerSpec, n: int) -> bool:
    """Does ``spec`` write a row of a plain forward over ``n`` tokens (positions 0..n-1)?"""
    for op in spec.ops:
        if op.op == "add" and op.scale == 0.0:
            continue
        if op.positions in ("all", "prompt") or (isinstance(op.positions, tuple) and min(op.positions) < n):
            return True
    return False


@pytest.mark.parametrize("arch", EAGER_ARCHS)
def test_nested_blocks_equal_one_composed_spec_and_unsteer_restores(model_pool, arch):
    """Nested blocks equal the composed spec, leaving them restores the model, and a spec that
    writes a row of the forward changes the logits (so the law cannot pass with steering
    that does nothing). The explicit example nests an add inside an ablate and a set."""
    model = model_pool.get(arch)
    sites = [Address(p.name, model.graph.layers_of(p.name)[0]) for p in model.points() if p.writable]
    if not sites:
        pytest.skip("no steering sites")
    g = torch.Generator().manual_seed(7)
    u, v, w = (torch.randn(model.d_model, generator=g) for _ in range(3))
    outer = SteerSpec.ablate(sites[0], u, positions="prompt") | SteerSpec.set(sites[-1], w, positions=(1,))
    inner = SteerSpec.add(sites[0], v, scale=2.0)

    @example(ids=[5, 6, 7, 8, 9], a=outer, b=inner)
    @given(ids=token_ids(model, max_size=12), a=steer_specs(model, max_ops=2), b=steer_specs(model, max_ops=2))
    def law(ids, a, b):
        before = _logits(model, ids)
        with steer(model, a):
            with steer(model, b):
                nested = _logits(model, ids)
        with steer(model, a | b):
            composed = _logits(model, ids)
        after = _logits(model, ids)
        assert torch.equal(nested, composed)
        assert torch.equal(before, after)
        if _changes_a_forward(a | b, len(ids)):
            assert not torch.equal(nested, before), "a spec that writes rows of the forward changed nothing"
    law()


def test_exception_inside_steer_restores_exactly(model_pool):
    model = model_pool.get("qwen3")
    ids = [5, 6, 7, 8]
    before = _logits(model, ids)
    with pytest.raises(RuntimeError):
        with steer(model, SteerSpec.add("resid_post.0", torch.ones(model.d_model), scale=5.0)):
            assert not torch.equal(_logits(model, ids), before)
            raise RuntimeError("boom")
    assert torch.equal(_logits(model, ids), before)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.hf.modules())


@pytest.mark.parametrize("arch", [a for a in EAGER_ARCHS if a != "deepseek_v4"])
def test_lens_at_the_last_layer_equals_the_logits(model_pool, arch):
    model = model_pool.get(arch)

    @given(batch=token_batches(model))
    def law(batch):
        tokens = model.batch(batch)
        last = Address("resid_post", model.n_layers - 1)
        logits, cache = run_with_cache(model, tokens, [last], return_logits=True)
        lens = model.decode_residuals(cache)[0]
        mask = tokens.attention_mask.bool()
        torch.testing.assert_close(lens[mask], torch.log_softmax(logits, -1)[mask], atol=1e-5, rtol=1e-5)
    law()


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("arch,backend", [(a, "vllm") for a in VLLM_ARCHS] + [(a, "vllm-static") for a in STATIC_ARCHS])
def test_lens_at_the_last_layer_equals_the_logprobs_on_vllm(model_pool, arch, backend):
    """vLLM never ships logits out of its worker, so the law reads them as greedy logprobs: the
    lens over the last layer's resid_post, captured while generating, gives at row
    len(prompt) - 1 + i the logprobs step i reports, and those tokens are its top-k."""
    model = _model(model_pool, arch, backend)
    last = Address("resid_post", model.n_layers - 1)

    @bounded(backend)
    @given(ids=token_ids(model, max_size=10), n=st.integers(1, 4))
    def law(ids, n):
        completion, cache = capture_generation(model, ids, [last], max_tokens=n, temperature=0.0, n_logprobs=2)
        lens = model.decode_residuals(cache)[0, 0]  # [pos, d_vocab] log-probs
        assert len(completion.logprobs) == len(completion.token_ids) == n
        for i, top in enumerate(completion.logprobs):
            row = lens[len(ids) - 1 + i]
            kth = torch.topk(row, len(top)).values[-1]
            for entry in top:
                assert float(row[entry["token_id"]]) == pytest.approx(entry["logprob"], abs=1e-4), (i, entry)
                assert entry["logprob"] >= float(kth) - 1e-4, f"step {i}: {entry} is not in the lens's top-{len(top)}"
    law()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_assignment_is_the_routers_selection(model_pool, arch):
    model = model_pool.get(arch)
    g = model.graph

    @given(ids=token_ids(model), layer=st.sampled_from(g.moe_layers))
    def law(ids, layer):
        points = [Address(n, layer) for n in ("router_logits", "expert_indices", "expert_weights")]
        cache = run_with_cache(model, ids, points)
        dense = expert_assignment(cache, layer, g.n_experts)
        idx, w = cache[points[1]], cache[points[2]]
        assert torch.equal((dense != 0).sum(-1), torch.full(idx.shape[:-1], g.top_k))
        torch.testing.assert_close(dense.gather(-1, idx), w)
        if arch == "qwen3_moe":  # softmax top-k, renormalised (norm_topk_prob)
            probs = torch.softmax(cache[points[0]], -1)
            top = torch.topk(probs, g.top_k, -1)
            assert torch.equal(torch.sort(top.indices, -1).values, torch.sort(idx, -1).values)
            torch.testing.assert_close(
                expert_assignment(cache.__class__({points[0]: cache[points[0]]}), layer, g.n_experts,
                                  top_k=g.top_k), dense, atol=1e-6, rtol=1e-5)
    law()


@pytest.mark.parametrize("arch,backend", ALL_BACKENDS)
def test_capture_generation_rows_are_a_forward_over_prompt_and_generated(model_pool, arch, backend):
    model = _model(model_pool, arch, backend)

    @bounded(backend)
    @given(ids=token_ids(model, max_size=10), point=addresses(model, backend), params=sampling(6))
    def law(ids, point, params):
        completion, cache = capture_generation(model, ids, [point], **params)
        fed = list(ids) + list(completion.token_ids[:-1])
        assert cache[point].shape[2 if point.name == "pattern" else 1] == len(fed)
        reference = run_with_cache(model, fed, [point])
        _assert_same_point(cache[point], reference[point], point, model, fed)
    law()


@pytest.mark.parametrize("arch,backend", ALL_BACKENDS)
def test_deltas_join_to_the_text_and_seeded_sampling_repeats(model_pool, arch, backend):
    model = _model(model_pool, arch, backend)

    @bounded(backend)
    @given(ids=token_ids(model, max_size=10), params=sampling(10))
    def law(ids, params):
        params = {k: v for k, v in params.items()}

        async def go():
            text = await model.generate_text(ids, **params)
            deltas = [d async for d in model.generate_stream(ids, **params)]
            return text, deltas
        text, deltas = asyncio.run(go())
        assert "".join(deltas) == text
        first = [s.token_id for s in generate_stream(model, ids, **params)]
        again = [s.token_id for s in generate_stream(model, ids, **params)]
        assert first == again
        assert model.to_string(first) == text
    law()


# ---- pure-data laws -----------------------------------------------------------------------

@pytest.mark.parametrize("arch", EAGER_ARCHS)
def test_transforms_never_mutate_their_inputs(model_pool, arch):
    """Nothing a caller hands in is edited: its token list and tensor, its list of points, its
    steering vectors (by content, through building, planning, composing and a steered run), a
    cache through ``.to``, the lens and expert_assignment. A spec keeps its own copy: editing
    the caller's vectors afterwards leaves it equal to a spec built from the original values."""
    model = model_pool.get(arch)
    writable = any(p.writable for p in model.points())

    @given(ids=token_ids(model), points=st.lists(addresses(model), min_size=1, max_size=4),
           recipe=steer_recipes(model) if writable else st.just([]))
    def law(ids, points, recipe):
        ids_before, points_before = list(ids), list(points)
        tokens = torch.tensor([ids])
        tokens_before = tokens.clone()
        vectors_before = [r[2].clone() for r in recipe]
        spec = build_spec(recipe)
        plan = capture_plan(model.graph, points) | steer_plan(model.graph, spec, model.dtype)
        combined = spec | spec
        with steer(model, spec):
            run_with_cache(model, tokens, points)
        cache = run_with_cache(model, tokens, points)
        copies = {a: t.clone() for a, t in cache.items()}
        moved = cache.to("cpu")
        if model.residual_basis.lens_valid and any(a.name == "resid_post" for a in cache):
            model.decode_residuals(cache)
        for layer in model.graph.moe_layers[:1]:
            c2 = run_with_cache(model, tokens, [f"expert_indices.{layer}", f"expert_weights.{layer}"])
            kept = {a: t.clone() for a, t in c2.items()}
            expert_assignment(c2, layer, model.graph.n_experts)
            assert all(torch.equal(kept[a], c2[a]) for a in kept)
        assert ids == ids_before and points == points_before and torch.equal(tokens, tokens_before)
        assert all(torch.equal(r[2], v) for r, v in zip(recipe, vectors_before)), "a caller's vector changed"
        assert all(torch.equal(copies[a], cache[a]) for a in copies) and list(moved) == list(cache)
        assert len(combined.ops) == 2 * len(spec.ops)
        assert plan.reads == tuple(dict.fromkeys(model.graph.check_address(p) for p in points))
        twin = build_spec([(op, site, v, scale, pos) for (op, site, _, scale, pos), v in zip(recipe, vectors_before)])
        for r in recipe:
            r[2].add_(1.0)  # the caller reuses its tensors
        assert spec == twin and combined == twin | twin, "editing the caller's vectors changed the spec"
    law()


@example(text="resid_streams.5.2")  # the page's own per-stream example
@example(text="z.7")
@given(text=valid_address_strings())
def test_address_parse_format_round_trips(text):
    address = parse_address(text)
    assert format_address(address) == text
    assert parse_address(format_address(address)) == address
    assert hash(address) == hash(parse_address(text))


@given(text=st.text(alphabet=string.ascii_letters + string.digits + "._- ", max_size=20))
def test_every_invalid_address_string_raises(text):
    try:
        address = parse_address(text)
    except ValueError as exc:
        assert repr(text) in str(exc) or text in str(exc)
        return
    assert format_address(address) == text  # it parsed, so it must be canonical


@pytest.mark.parametrize("arch,backend", ALL_BACKENDS)
def test_refusals_happen_exactly_where_the_table_says(model_pool, arch, backend):
    model = _model(model_pool, arch, backend)
    tokens = [3, 4, 5]
    for point in model.points():
        address = Address(point.name, model.graph.layers_of(point.name)[0])
        if point.served_by(backend):
            run_with_cache(model, tokens, [address])
            continue
        with pytest.raises(CapabilityUnsupported) as info:
            run_with_cache(model, tokens, [address])
        capability = CAPABILITIES[info.value.capability]
        assert not capability.served_by(backend) and capability.served_by("eager")
        if backend == "vllm-static" and point.vllm:  # served by hooks, never compiled in
            assert info.value.capability == "static_point"
        else:
            assert info.value.capability == (POINTS[point.name].capability or "vllm_architecture")
    for name in ("gradients", "batched_prompts", "logits_in_stream"):
        if CAPABILITIES[name].served_by(backend):
            continue
        with pytest.raises(CapabilityUnsupported):
            if name == "gradients":
                run_with_cache(model, tokens, ["resid_post.0"], detach=False)
            elif name == "batched_prompts":
                run_with_cache(model, [tokens, tokens[:2]], ["resid_post.0"])
            else:
                run_with_cache(model, tokens, ["resid_post.0"], return_logits=True)


def test_vllm_static_refuses_points_it_cannot_compile_in_by_name():
    from interp_engine import load_model
    from interp_engine.testing import tiny_model

    with pytest.raises(CapabilityUnsupported) as info:  # before any engine starts
        load_model(tiny_model("qwen3"), backend="vllm-static", static_points=["z.1"])
    assert info.value.capability == "static_point" and not CAPABILITIES["static_point"].served_by("vllm-static")
