"""Every intervention op on the eager bridge against hand-written references: forward hooks on
the Hugging Face modules that edit the tensor a point names (o_proj's input for z, down_proj's
input for mlp_act, the fused qkv output for q/v, a decoder layer's output for resid_post)
written here without the library's specs, selectors or op math."""

from __future__ import annotations

import pytest
import torch

from interp_engine import (Cache, CapabilityUnsupported, Plan, SteerSpec, run, run_with_cache, steer,
                           steered)
from tests._reference import PROMPT, count_forwards, decoder_layers

TOL = dict(rtol=1e-5, atol=1e-5)
HEAD_ARCHS = ("qwen3", "llama", "gemma2", "gpt2", "gpt_neox", "phi3", "mistral", "qwen3_moe")
MLP_ARCHS = ("qwen3", "llama", "gemma2", "gpt2", "gpt_neox", "phi3")


# ---- hand-written references ---------------------------------------------------------------

def out_proj(hf, layer: int):
    """The module whose input is the heads' outputs side by side (z)."""
    t = hf.config.model_type
    if t == "gpt2":
        return hf.transformer.h[layer].attn.c_proj
    if t == "gpt_neox":
        return hf.gpt_neox.layers[layer].attention.dense
    return hf.model.layers[layer].self_attn.o_proj


def down_proj(hf, layer: int):
    """The module whose input is the MLP's hidden activation (mlp_act)."""
    t = hf.config.model_type
    if t == "gpt2":
        return hf.transformer.h[layer].mlp.c_proj
    if t == "gpt_neox":
        return hf.gpt_neox.layers[layer].mlp.dense_4h_to_h
    return hf.model.layers[layer].mlp.down_proj


