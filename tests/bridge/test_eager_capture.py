"""Capture on the eager bridge, every point on every tiny arch, against references computed
from the Hugging Face model itself (its hidden states, its eager attention probabilities, and
hand-written hooks on its submodules); padded batches; gradients; hook hygiene."""

from __future__ import annotations

import pytest
import torch
from tests._reference import (PROMPT, PROMPTS, all_addresses, count_forwards, decoder_layers,
                              final_norm, hook_count, reference_outputs, reference_points)

from interp_engine import (Address, Cache, SteerSpec, expert_assignment, head_contributions,
                           run_with_cache, steer)
from interp_engine.testing import TINY_ARCHS, tiny_config
from specs import spec_for_config

TOL = dict(rtol=1e-5, atol=1e-5)


def _graph(arch):
    config = tiny_config(arch)
    return spec_for_config(config).graph_from_config(config)


ARCH_POINTS = [(arch, p.name) for arch in TINY_ARCHS for p in _graph(arch).points()]


@pytest.fixture(scope="module")
def captured(eager_models, hf_copies):
    """arch -> (model, ids, library cache of every address, hand-written hook reference, HF's
    own hidden states and attention probabilities)."""
    out = {}

    def get(arch):
        if arch not in out:
            model = eager_models[arch]
            ids = model.to_tokens(PROMPT)
            addresses = all_addresses(model)
            if model.residual_basis.n_streams > 1:
                addresses += [Address("resid_streams", L, s) for L in range(model.n_layers)
                              for s in range(model.residual_basis.n_streams)]
            # pattern runs the eager attention kernel, the other points the model's own (as the
            # reference does): the kernels agree to fp32 rounding, not within 1e-5 at every scale
            patterns_at = [a for a in addresses if a.name == "pattern"]
            cache = {"": run_with_cache(model, ids, [a for a in addresses if a.name != "pattern"])}
            if patterns_at:
                cache["pattern"] = run_with_cache(model, ids, patterns_at)
            ref = reference_points(model, ids)
            hidden, patterns = reference_outputs(hf_copies[arch], ids,
                                                 with_attentions=arch != "deepseek_v4")
            out[arch] = (model, ids, cache, ref, hidden, patterns)
        return out[arch]

    return get


@pytest.mark.parametrize("arch, name", ARCH_POINTS, ids=[f"{a}-{n}" for a, n in ARCH_POINTS])
def test_point_matches_hf_reference(captured, arch, name):
    model, ids, cache, ref, hidden, patterns = captured(arch)
    g = model.graph
    b, p = ids.shape
    layers = g.layers_of(name)
    assert layers, f"{name} listed on {arch} but at no layer"
    for L in layers:
        got = cache.get(name, cache[""]).get(name, L)
        assert got.shape == g.shape_of(Address(name, L), b, p), (name, L, got.shape)
        if name == "pattern":
            want = patterns[L]
        elif name == "resid_post" and L < g.n_layers - 1:
            want = hidden[L + 1]  # HF's own hidden states (the last one is after the final norm)
            torch.testing.assert_close(got, ref[("resid_post", L)], **TOL)
        elif name == "resid_pre":
            want = hidden[L]
            torch.testing.assert_close(got, ref[("resid_pre", L)], **TOL)
        else:
            want = ref[(name, L)]
        if name in ("expert_indices",):
            assert torch.equal(got, want.to(got.dtype)), (arch, name, L)
        else:
            torch.testing.assert_close(got, want.to(got.dtype), **TOL, msg=f"{arch} {name}.{L}")
        if name == "resid_streams":
            for s in range(g.residual_basis.n_streams):
                torch.testing.assert_close(cache[""].get(name, L, s), want[:, :, s], **TOL)
                assert cache[""].get(name, L, s).shape == (b, p, g.d_model)


def test_last_layer_resid_post_feeds_the_head(eager_model):
    """The last resid_post, through the final norm and unembedding, gives the model's logits
    (on DeepSeek-V4 the head first collapses the stream stack with its HyperHead)."""
    model = eager_model
    ids = model.to_tokens(PROMPT)
    logits, cache = run_with_cache(model, ids, [f"resid_post.{model.n_layers - 1}"], return_logits=True)
    hf = model.hf
    with torch.no_grad():
        last = cache.get("resid_post", model.n_layers - 1)
        if model.residual_basis.n_streams > 1:
            last = hf.model.hc_head(last)
        mine = hf.lm_head(final_norm(hf)(last))
        cap = getattr(hf.config, "final_logit_softcapping", None)
        if cap:
            mine = torch.tanh(mine / cap) * cap
        theirs = hf(ids).logits
    torch.testing.assert_close(mine, theirs, **TOL)
    torch.testing.assert_close(logits, theirs, **TOL)


