"""Every intervention op inside vLLM (the worker runtime and vllm-static's compiled sites)
against the hand-written references on the Hugging Face modules (tests/bridge/test_eager_ops.py):
the steered run's last residual stream equals the HF model's with the same edit hooked by hand.
Writes at points vLLM does not serve are refused before any forward."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from interp_engine import (CapabilityUnsupported, Plan, SteerSpec, generate_stream, run, run_with_cache,
                           steered)
from interp_engine.testing import assert_close_scaled
from tests._reference import PROMPT, decoder_layers
from tests.bridge.test_eager_ops import (_pair, ablate_on_heads, down_proj, hook_edits, on_columns, on_heads,
                                         out_proj)

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vllm not installed")]

ARCHS = ("qwen3", "gemma2")
NAMES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")


def hf_last_resid(model, ids, edits=()) -> torch.Tensor:
    """The last decoder layer's output (resid_post) of the HF model with ``edits`` hooked."""
    layers = decoder_layers(model.hf)
    got, handles = [], hook_edits(edits)
    handles.append(layers[-1].register_forward_hook(
        lambda mod, args, out: got.append((out[0] if isinstance(out, tuple) else out).detach().clone())))
    try:
        with torch.no_grad():
            model.hf(ids)
    finally:
        for h in handles:
            h.remove()
    return got[0]


def _last(model, ids, spec):
    point = f"resid_post.{model.n_layers - 1}"
    return run_with_cache(model, ids, [point], steer=spec)[point]


@pytest.fixture(params=ARCHS)
def pair(request, model_pool):
    return model_pool.get(request.param), model_pool.get(request.param, "vllm")


def test_head_ops_on_z_equal_the_hf_reference(pair):
    eager, vllm = pair
    ids = eager.to_tokens(PROMPT)
    H, dh, L = eager.graph.n_heads, eager.graph.d_head, 1
    heads = [0, H - 1]
    g = torch.Generator().manual_seed(5)
    v, d = torch.randn(H, dh, generator=g), torch.randn(H, dh, generator=g)
    ablate_ref = ablate_on_heads(d, H, heads)

    cases = [
        (SteerSpec.zero(f"z.{L}", heads=heads), on_heads(lambda s, h: s * 0, H, heads)),
        (SteerSpec.scale(f"z.{L}", 3.0, heads=heads), on_heads(lambda s, h: s * 3.0, H, heads)),
        (SteerSpec.add(f"z.{L}", v, scale=2.0, heads=heads, positions=(2, 4)),
         on_heads(lambda s, h: s + 2.0 * v[h], H, heads, positions=(2, 4))),
        (SteerSpec.mean(f"z.{L}", v, heads=[1]), on_heads(lambda s, h: v[h].expand_as(s), H, [1])),
        (SteerSpec.set(f"z.{L}", v), on_heads(lambda s, h: v[h].expand_as(s), H, range(H))),
        (SteerSpec.ablate(f"z.{L}", d, heads=heads), ablate_ref),
    ]
    plain = hf_last_resid(eager, ids)
    for spec, ref in cases:
        want = hf_last_resid(eager, ids, [(out_proj(eager.hf, L), "in", ref)])
        assert not torch.allclose(want, plain)
        assert_close_scaled(_last(vllm, ids, spec), want, msg=str(spec))


def test_zero_scale_mean_on_the_residual_sites_equal_the_hf_reference(pair):
    eager, vllm = pair
    ids = eager.to_tokens(PROMPT)
    layer = decoder_layers(eager.hf)[0]
    m = torch.randn(eager.d_model, generator=torch.Generator().manual_seed(6))
    cases = [
        (SteerSpec.zero("resid_post.0", positions=(3,)), (layer, "out"), on_columns(torch.zeros_like, slice(None), (3,))),
        (SteerSpec.scale("resid_post.0", 0.5), (layer, "out"), lambda x: x * 0.5),
        (SteerSpec.mean("resid_pre.0", m, positions=(1, 2)), (layer, "in"),
         on_columns(lambda r: m.expand_as(r), slice(None), (1, 2))),
        (SteerSpec.scale("resid_pre.0", 2.0), (layer, "in"), lambda x: x * 2.0),
    ]
    for spec, (module, how), ref in cases:
        want = hf_last_resid(eager, ids, [(module, how, ref)])
        assert_close_scaled(_last(vllm, ids, spec), want, msg=str(spec))
    # resid_mid, attn_out and mlp_out: same numbers as eager (whose sites the eager suite checks)
    for name in ("resid_mid", "attn_out", "mlp_out"):
        for spec in (SteerSpec.zero(f"{name}.1", positions=(2, 5)), SteerSpec.scale(f"{name}.1", 0.25)):
            assert_close_scaled(_last(vllm, ids, spec), _last(eager, ids, spec), msg=str(spec))