def hook_edits(edits) -> list:
    """Hook ``edits`` = [(module, "in"|"out", fn(x) -> x)] onto HF modules; the handles."""
    handles = []
    for module, how, fn in edits:
        if how == "in":
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, fn=fn: (fn(args[0]),) + tuple(args[1:])))
        else:
            def post(mod, args, out, fn=fn):
                return (fn(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else fn(out)
            handles.append(module.register_forward_hook(post))
    return handles


def hf_logits(model, ids, edits=()) -> torch.Tensor:
    """Logits of the HF model with ``edits`` = [(module, "in"|"out", fn(x) -> x)] hooked."""
    handles = hook_edits(edits)
    try:
        with torch.no_grad():
            return model.hf(ids).logits
    finally:
        for h in handles:
            h.remove()


def hf_capture(model, ids, module, how="in") -> torch.Tensor:
    got = []
    if how == "in":
        h = module.register_forward_pre_hook(lambda mod, args: got.append(args[0].detach().clone()))
    else:
        h = module.register_forward_hook(
            lambda mod, args, out: got.append((out[0] if isinstance(out, tuple) else out).detach().clone()))
    try:
        with torch.no_grad():
            model.hf(ids)
    finally:
        h.remove()
    return got[0]


def on_heads(fn, n_heads: int, heads, positions=None):
    """Edit ``[batch, pos, n_heads * d_head]``: ``fn(slice, head_index)`` on each head in
    ``heads`` at ``positions`` (None: all)."""
    def edit(x):
        out = x.clone()
        view = out.view(*x.shape[:-1], n_heads, -1)
        cols = slice(None) if positions is None else list(positions)
        for h in heads:
            view[:, cols, h] = fn(view[:, cols, h].clone(), h)
        return out
    return edit


def ablate_on_heads(direction, n_heads: int, heads):
    """Edit ``[batch, pos, n_heads * d_head]``: remove the component along ``direction``
    (``[n_heads, d_head]``), taken over the selected heads together (their slices concatenated)."""
    dh = direction.shape[-1]
    u = torch.cat([direction[h] for h in heads])
    u = u / u.norm()

    def edit(x):
        view = x.view(*x.shape[:-1], n_heads, dh)
        sub = torch.cat([view[..., h, :] for h in heads], dim=-1)
        sub = sub - (sub @ u).unsqueeze(-1) * u
        out = view.clone()
        for i, h in enumerate(heads):
            out[..., h, :] = sub[..., i * dh:(i + 1) * dh]
        return out.reshape(x.shape)
    return edit


def on_columns(fn, cols, positions=None):
    def edit(x):
        out = x.clone()
        p = slice(None) if positions is None else list(positions)
        region = out[:, p][..., cols]
        new = fn(region.clone())
        tmp = out[:, p]
        tmp[..., cols] = new
        out[:, p] = tmp
        return out
    return edit


def _ids(model, text=PROMPT):
    return model.to_tokens(text)


def _pair(model):
    """A clean prompt and a corrupted one of the same length (two tokens changed)."""
    clean = _ids(model)
    corrupt = clean.clone()
    corrupt[0, 2:4] = (clean[0, 2:4] + 7) % model.graph.d_vocab
    return clean, corrupt


def _logits(model, ids, spec):
    logits, _ = run_with_cache(model, ids, [], return_logits=True, steer=spec)
    return logits


def _layer(model) -> int:
    return model.n_layers - 1


# ---- per-head ops on z -------------------------------------------------------------------

@pytest.mark.parametrize("arch", HEAD_ARCHS)
def test_head_ops_on_z_equal_editing_the_heads_slice_of_o_proj_input(eager_models, arch):
    model = eager_models[arch]
    hf, ids, L, H, dh = model.hf, _ids(model), _layer(model), model.graph.n_heads, model.graph.d_head
    heads = [1, H - 1]
    g = torch.Generator().manual_seed(0)
    v = torch.randn(H, dh, generator=g)
    d = torch.randn(H, dh, generator=g)
    ablate_ref = ablate_on_heads(d, H, heads)

    cases = [
        (SteerSpec.zero(f"z.{L}", heads=heads), on_heads(lambda s, h: torch.zeros_like(s), H, heads)),
        (SteerSpec.scale(f"z.{L}", 0.25, heads=heads), on_heads(lambda s, h: s * 0.25, H, heads)),
        (SteerSpec.add(f"z.{L}", v, scale=2.0, heads=heads), on_heads(lambda s, h: s + 2.0 * v[h], H, heads)),
        (SteerSpec.set(f"z.{L}", v, heads=heads), on_heads(lambda s, h: v[h].expand_as(s), H, heads)),
        (SteerSpec.mean(f"z.{L}", v, positions=(1, 2), heads=heads),
         on_heads(lambda s, h: v[h].expand_as(s), H, heads, positions=(1, 2))),
        (SteerSpec.ablate(f"z.{L}", d, heads=heads), ablate_ref),
    ]
    plain = hf_logits(model, ids)
    for spec, ref in cases:
        want = hf_logits(model, ids, [(out_proj(hf, L), "in", ref)])
        assert not torch.allclose(want, plain), f"{spec.ops[0].op}: the reference changes nothing"
        torch.testing.assert_close(_logits(model, ids, spec), want, **TOL, msg=lambda m: f"{spec}: {m}")


@pytest.mark.parametrize("arch", HEAD_ARCHS)
def test_zero_ablating_a_head_is_exact(eager_models, arch):
    """Bit for bit: the head's slice of o_proj's input is zero, the other heads are untouched,
    and the logits equal the reference's."""
    model = eager_models[arch]
    hf, ids, H = model.hf, _ids(model), model.graph.n_heads
    for L in range(model.n_layers):
        spec = SteerSpec.zero(f"z.{L}", heads=[2])
        logits, cache = run_with_cache(model, ids, [f"z.{L}"], return_logits=True, steer=spec)
        z = cache[f"z.{L}"]
        assert torch.equal(z[..., 2, :], torch.zeros_like(z[..., 2, :]))
        plain = run_with_cache(model, ids, [f"z.{L}"])[f"z.{L}"]
        others = [h for h in range(H) if h != 2]
        if L == 0 or True:
            assert torch.equal(z[..., others, :], plain[..., others, :])
        want = hf_logits(model, ids, [(out_proj(hf, L), "in", on_heads(lambda s, h: s * 0, H, [2]))])
        assert torch.equal(logits, want), f"layer {L}: {(logits - want).abs().max()}"


# ---- per-neuron ops on mlp_act -----------------------------------------------------------

@pytest.mark.parametrize("arch", MLP_ARCHS)
def test_neuron_ops_on_mlp_act_equal_editing_down_proj_input(eager_models, arch):
    model = eager_models[arch]
    hf, ids, L, M = model.hf, _ids(model), 0, model.graph.d_mlp
    neurons = [0, 5, M - 1]
    m = torch.randn(M, generator=torch.Generator().manual_seed(1))
    cases = [
        (SteerSpec.zero(f"mlp_act.{L}", neurons=neurons), on_columns(torch.zeros_like, neurons)),
        (SteerSpec.scale(f"mlp_act.{L}", 3.0, neurons=neurons), on_columns(lambda r: r * 3.0, neurons)),
        (SteerSpec.mean(f"mlp_act.{L}", m, positions=(0, 3), neurons=neurons),
         on_columns(lambda r: m[neurons].expand_as(r), neurons, positions=(0, 3))),
        (SteerSpec.add(f"mlp_act.{L}", m, neurons=neurons), on_columns(lambda r: r + m[neurons], neurons)),
        (SteerSpec.scale(f"mlp_act.{L}", 0.5), on_columns(lambda r: r * 0.5, list(range(M)))),
    ]
    plain = hf_logits(model, ids)
    for spec, ref in cases:
        want = hf_logits(model, ids, [(down_proj(hf, L), "in", ref)])
        assert not torch.allclose(want, plain)
        torch.testing.assert_close(_logits(model, ids, spec), want, **TOL, msg=lambda m_: f"{spec}: {m_}")


# ---- q / v inside fused projections ------------------------------------------------------

def test_head_writes_on_q_and_v_inside_fused_qkv(eager_models):
    """GPT-2's c_attn holds q | k | v side by side; GPT-NeoX's holds each head's q | k | v."""
    gpt2 = eager_models["gpt2"]
    H, dh, D = gpt2.graph.n_heads, gpt2.graph.d_head, gpt2.d_model
    ids = _ids(gpt2)

    def gpt2_ref(x):  # zero q of head 1, scale v of head 2 by 2
        out = x.clone()
        out[..., 1 * dh:2 * dh] = 0
        out[..., 2 * D + 2 * dh:2 * D + 3 * dh] *= 2
        return out
    spec = SteerSpec.zero("q.0", heads=[1]) | SteerSpec.scale("v.0", 2.0, heads=[2])
    want = hf_logits(gpt2, ids, [(gpt2.hf.transformer.h[0].attn.c_attn, "out", gpt2_ref)])
    torch.testing.assert_close(_logits(gpt2, ids, spec), want, **TOL)

    neox = eager_models["gpt_neox"]
    H, dh = neox.graph.n_heads, neox.graph.d_head
    ids = _ids(neox)

    def neox_ref(x):
        out = x.clone()
        view = out.view(*x.shape[:-1], H, 3 * dh)
        view[..., 1, 0:dh] = 0  # q of head 1
        view[..., 2, 2 * dh:3 * dh] *= 2  # v of head 2
        return out
    want = hf_logits(neox, ids, [(neox.hf.gpt_neox.layers[0].attention.query_key_value, "out", neox_ref)])
    torch.testing.assert_close(_logits(neox, ids, spec), want, **TOL)

    qwen3 = eager_models["qwen3"]  # q and k after the per-head norms, already [batch, pos, heads, d_head]
    ids = _ids(qwen3)

    def qwen3_ref(x):
        out = x.clone()
        out[:, 1:3, 1] *= 0.5
        return out
    attn = qwen3.hf.model.layers[1].self_attn
    want = hf_logits(qwen3, ids, [(attn.q_norm, "out", qwen3_ref), (attn.k_norm, "out", qwen3_ref)])
    spec = SteerSpec.scale("q.1", 0.5, positions=(1, 2), heads=[1]) | SteerSpec.scale("k.1", 0.5, positions=(1, 2),
                                                                                      heads=[1])
    torch.testing.assert_close(_logits(qwen3, ids, spec), want, **TOL)

    gemma3 = eager_models["gemma3"]  # its norms see [batch, heads, pos, d_head]: heads before positions
    ids = _ids(gemma3)

    def gemma3_ref(x):
        out = x.clone()
        out[:, 1, 1:3] *= 0.5
        return out
    attn = gemma3.hf.model.layers[1].self_attn
    want = hf_logits(gemma3, ids, [(attn.q_norm, "out", gemma3_ref), (attn.k_norm, "out", gemma3_ref)])
    assert not torch.allclose(want, hf_logits(gemma3, ids))
    torch.testing.assert_close(_logits(gemma3, ids, spec), want, **TOL)

    llama = eager_models["llama"]
    ids = _ids(llama)
    ref = on_heads(lambda s, h: s * 0, llama.graph.n_heads, [1])
    want = hf_logits(llama, ids, [(llama.hf.model.layers[0].self_attn.q_proj, "out", ref)])
    torch.testing.assert_close(_logits(llama, ids, SteerSpec.zero("q.0", heads=[1])), want, **TOL)


# ---- residual-stream ops -----------------------------------------------------------------

@pytest.mark.parametrize("arch", ("qwen3", "gemma2", "gpt2"))
def test_zero_scale_mean_at_resid_post_equal_editing_the_layer_output(eager_models, arch):
    model = eager_models[arch]
    ids, L = _ids(model), 0
    layer = decoder_layers(model.hf)[L]
    m = torch.randn(model.d_model, generator=torch.Generator().manual_seed(2))
    cases = [
        (SteerSpec.zero(f"resid_post.{L}", positions=(2,)), on_columns(torch.zeros_like, slice(None), (2,))),
        (SteerSpec.scale(f"resid_post.{L}", 1.5), lambda x: x * 1.5),
        (SteerSpec.mean(f"resid_post.{L}", m, positions=(0, 1)),
         on_columns(lambda r: m.expand_as(r), slice(None), (0, 1))),
    ]
    for spec, ref in cases:
        want = hf_logits(model, ids, [(layer, "out", ref)])
        torch.testing.assert_close(_logits(model, ids, spec), want, **TOL, msg=lambda m_: f"{spec}: {m_}")


@pytest.mark.parametrize("arch", ("qwen3", "gemma2"))
def test_zero_and_scale_at_resid_mid(eager_models, arch):
    """resid_mid is written through attn_out with the layer input as base: zero means the
    whole sum is zero, scale multiplies the sum."""
    model = eager_models[arch]
    ids = _ids(model)
    layer = decoder_layers(model.hf)[0]
    norm = layer.pre_feedforward_layernorm if arch == "gemma2" else layer.post_attention_layernorm
    for spec, ref in ((SteerSpec.zero("resid_mid.0", positions=(1,)), on_columns(torch.zeros_like, slice(None), (1,))),
                      (SteerSpec.scale("resid_mid.0", 0.5), lambda x: x * 0.5)):
        captured = []
        h = norm.register_forward_pre_hook(lambda mod, args: captured.append(args[0].clone()))
        try:
            run_with_cache(model, ids, [], steer=spec)
        finally:
            h.remove()
        plain = run_with_cache(model, ids, ["resid_mid.0"])["resid_mid.0"]
        torch.testing.assert_close(captured[0], ref(plain), **TOL)


# ---- patching --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ("qwen3", "gemma2", "gpt2"))
def test_patch_across_positions_and_layers(eager_models, arch):
    """Patch z (two heads) and resid_pre from the clean run at some positions: equal to
    copying the clean run's o_proj input / layer input into the corrupted run by hand."""
    model = eager_models[arch]
    clean, corrupt = _pair(model)
    hf, H = model.hf, model.graph.n_heads
    n = clean.shape[1]
    source = run_with_cache(model, clean, ["z.0", f"resid_pre.{model.n_layers - 1}"])
    ref_z = hf_capture(model, clean, out_proj(hf, 0))
    last = decoder_layers(hf)[model.n_layers - 1]
    ref_pre = hf_capture(model, clean, last, "in") if arch != "gpt2" else None
    for positions in ((n - 1,), (1, n - 2)):
        spec = SteerSpec.patch("z.0", source, positions=positions, heads=[0, H - 1])
        heads_cols = [c for h in (0, H - 1) for c in range(h * model.graph.d_head, (h + 1) * model.graph.d_head)]

        def ref(x, positions=positions):
            out = x.clone()
            for p in positions:
                out[:, p, heads_cols] = ref_z[:, p, heads_cols]
            return out
        want = hf_logits(model, corrupt, [(out_proj(hf, 0), "in", ref)])
        torch.testing.assert_close(_logits(model, corrupt, spec), want, **TOL)
    # every position of a later layer's input: the corrupted run becomes the clean one from there
    spec = SteerSpec.patch(f"resid_pre.{model.n_layers - 1}", source)
    torch.testing.assert_close(_logits(model, corrupt, spec), hf_logits(model, clean), **TOL)
    if ref_pre is not None:
        torch.testing.assert_close(source[f"resid_pre.{model.n_layers - 1}"], ref_pre, **TOL)


def test_a_batched_patch_source_patches_row_by_row(eager_models):
    model = eager_models["qwen3"]
    a, b = _pair(model)
    both = torch.cat([a, b])
    swapped = torch.cat([b, a])
    source = run_with_cache(model, both, ["resid_post.0"])
    spec = SteerSpec.patch("resid_post.0", source, positions=(2, 3))
    logits = _logits(model, swapped, spec)
    for row, (target, src) in enumerate(((b, a), (a, b))):
        src_out = hf_capture(model, src, decoder_layers(model.hf)[0], "out")

        def ref(x, src_out=src_out):
            out = x.clone()
            out[:, [2, 3]] = src_out[:, [2, 3]]
            return out
        want = hf_logits(model, target, [(decoder_layers(model.hf)[0], "out", ref)])
        torch.testing.assert_close(logits[row:row + 1], want, **TOL)
    with pytest.raises(ValueError, match="source of 2 rows, but this run has 1"):
        run_with_cache(model, a, [], steer=spec)


# ---- composed plans and steered views -----------------------------------------------------

def test_run_a_composed_plan_and_a_steered_view(eager_models):
    model = eager_models["qwen3"]
    ids = _ids(model)
    spec = SteerSpec.zero("z.1", heads=[0]) | SteerSpec.scale("mlp_act.0", 2.0, neurons=[1, 2])
    plan = Plan(reads=["z.1", "resid_post.1"], writes=spec)
    logits, cache = run(model, ids, plan, return_logits=True)
    with steer(model, spec):
        ref_logits, ref = run_with_cache(model, ids, ["z.1", "resid_post.1"], return_logits=True)
    assert torch.equal(logits, ref_logits) and torch.equal(cache["resid_post.1"], ref["resid_post.1"])
    assert torch.equal(cache["z.1"][..., 0, :], torch.zeros_like(cache["z.1"][..., 0, :]))

    view = steered(model, spec)
    assert torch.equal(_logits(view, ids, None), logits)
    assert not torch.equal(_logits(model, ids, None), logits)  # the model itself is unchanged
    twice = steered(view, SteerSpec.zero("z.0", heads=[1]))
    assert torch.equal(_logits(twice, ids, None), _logits(model, ids, spec | SteerSpec.zero("z.0", heads=[1])))
    with steer(model, SteerSpec.zero("z.0", heads=[1])):  # a block on the model reaches its views
        assert torch.equal(_logits(view, ids, None), _logits(twice, ids, None))
    steps = [s.token_id for s in __import__("interp_engine").generate_stream(view, ids, max_tokens=3,
                                                                              temperature=0.0)]
    with steer(model, spec):
        assert steps == [s.token_id for s in __import__("interp_engine").generate_stream(
            model, ids, max_tokens=3, temperature=0.0)]


def test_a_user_transform_is_a_function_from_plans_to_plans(eager_models):
    model = eager_models["qwen3"]
    ids = _ids(model)

    def ablate_head(layer, head):
        return lambda plan: plan | Plan(writes=SteerSpec.zero(f"z.{layer}", heads=[head]))
    base = Plan(reads=["resid_post.2"])
    for head in range(model.graph.n_heads):
        cache = run(model, ids, ablate_head(1, head)(base))
        ref_logits = hf_logits(model, ids, [(out_proj(model.hf, 1), "in",
                                             on_heads(lambda s, h: s * 0, model.graph.n_heads, [head]))])
        logits, _ = run(model, ids, ablate_head(1, head)(base), return_logits=True)
        torch.testing.assert_close(logits, ref_logits, **TOL)
        assert cache["resid_post.2"].shape[-1] == model.d_model


# ---- refused before any forward ----------------------------------------------------------

def test_bad_writes_are_refused_before_any_forward(eager_models):
    model = eager_models["qwen3"]
    ids = _ids(model)
    H, dh = model.graph.n_heads, model.graph.d_head
    source = run_with_cache(model, ids, ["resid_post.0"])
    bad = [
        (lambda: SteerSpec.zero("z.0", heads=[H]), ValueError, rf"heads=\[{H}\].*out of range.*{H} n_heads"),
        (lambda: SteerSpec.zero("mlp_act.0", neurons=[model.graph.d_mlp + 3]), ValueError, "out of range"),
        (lambda: SteerSpec.zero("resid_post.0", heads=[1]), ValueError, "heads= does not apply at resid_post.0"),
        (lambda: SteerSpec.zero("z.0", neurons=[1]), ValueError, "neurons= does not apply at z.0"),
        (lambda: SteerSpec.add("z.0", torch.randn(H, dh + 1)), ValueError, r"\[\d+, \d+\] per position, expected"),
        (lambda: SteerSpec.add("z.0", torch.randn(model.d_model)), ValueError, "must be"),
        (lambda: SteerSpec.patch("resid_post.1", source), ValueError, "patch source has no resid_post.1"),
        (lambda: SteerSpec.patch("resid_post.0", source, positions=(0, 99)), ValueError, r"positions \[99\]"),
        (lambda: SteerSpec.patch("resid_post.0", ids), TypeError, "takes a Cache"),
        (lambda: SteerSpec.zero("z.0", heads=[1, 1]), ValueError, "repeats"),
        (lambda: SteerSpec.zero("z.0", heads=[]), ValueError, "empty"),
        (lambda: SteerSpec.scale("z.0", float("nan")), ValueError, "finite"),
        (lambda: SteerSpec.ablate("z.0", torch.zeros(H, dh)), ValueError, "zero norm"),
        (lambda: SteerSpec.ablate("z.0", torch.cat([torch.zeros(1, dh), torch.ones(H - 1, dh)]), heads=[0]),
         ValueError, "zero on heads"),
        (lambda: SteerSpec.zero("mlp_out.0", experts=[1]), ValueError, "no MoE layers"),
    ]
    with count_forwards(model.hf) as calls:
        for build, exc, pattern in bad:
            with pytest.raises(exc, match=pattern):
                run_with_cache(model, ids, [], steer=build())
    assert calls == []


def test_ops_are_frozen_content_equal_data(eager_models):
    v = torch.randn(4, 32)
    a, b = SteerSpec.mean("z.0", v, heads=[1]), SteerSpec.mean("z.0", v.clone(), heads=[1])
    v.add_(1.0)  # the spec holds its own copy
    assert a == b and hash(a) == hash(b) and a != SteerSpec.mean("z.0", v, heads=[1])
    assert SteerSpec.zero("z.0", heads=[1]) == SteerSpec.zero("z.0", heads=(1,))
    assert SteerSpec.zero("z.0", heads=[1]) != SteerSpec.zero("z.0", heads=[2])
    assert SteerSpec.scale("z.0", 2.0) != SteerSpec.scale("z.0", 3.0)
    with pytest.raises(AttributeError):
        a.ops[0].select = None
    assert a.ops[0].vector.shape == (4, 32)
    import pickle
    assert pickle.loads(pickle.dumps(a)) == a
    model = eager_models["qwen3"]
    source = run_with_cache(model, _ids(model), ["z.0"])
    p = SteerSpec.patch("z.0", source, positions=(0, 2))
    assert p.ops[0].vector.shape == (2, model.graph.n_heads, model.graph.d_head)
    assert torch.equal(p.ops[0].vector, source["z.0"][0, [0, 2]])
    assert isinstance(source, Cache)