@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS
                                  if any(p.name == "resid_mid" for p in _graph(a).points())
                                  and _graph(a).residual_basis.n_streams == 1])
def test_residual_identities(eager_models, arch):
    model = eager_models[arch]
    names = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
    cache = run_with_cache(model, model.to_tokens(PROMPT),
                           [Address(n, L) for n in names for L in range(model.n_layers)])
    for L in range(model.n_layers):
        torch.testing.assert_close(cache.get("resid_post", L),
                                   cache.get("resid_mid", L) + cache.get("mlp_out", L), **TOL)
        torch.testing.assert_close(cache.get("resid_mid", L),
                                   cache.get("resid_pre", L) + cache.get("attn_out", L), **TOL)
        if L:
            assert torch.equal(cache.get("resid_pre", L), cache.get("resid_post", L - 1))


def test_deepseek_streams_stack(eager_models):
    model = eager_models["deepseek_v4"]
    ids = model.to_tokens(PROMPT)
    n = model.residual_basis.n_streams
    assert n == 4
    points = ["resid_post.1", "resid_streams.1"] + [f"resid_streams.1.{s}" for s in range(n)]
    cache = run_with_cache(model, ids, points)
    stack = cache["resid_streams.1"]
    assert stack.shape == (1, ids.shape[1], 4, model.d_model)
    assert torch.equal(stack, cache["resid_post.1"])
    for s in range(n):
        assert torch.equal(cache[f"resid_streams.1.{s}"], cache["resid_post.1"][:, :, s])
    # the streams really are different (the test would be vacuous otherwise)
    assert not torch.allclose(stack[:, :, 0], stack[:, :, 1])


def test_only_requested_points_are_kept(eager_models):
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    cache = run_with_cache(model, ids, ["resid_post.1", ("attn_out", 0), Address("resid_post", 1)])
    assert set(cache) == {Address("resid_post", 1), Address("attn_out", 0)} and len(cache) == 2
    assert "resid_post.0" not in cache and "mlp_out.1" not in cache
    single = run_with_cache(model, ids, "z.2")
    assert list(single.keys()) == [Address("z", 2)]
    ds = eager_models["deepseek_v4"]
    cache = run_with_cache(ds, ds.to_tokens(PROMPT), ["resid_streams.2.1"])
    assert list(cache.keys()) == [Address("resid_streams", 2, 1)]


def test_cache_lookup_forms_and_errors(eager_models):
    model = eager_models["llama"]
    cache = run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.1", "mlp_out.0"])
    t = cache[Address("resid_post", 1)]
    assert cache["resid_post.1"] is t and cache.get("resid_post", 1) is t and cache[("resid_post", 1)] is t
    assert Address("resid_post", 1) in cache and "resid_post.1" in cache and "bogus" not in cache
    with pytest.raises(KeyError) as info:
        cache["resid_post.2"]
    assert "resid_post.2" in str(info.value) and "resid_post.1" in str(info.value) \
        and "mlp_out.0" in str(info.value)
    assert isinstance(cache, Cache) and not t.requires_grad
    assert cache.lengths == [model.to_tokens(PROMPT).shape[1]]
    moved = cache.to("cpu")
    assert set(moved) == set(cache) and torch.equal(moved["mlp_out.0"], cache["mlp_out.0"])


# ---- batches of unequal length ---------------------------------------------------------

def test_padded_batch_equals_one_by_one(eager_model):
    """Batched and single-prompt forwards differ only by float summation order (residuals
    are O(10) on these models, hence atol 1e-4)."""
    model = eager_model
    tol = dict(rtol=1e-5, atol=1e-4)
    batch = model.tok.to_tokens(list(PROMPTS))
    lengths = batch.lengths
    assert batch.padded and lengths[0] != lengths[1]
    addresses = all_addresses(model)
    logits_b, cache_b = run_with_cache(model, batch, addresses, return_logits=True)
    assert torch.equal(cache_b.attention_mask, batch.attention_mask)
    for i, n in enumerate(lengths):
        logits_1, cache_1 = run_with_cache(model, batch.ids[i:i + 1, :n], addresses, return_logits=True)
        torch.testing.assert_close(logits_b[i:i + 1, :n], logits_1, **tol)
        assert torch.all(logits_b[i, n:] == 0)
        for a in addresses:
            got = cache_b[a][i:i + 1]
            if a.name == "pattern":
                torch.testing.assert_close(got[:, :, :n, :n], cache_1[a], **tol)
                assert torch.all(got[:, :, n:] == 0) and torch.all(got[:, :, :, n:] == 0), a
            else:
                torch.testing.assert_close(got[:, :n], cache_1[a].to(got.dtype), **tol,
                                           msg=lambda m, a=a: f"{a}: {m}")
                assert torch.all(got[:, n:] == 0), f"padded positions of {a} are not zero"