def test_patching_from_a_vllm_cache_across_positions_and_layers(pair):
    eager, vllm = pair
    clean, corrupt = _pair(eager)
    last = eager.n_layers - 1
    source = run_with_cache(vllm, clean, ["z.0", f"resid_pre.{last}"])
    # the whole input of the last layer: the corrupted run continues as the clean one
    spec = SteerSpec.patch(f"resid_pre.{last}", source)
    assert_close_scaled(_last(vllm, corrupt, spec), hf_last_resid(eager, clean), msg="resid_pre patch")
    # two heads of z at one position, against the HF reference with the clean o_proj input copied in
    ref_z = []
    h = out_proj(eager.hf, 0).register_forward_pre_hook(lambda mod, args: ref_z.append(args[0].clone()))
    with torch.no_grad():
        eager.hf(clean)
    h.remove()
    H, dh, n = eager.graph.n_heads, eager.graph.d_head, clean.shape[1]
    cols = [c for head in (1, 2) for c in range(head * dh, (head + 1) * dh)]

    def ref(x):
        out = x.clone()
        out[:, n - 1, cols] = ref_z[0][:, n - 1, cols]
        return out
    spec = SteerSpec.patch("z.0", source, positions=(n - 1,), heads=[1, 2])
    want = hf_last_resid(eager, corrupt, [(out_proj(eager.hf, 0), "in", ref)])
    assert_close_scaled(_last(vllm, corrupt, spec), want, msg="z patch")


def test_a_head_ablation_scan_gives_the_same_numbers_on_both_backends(pair):
    eager, vllm = pair
    ids = eager.to_tokens(PROMPT)

    def ablate(layer, head):
        return lambda plan: plan | Plan(writes=SteerSpec.zero(f"z.{layer}", heads=[head]))
    base = Plan(reads=[f"resid_post.{eager.n_layers - 1}"])
    for layer in range(eager.n_layers):
        for head in range(eager.graph.n_heads):
            plan = ablate(layer, head)(base)
            a, b = run(eager, ids, plan), run(vllm, ids, plan)
            assert_close_scaled(b[base.reads[0]], a[base.reads[0]], msg=f"z.{layer} head {head}")


def test_steered_views_and_generation_agree(pair):
    eager, vllm = pair
    ids = eager.to_tokens(PROMPT)
    spec = SteerSpec.zero("z.0", heads=[0, 1]) | SteerSpec.scale("mlp_out.1", 4.0)
    se = [s.token_id for s in generate_stream(steered(eager, spec), ids, max_tokens=8, temperature=0.0)]
    sv = [s.token_id for s in generate_stream(steered(vllm, spec), ids, max_tokens=8, temperature=0.0)]
    plain = [s.token_id for s in generate_stream(vllm, ids, max_tokens=8, temperature=0.0)]
    assert sv == se and sv != plain


def test_writes_at_points_vllm_does_not_serve_are_refused_or_exact(pair):
    """mlp_act / q: refused before any forward where vLLM does not serve them; where it does,
    the write equals the HF reference."""
    eager, vllm = pair
    ids = eager.to_tokens(PROMPT)
    served = {p.name for p in vllm.points() if p.vllm}
    spec = SteerSpec.zero("mlp_act.0", neurons=[0, 3])
    if "mlp_act" in served:
        want = hf_last_resid(eager, ids, [(down_proj(eager.hf, 0), "in", on_columns(torch.zeros_like, [0, 3]))])
        assert_close_scaled(_last(vllm, ids, spec), want)
    else:
        with pytest.raises(CapabilityUnsupported, match="mlp_act.0"):
            run_with_cache(vllm, ids, [], steer=spec)
        with pytest.raises(CapabilityUnsupported, match="mlp_act.0"):
            steered(vllm, spec)
    source = run_with_cache(eager, torch.cat([ids, ids]), ["resid_post.0"])
    with pytest.raises(ValueError, match="source of 2 rows"):
        run_with_cache(vllm, ids, [], steer=SteerSpec.patch("resid_post.0", source))


def test_writes_inside_fused_projections_equal_the_hf_reference(pair):
    """vLLM fuses q | k | v into qkv_proj and gate | up into gate_up_proj (Qwen3 reads q and k
    after its per-head norms): a write at q, k, v or mlp_pre edits only its part, as editing
    the HF model's own q_proj / k_proj / v_proj / gate_proj (or q_norm / k_norm) output does."""
    eager, vllm = pair
    ids = eager.to_tokens(PROMPT)
    g, L = eager.graph, 1
    H, KV = g.n_heads, g.n_kv_heads
    attn, mlp = decoder_layers(eager.hf)[L].self_attn, decoder_layers(eager.hf)[L].mlp
    kv = torch.randn(KV, g.d_head, generator=torch.Generator().manual_seed(7))
    normed = hasattr(attn, "q_norm")  # its output is [batch, pos, heads, d_head]

    def heads(fn, n, which, positions=None):
        flat = on_heads(fn, n, which, positions)
        return (lambda x: flat(x.flatten(-2)).view_as(x)) if normed else flat
    q_at, k_at = (attn.q_norm, attn.k_norm) if normed else (attn.q_proj, attn.k_proj)
    cases = [
        (SteerSpec.zero(f"q.{L}", heads=[H - 1]), [(q_at, "out", heads(lambda s, h: s * 0, H, [H - 1]))]),
        (SteerSpec.scale(f"k.{L}", 0.5, heads=[0], positions=(1, 2)),
         [(k_at, "out", heads(lambda s, h: s * 0.5, KV, [0], (1, 2)))]),
        (SteerSpec.add(f"v.{L}", kv, scale=2.0), [(attn.v_proj, "out", on_heads(lambda s, h: s + 2.0 * kv[h], KV,
                                                                                  range(KV)))]),
        (SteerSpec.scale(f"mlp_pre.{L}", 3.0, neurons=[0, 5]),
         [(mlp.gate_proj, "out", on_columns(lambda r: r * 3.0, [0, 5]))]),
        (SteerSpec.zero(f"q.{L}", heads=[0]) | SteerSpec.mean(f"v.{L}", kv, heads=[KV - 1]),
         [(q_at, "out", heads(lambda s, h: s * 0, H, [0])),
          (attn.v_proj, "out", on_heads(lambda s, h: kv[h].expand_as(s), KV, [KV - 1]))]),
    ]
    plain = hf_last_resid(eager, ids)
    for spec, edits in cases:
        want = hf_last_resid(eager, ids, edits)
        assert not torch.allclose(want, plain)
        assert_close_scaled(_last(vllm, ids, spec), want, msg=str(spec))


def _declared() -> dict:
    every = tuple(f"{n}.{layer}" for layer in range(3) for n in NAMES)
    return {"static_points": every, "static_writes": every}


def test_vllm_static_sites_run_every_op(model_pool):
    eager, static = model_pool.get("qwen3"), model_pool.get("qwen3", "vllm-static", **_declared())
    ids = eager.to_tokens(PROMPT)
    clean, corrupt = _pair(eager)
    m = torch.randn(eager.d_model, generator=torch.Generator().manual_seed(8))
    source = run_with_cache(eager, clean, ["resid_post.1"])
    specs = [SteerSpec.zero("resid_post.1", positions=(2,)), SteerSpec.scale("resid_mid.1", 0.5),
             SteerSpec.mean("mlp_out.0", m, positions="prompt"), SteerSpec.scale("resid_pre.2", 3.0),
             SteerSpec.zero("resid_mid.0")]
    for spec in specs:
        assert_close_scaled(_last(static, ids, spec), _last(eager, ids, spec), msg=str(spec))
    spec = SteerSpec.patch("resid_post.1", source, positions=(1, 2, 3))
    assert_close_scaled(_last(static, corrupt, spec), _last(eager, corrupt, spec), msg="patch")
    with pytest.raises(CapabilityUnsupported):
        run_with_cache(static, ids, [], steer=SteerSpec.zero("z.0", heads=[1]))