def test_batch_inputs_are_checked(eager_models):
    model = eager_models["qwen3"]
    ok = run_with_cache(model, [[5, 6, 7], [8, 9]], ["resid_post.0"])
    assert ok["resid_post.0"].shape == (2, 3, model.d_model) and ok.lengths == [3, 2]
    with pytest.raises(ValueError, match="empty prompt"):
        run_with_cache(model, [[5, 6], []], ["resid_post.0"])
    from interp_engine import TokenBatch
    left = TokenBatch(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]))
    with pytest.raises(ValueError, match="right-padded"):
        run_with_cache(model, left, ["resid_post.0"])


# ---- gradients ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grad_model(model_pool):
    return model_pool.get("qwen3", "eager", requires_grad=True)


def test_gradients_reach_parameters_and_captures(grad_model):
    model = grad_model
    assert model.grad_support.through_forward and model.grad_support.to_parameters
    assert all(p.requires_grad for p in model.hf.parameters())
    model.hf.zero_grad(set_to_none=True)
    cache = run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.1", "mlp_out.0"], detach=False)
    post, mlp = cache["resid_post.1"], cache["mlp_out.0"]
    assert post.requires_grad and post.grad_fn is not None
    post.retain_grad()
    mlp.retain_grad()
    post.sum().backward()
    assert torch.equal(post.grad, torch.ones_like(post))
    assert mlp.grad is not None and mlp.grad.abs().sum() > 0
    layers = model.hf.model.layers
    for L in (0, 1):
        grad = layers[L].self_attn.q_proj.weight.grad
        assert grad is not None and grad.abs().sum() > 0, L
    assert model.hf.model.embed_tokens.weight.grad.abs().sum() > 0
    # nothing downstream of resid_post.1 is in the graph
    assert layers[2].mlp.down_proj.weight.grad is None
    assert model.hf.lm_head.weight.grad is None
    model.hf.zero_grad(set_to_none=True)


def test_gradients_match_a_plain_hf_backward(grad_model):
    model = grad_model
    ids = model.to_tokens(PROMPT)
    model.hf.zero_grad(set_to_none=True)
    run_with_cache(model, ids, ["resid_post.0"], detach=False)["resid_post.0"].pow(2).sum().backward()
    mine = model.hf.model.layers[0].mlp.up_proj.weight.grad.clone()
    model.hf.zero_grad(set_to_none=True)
    seen = []
    handle = model.hf.model.layers[0].register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        model.hf(ids)
    finally:
        handle.remove()
    seen[0].pow(2).sum().backward()
    torch.testing.assert_close(mine, model.hf.model.layers[0].mlp.up_proj.weight.grad, **TOL)
    model.hf.zero_grad(set_to_none=True)


def test_detach_default_and_frozen_model(eager_models):
    model = eager_models["qwen3"]
    assert not model.grad_support.to_parameters and model.grad_support.through_forward
    assert not any(p.requires_grad for p in model.hf.parameters())
    assert not run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.0"])["resid_post.0"].requires_grad
    with pytest.raises(TypeError, match="detach"):
        run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.0"], detach="no")


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_a_frozen_model_gives_gradients_to_its_captures(eager_models, arch):
    """grad_support.through_forward is true on a frozen model, so detach=False must record the
    forward: the gradient of a later capture with respect to an earlier one equals a finite
    difference taken by really perturbing the earlier point (a steering add there)."""
    model = eager_models[arch]
    assert model.grad_support.through_forward and not model.grad_support.to_parameters
    ids = model.to_tokens(PROMPT)
    cache = run_with_cache(model, ids, ["resid_post.0", "resid_post.2"], detach=False)
    early, late = cache["resid_post.0"], cache["resid_post.2"]
    assert early.grad_fn is not None and late.grad_fn is not None
    weights = torch.randn(late.shape, generator=torch.Generator().manual_seed(0))
    (grad,) = torch.autograd.grad((late * weights).sum(), early)
    assert not any(p.grad is not None for p in model.hf.parameters())  # parameters stay frozen
    pos, eps = 3, 1e-2
    direction = torch.zeros(model.d_model)
    direction[5] = 1.0

    def objective(sign):
        spec = SteerSpec.add("resid_post.0", direction, scale=sign * eps, positions=[pos])
        with steer(model, spec):
            later = run_with_cache(model, ids, ["resid_post.2"])["resid_post.2"].double()
        return float((later * weights.double()).sum())

    finite = (objective(+1) - objective(-1)) / (2 * eps)
    assert finite == pytest.approx(float(grad[0, pos, 5]), rel=2e-2, abs=1e-3)
    assert float(grad[0, pos + 1:].abs().sum()) > 0 and float(grad[0, :pos].abs().sum()) > 0


# ---- hooks are removed on every path ------------------------------------------------------

def test_hooks_removed_after_normal_calls(eager_model):
    model = eager_model
    before = hook_count(model.hf)
    ids = model.to_tokens(PROMPT)
    run_with_cache(model, ids, all_addresses(model))
    run_with_cache(model, model.tok.to_tokens(list(PROMPTS)), all_addresses(model), return_logits=True)
    site = "mlp_out.1"
    with steer(model, SteerSpec.add(site, torch.randn(model.d_model), 2.0)):
        run_with_cache(model, ids, [site])
        assert hook_count(model.hf) == before
    assert hook_count(model.hf) == before


def test_hooks_removed_when_a_module_raises(eager_model, monkeypatch):
    model = eager_model
    ids = model.to_tokens(PROMPT)
    before = hook_count(model.hf)
    baseline, _ = run_with_cache(model, ids, ["resid_post.0"], return_logits=True)
    attn_impl = model.hf.config._attn_implementation
    mlp = decoder_layers(model.hf)[1].mlp

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure inside the forward")

    monkeypatch.setattr(mlp, "forward", boom)
    points = all_addresses(model)
    spec = SteerSpec.add("mlp_out.0", torch.randn(model.d_model), 3.0) | \
        SteerSpec.ablate("attn_out.2", torch.randn(model.d_model))
    with pytest.raises(RuntimeError, match="injected failure"):
        with steer(model, spec):
            run_with_cache(model, ids, points)
    assert hook_count(model.hf) == before
    with pytest.raises(RuntimeError, match="injected failure"):
        run_with_cache(model, model.tok.to_tokens(list(PROMPTS)), points, detach=False)
    assert hook_count(model.hf) == before
    assert model.hf.config._attn_implementation == attn_impl  # the pattern switch is undone
    monkeypatch.undo()
    after, _ = run_with_cache(model, ids, ["resid_post.0"], return_logits=True)
    assert torch.equal(after, baseline)
    assert torch.is_grad_enabled()


def test_hooks_removed_when_a_steering_op_raises(eager_models, monkeypatch):
    """A failure inside a hook closure (here the op itself) also leaves nothing behind."""
    import bridge.eager as eager_module

    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    before = hook_count(model.hf)
    baseline, _ = run_with_cache(model, ids, ["resid_post.0"], return_logits=True)

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure in a steering op")

    monkeypatch.setattr(eager_module, "apply_write", broken)
    import bridge.eager as eager_module
    monkeypatch.setattr(eager_module, "apply_write", broken)
    with steer(model, SteerSpec.add("resid_post.2", torch.randn(model.d_model))):
        with pytest.raises(RuntimeError, match="injected failure in a steering op"):
            run_with_cache(model, ids, ["resid_post.1", "z.0"])
    assert hook_count(model.hf) == before
    monkeypatch.undo()
    after, _ = run_with_cache(model, ids, ["resid_post.0"], return_logits=True)
    assert torch.equal(after, baseline)


def test_capture_runs_one_forward(eager_models):
    model = eager_models["gemma2"]
    with count_forwards(model.hf) as calls:
        run_with_cache(model, model.to_tokens(PROMPT), all_addresses(model))
    assert len(calls) == 1


# ---- helpers on a cache: per-head contributions and dense expert routing -------------------

@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma2", "qwen3_moe"])
def test_head_contributions_sum_to_the_output_projection(eager_models, arch):
    model = eager_models[arch]
    ids = model.to_tokens(PROMPT)
    g = model.graph
    cache = run_with_cache(model, ids, [Address(n, L) for n in ("z", "attn_out") for L in range(g.n_layers)])
    ref = reference_points(model, ids)
    for L in range(g.n_layers):
        heads = head_contributions(model, cache, L)
        assert heads.shape == (1, ids.shape[1], g.n_heads, g.d_model)
        o_proj = model.hf.model.layers[L].self_attn.o_proj
        bias = o_proj.bias if o_proj.bias is not None else 0.0
        total = heads.sum(dim=2) + bias
        if arch == "gemma2":  # attn_out is the post-attention norm's output; the heads sum to its input
            torch.testing.assert_close(total, ref[("o_proj_out", L)], **TOL)
            assert not torch.allclose(total, cache.get("attn_out", L), atol=1e-3)
        else:
            torch.testing.assert_close(total, cache.get("attn_out", L), **TOL)
        # each head is its own slice of z through its own columns of W_O
        h = 1
        w = o_proj.weight[:, h * g.d_head:(h + 1) * g.d_head]
        torch.testing.assert_close(heads[:, :, h], cache.get("z", L)[:, :, h] @ w.T, **TOL)


def test_head_contributions_errors(eager_models):
    model = eager_models["qwen3"]
    cache = run_with_cache(model, model.to_tokens(PROMPT), ["attn_out.0"])
    with pytest.raises(KeyError, match=r"z\.0"):
        head_contributions(model, cache, 0)
    with pytest.raises(ValueError, match=r"z\.5.*3 layers"):
        head_contributions(model, cache, 5)
    ds = eager_models["deepseek_v4"]
    with pytest.raises(ValueError, match="'z'"):
        head_contributions(ds, cache, 0)


def _check_dense(dense, indices, weights, n_experts):
    assert dense.shape == indices.shape[:-1] + (n_experts,)
    nonzero = dense != 0
    for pos in range(indices.shape[1]):
        chosen = set(indices[0, pos].tolist())
        assert set(torch.nonzero(nonzero[0, pos]).flatten().tolist()) == chosen, pos
    torch.testing.assert_close(dense.sum(-1), weights.sum(-1), **TOL)
    distinct = torch.tensor([len(set(row)) == len(row) for row in indices[0].tolist()])
    # where a position selects distinct experts, each gets exactly its own weight
    torch.testing.assert_close(dense.gather(-1, indices)[0, distinct], weights[0, distinct], **TOL)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v4"])
def test_expert_assignment_matches_the_selection(eager_models, arch):
    model = eager_models[arch]
    g = model.graph
    ids = model.to_tokens(PROMPT)
    names = ("router_logits", "expert_weights", "expert_indices")
    cache = run_with_cache(model, ids, [Address(n, L) for n in names for L in g.moe_layers])
    for L in g.moe_layers:
        indices, weights = cache.get("expert_indices", L), cache.get("expert_weights", L)
        dense = expert_assignment(cache, L, g.n_experts)
        _check_dense(dense, indices, weights, g.n_experts)
        if arch == "qwen3_moe":
            torch.testing.assert_close(dense.sum(-1), torch.ones(dense.shape[:2]), **TOL)  # norm_topk_prob
            logits_only = run_with_cache(model, ids, [Address("router_logits", L)])
            from_logits = expert_assignment(logits_only, L, g.n_experts, top_k=g.top_k)
            torch.testing.assert_close(from_logits, dense, **TOL)
            with pytest.raises(ValueError, match="top_k"):
                expert_assignment(logits_only, L, g.n_experts)
    with pytest.raises(ValueError, match="n_experts"):
        expert_assignment(cache, g.moe_layers[0], 0)
    assert int(cache.get("expert_indices", g.moe_layers[-1]).max()) >= 1
    with pytest.raises(ValueError, match=rf"n_experts=1, but this {arch} model's router has {g.n_experts} experts"):
        expert_assignment(cache, g.moe_layers[-1], 1)
    with pytest.raises(ValueError, match=rf"n_experts=16, but .* has {g.n_experts}"):
        expert_assignment(cache, g.moe_layers[-1], 2 * g.n_experts)
    # without the graph (a cache built by hand), the router's own width still decides
    bare = Cache({a: cache[a] for a in cache if a.layer == g.moe_layers[-1]})
    with pytest.raises(ValueError, match=rf"router_logits.*has {g.n_experts} experts"):
        expert_assignment(bare, g.moe_layers[-1], 2 * g.n_experts)
    logits_only = Cache({Address("router_logits", g.moe_layers[-1]): cache.get("router_logits", g.moe_layers[-1])})
    for bad_k in (0, g.n_experts + 1, 1.5):
        with pytest.raises(ValueError, match=rf"top_k must be an int in \[1, {g.n_experts}\]"):
            expert_assignment(logits_only, g.moe_layers[-1], g.n_experts, top_k=bad_k)
    with pytest.raises(KeyError, match="expert_indices"):
        expert_assignment(Cache({}), 0, g.n_experts)


def test_shared_models_carry_no_hooks(eager_models):
    """Nothing in this suite leaves a hook on the shared models (not even transformers' own
    output-recording hooks, which output_hidden_states would install for good)."""
    for arch in TINY_ARCHS:
        assert hook_count(eager_models[arch].hf) == 0, arch
