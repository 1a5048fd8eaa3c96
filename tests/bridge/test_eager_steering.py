"""Steering on the eager bridge against hand-written references: forward hooks on the HF
modules, and a hand-written decoder-layer forward that edits the residual stream at each
site. Covers add / ablate / set, positions, per-position vectors, every writable site,
composition and nesting, restoration on exceptions, and per-request steering."""

from __future__ import annotations

import asyncio

import pytest
import torch

from interp_engine import (SteerSpec, active_steering, generate_stream, run_with_cache, steer)
from tests._reference import PROMPT, add_at_output, count_forwards, hook_count

TOL = dict(rtol=1e-5, atol=1e-5)
SINGLE = ("qwen3", "llama", "gemma2", "qwen3_moe")
SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")


def _vec(model, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(model.d_model, generator=g) * scale


def _logits(model, ids) -> torch.Tensor:
    logits, _ = run_with_cache(model, ids, [], return_logits=True)
    return logits


def _hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.hf(ids).logits


def _hf_greedy(model, ids, n) -> list[int]:
    with torch.no_grad():
        out = model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                do_sample=False, eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()


def _greedy(model, ids, n) -> list[int]:
    return [s.token_id for s in generate_stream(model, ids, max_tokens=n, temperature=0.0,
                                                stop_at_eos=False)]


# ---- a hand-written decoder layer ---------------------------------------------------------

class Edit:
    """``fn(x)`` applied at absolute ``positions`` ("all", "prompt", "generated" or a list)
    of one site; counts positions across forwards, so it works inside HF generate."""

    def __init__(self, fn, positions="all", prompt_len=None, rows=None):
        self.fn, self.positions, self.prompt_len, self.rows = fn, positions, prompt_len, rows
        self.offset = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        absolute = range(self.offset, self.offset + n)
        self.offset += n
        if self.positions == "all":
            return self.fn(x, None)
        if self.positions == "prompt":
            cols = [i for i, p in enumerate(absolute) if p < self.prompt_len]
        elif self.positions == "generated":
            cols = [i for i, p in enumerate(absolute) if p >= self.prompt_len]
        else:
            cols = [i for i, p in enumerate(absolute) if p in self.positions]
        if not cols:
            return x
        out = x.clone()
        rows = None if self.rows is None else [self.positions.index(absolute[c]) for c in cols]
        out[:, cols] = self.fn(x[:, cols], rows)
        return out


def add_fn(v, scale=1.0):
    return lambda x, rows: x + scale * (v if rows is None else v[rows])


def ablate_fn(d):
    d = d / d.norm()
    return lambda x, rows: x - (x @ d).unsqueeze(-1) * d


def set_fn(v):
    return lambda x, rows: (v if rows is None else v[rows]).expand_as(x).clone()


def manual_layer(layer, arch: str, edits: dict):
    """The decoder layer written out by hand (Llama/Qwen pre-norm, or Gemma 2's sandwich
    norms), with ``edits[site](x)`` applied to the residual stream at each site."""
    def e(site, x):
        return edits[site](x) if site in edits else x

    def forward(hidden_states, *args, **kwargs):
        assert not args
        x = e("resid_pre", hidden_states)
        h, _ = layer.self_attn(hidden_states=layer.input_layernorm(x), **kwargs)
        if arch == "gemma2":
            h = layer.post_attention_layernorm(h)
        h = e("attn_out", h)
        mid = e("resid_mid", x + h)
        if arch == "gemma2":
            m = layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(mid)))
        else:
            m = layer.mlp(layer.post_attention_layernorm(mid))
        m = e("mlp_out", m)
        return e("resid_post", mid + m)

    return forward


def _with_manual(monkeypatch, model, layer_edits: dict[int, dict], run):
    for L, edits in layer_edits.items():
        layer = model.hf.model.layers[L]
        monkeypatch.setattr(layer, "forward", manual_layer(layer, model.graph.arch, edits))
    try:
        return run()
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("arch", SINGLE)
def test_manual_layer_reproduces_the_model(eager_models, arch, monkeypatch):
    model = eager_models[arch]
    ids = model.to_tokens(PROMPT)
    manual = _with_manual(monkeypatch, model, {L: {} for L in range(model.n_layers)},
                          lambda: _hf_logits(model, ids))
    torch.testing.assert_close(manual, _hf_logits(model, ids), **TOL)


# ---- add at resid_post vs a plain forward hook ----------------------------------------------

@pytest.mark.parametrize("arch", SINGLE)
def test_add_equals_a_hand_written_hook(eager_models, arch):
    model = eager_models[arch]
    ids = model.to_tokens(PROMPT)
    L, scale = 1, 6.0
    v = _vec(model, 0)
    spec = SteerSpec.add(f"resid_post.{L}", v, scale)
    with steer(model, spec):
        logits = _logits(model, ids)
        tokens = _greedy(model, ids, 8)
    handle = add_at_output(model.hf.model.layers[L], lambda out: scale * v)
    try:
        ref_logits = _hf_logits(model, ids)
        ref_tokens = _hf_greedy(model, ids, 8)
    finally:
        handle.remove()
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert tokens == ref_tokens
    assert tokens != _greedy(model, ids, 8)  # the steering matters here
    assert not torch.allclose(logits, _logits(model, ids), atol=1e-3)


def test_deepseek_sublayer_sites_equal_hooks(eager_models):
    model = eager_models["deepseek_v4"]
    ids = model.to_tokens(PROMPT)
    v, u = _vec(model, 1), _vec(model, 2)
    spec = SteerSpec.add("mlp_out.1", v, 5.0) | SteerSpec.add("attn_out.2", u, 3.0)
    with steer(model, spec):
        logits = _logits(model, ids)
        tokens = _greedy(model, ids, 6)
    layers = model.hf.model.layers
    handles = [add_at_output(layers[1].mlp, lambda out: 5.0 * v),
               add_at_output(layers[2].self_attn, lambda out: 3.0 * u, index=0)]
    try:
        ref = _hf_logits(model, ids)
        ref_tokens = _hf_greedy(model, ids, 6)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(logits, ref, **TOL)
    assert tokens == ref_tokens
    with pytest.raises(ValueError, match="not a steering site"):
        with steer(model, SteerSpec.add("resid_post.1", v)):
            pass


def test_scale_zero_is_bit_identical(eager_model):
    model = eager_model
    ids = model.to_tokens(PROMPT)
    site = "mlp_out.1" if model.residual_basis.n_streams > 1 else "resid_post.1"
    base = _logits(model, ids)
    with steer(model, SteerSpec.add(site, _vec(model, 3), 0.0)):
        assert torch.equal(_logits(model, ids), base)
    assert torch.equal(_logits(model, ids), base)


# ---- every site and op vs the hand-written layer ------------------------------------------

OPS = ("add", "ablate", "set")


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "qwen3_moe"])
@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("op", OPS)
def test_site_op_equals_manual_layer(eager_models, arch, site, op, monkeypatch):
    model = eager_models[arch]
    ids = model.to_tokens(PROMPT)
    L = 1
    v = _vec(model, 4, 3.0)
    if op == "add":
        spec, fn = SteerSpec.add(f"{site}.{L}", v, 2.0), add_fn(v, 2.0)
    elif op == "ablate":
        spec, fn = SteerSpec.ablate(f"{site}.{L}", v), ablate_fn(v)
    else:
        spec, fn = SteerSpec.set(f"{site}.{L}", v, positions=[2, 5]), set_fn(v)
    positions = [2, 5] if op == "set" else "all"
    with steer(model, spec):
        logits, cache = run_with_cache(model, ids, [f"{site}.{L}"], return_logits=True)
    ref = _with_manual(monkeypatch, model, {L: {site: Edit(fn, positions)}},
                       lambda: _hf_logits(model, ids))
    torch.testing.assert_close(logits, ref, **TOL)
    got = cache[f"{site}.{L}"]  # captured at the same site, inside the block
    if op == "ablate":
        torch.testing.assert_close(got @ (v / v.norm()), torch.zeros(got.shape[:2]), rtol=0, atol=1e-4)
    if op == "set":
        torch.testing.assert_close(got[0, [2, 5]], torch.stack([v, v]), **TOL)


def test_ablate_makes_the_residual_orthogonal(eager_models):
    model = eager_models["llama"]
    ids = model.to_tokens(PROMPT)
    d = _vec(model, 5)
    base = run_with_cache(model, ids, ["resid_post.1"])["resid_post.1"]
    assert (base @ (d / d.norm())).abs().max() > 1e-2  # there was something to remove
    with steer(model, SteerSpec.ablate("resid_post.1", d)):
        cache = run_with_cache(model, ids, ["resid_post.1", "resid_pre.2"])
    for name in ("resid_post.1", "resid_pre.2"):
        proj = cache[name] @ (d / d.norm())
        torch.testing.assert_close(proj, torch.zeros_like(proj), rtol=0, atol=1e-4)
    unit = d / d.norm()
    torch.testing.assert_close(cache["resid_post.1"], base - (base @ unit)[..., None] * unit, **TOL)


def test_set_replaces_only_its_positions(eager_models):
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    v = _vec(model, 6)
    base = run_with_cache(model, ids, ["resid_post.1"])["resid_post.1"]
    with steer(model, SteerSpec.set("resid_post.1", v, positions=[4])):
        got = run_with_cache(model, ids, ["resid_post.1"])["resid_post.1"]
    assert torch.equal(got[0, 4], v)
    keep = [i for i in range(ids.shape[1]) if i != 4]
    assert torch.equal(got[:, keep], base[:, keep])


def test_per_position_vectors(eager_models, monkeypatch):
    model = eager_models["gemma2"]
    ids = model.to_tokens(PROMPT)
    vs = torch.stack([_vec(model, 7, 4.0), _vec(model, 8, 4.0)])
    positions = [1, 3]
    with steer(model, SteerSpec.add("resid_mid.0", vs, 1.5, positions=positions)):
        logits = _logits(model, ids)
    with steer(model, SteerSpec.set("resid_post.2", vs, positions=positions)):
        cache = run_with_cache(model, ids, ["resid_post.2"])
    assert torch.equal(cache["resid_post.2"][0, positions], vs)
    ref = _with_manual(monkeypatch, model,
                       {0: {"resid_mid": Edit(add_fn(vs, 1.5), positions, rows=True)}},
                       lambda: _hf_logits(model, ids))
    torch.testing.assert_close(logits, ref, **TOL)


@pytest.mark.parametrize("positions", ["prompt", "generated", "explicit"])
def test_positions_in_generation(eager_models, positions, monkeypatch):
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    P, n = ids.shape[1], 8
    v = _vec(model, 9, 6.0)
    where = [1, P - 1, P + 2] if positions == "explicit" else positions
    spec = SteerSpec.add("resid_post.0", v, 1.0, positions=where)
    with steer(model, spec):
        tokens = _greedy(model, ids, n)
    ref = _with_manual(monkeypatch, model,
                       {0: {"resid_post": Edit(add_fn(v), where, prompt_len=P)}},
                       lambda: _hf_greedy(model, ids, n))
    assert tokens == ref
    assert tokens != _greedy(model, ids, n)


def test_per_position_vectors_in_generation(eager_models, monkeypatch):
    model = eager_models["llama"]
    ids = model.to_tokens(PROMPT)
    P = ids.shape[1]
    vs = torch.stack([_vec(model, 10, 6.0), _vec(model, 11, 6.0), _vec(model, 12, 6.0)])
    where = [P - 1, P, P + 3]
    with steer(model, SteerSpec.add("mlp_out.2", vs, positions=where)):
        tokens = _greedy(model, ids, 7)
    ref = _with_manual(monkeypatch, model,
                       {2: {"mlp_out": Edit(add_fn(vs), where, prompt_len=P, rows=True)}},
                       lambda: _hf_greedy(model, ids, 7))
    assert tokens == ref


# ---- composition, nesting, ordering ------------------------------------------------------

def test_nested_blocks_equal_the_composed_spec(eager_models):
    model = eager_models["qwen3_moe"]
    ids = model.to_tokens(PROMPT)
    a = SteerSpec.add("resid_post.0", _vec(model, 13), 4.0)
    b = SteerSpec.ablate("resid_post.0", _vec(model, 14)) | SteerSpec.set("mlp_out.2", _vec(model, 15),
                                                                          positions=[3])
    with steer(model, a):
        only_a = _logits(model, ids)
        with steer(model, b):
            nested = _logits(model, ids)
            nested_tokens = _greedy(model, ids, 6)
            assert len(active_steering(model)) == 3
        assert torch.equal(_logits(model, ids), only_a)
    with steer(model, a | b):
        composed = _logits(model, ids)
        composed_tokens = _greedy(model, ids, 6)
    assert torch.equal(nested, composed) and nested_tokens == composed_tokens
    with steer(model, b | a):  # order matters: ablate-then-add is not add-then-ablate
        assert not torch.allclose(_logits(model, ids), composed, atol=1e-4)
    assert len(active_steering(model)) == 0


def test_resid_mid_write_sees_resid_pre_write_at_the_same_layer(eager_models, monkeypatch):
    """A set/ablate at resid_mid composed with a resid_pre write at the same layer acts on
    the steered residual, whichever order the ops are listed in."""
    model = eager_models["qwen3"]
    ids = model.to_tokens(PROMPT)
    v, u = _vec(model, 16), _vec(model, 17)
    mid = SteerSpec.set("resid_mid.1", v)
    pre = SteerSpec.add("resid_pre.1", u, 3.0)
    ref = _with_manual(monkeypatch, model,
                       {1: {"resid_pre": Edit(add_fn(u, 3.0)), "resid_mid": Edit(set_fn(v))}},
                       lambda: _hf_logits(model, ids))
    for spec in (pre | mid, mid | pre):
        with steer(model, spec):
            logits, cache = run_with_cache(model, ids, ["resid_mid.1"], return_logits=True)
        torch.testing.assert_close(cache["resid_mid.1"], v.expand_as(cache["resid_mid.1"]), **TOL)
        torch.testing.assert_close(logits, ref, **TOL)
    d = _vec(model, 18)
    with steer(model, SteerSpec.set("resid_mid.1", v)):  # nested: outer mid, inner pre
        with steer(model, SteerSpec.add("resid_pre.1", u, 3.0)):
            nested = _logits(model, ids)
    torch.testing.assert_close(nested, ref, **TOL)
    with steer(model, SteerSpec.ablate("resid_mid.2", d) | SteerSpec.add("resid_pre.2", u, 5.0)):
        got = run_with_cache(model, ids, ["resid_mid.2"])["resid_mid.2"]
    torch.testing.assert_close(got @ (d / d.norm()), torch.zeros(got.shape[:2]), rtol=0, atol=1e-4)


# ---- restoration, isolation, errors --------------------------------------------------------

def test_exception_inside_the_block_restores_the_model(eager_models):
    model = eager_models["gemma2"]
    ids = model.to_tokens(PROMPT)
    before_hooks = hook_count(model.hf)
    base = _logits(model, ids)
    params = {k: p.clone() for k, p in model.hf.state_dict().items()}
    with pytest.raises(KeyError, match="user code"):
        with steer(model, SteerSpec.add("resid_post.0", _vec(model, 19), 9.0)):
            assert not torch.equal(_logits(model, ids), base)
            raise KeyError("user code failed")
    assert len(active_steering(model)) == 0
    assert hook_count(model.hf) == before_hooks
    assert torch.equal(_logits(model, ids), base)
    assert all(torch.equal(p, params[k]) for k, p in model.hf.state_dict().items())


def test_steering_is_per_model(eager_models):
    a, b = eager_models["qwen3"], eager_models["llama"]
    ids_b = b.to_tokens(PROMPT)
    base_b = _logits(b, ids_b)
    with steer(a, SteerSpec.add("resid_post.0", _vec(a, 20), 9.0)):
        assert torch.equal(_logits(b, ids_b), base_b)
        assert len(active_steering(b)) == 0 and len(active_steering(a)) == 1


def test_per_request_steer_equals_the_block(eager_models):
    model = eager_models["llama"]
    ids = model.to_tokens(PROMPT)
    spec = SteerSpec.add("attn_out.1", _vec(model, 21), 8.0, positions="generated")
    with steer(model, spec):
        blocked = "".join(s.token_str for s in generate_stream(model, ids, max_tokens=8, temperature=0.0))
    per_request = asyncio.run(model.generate_text(ids, max_tokens=8, temperature=0.0, steer=spec))
    plain = asyncio.run(model.generate_text(ids, max_tokens=8, temperature=0.0))
    assert per_request == blocked and per_request != plain
    deltas = asyncio.run(_collect(model.generate_stream(ids, max_tokens=8, temperature=0.0, steer=spec)))
    assert "".join(deltas) == per_request
    full = asyncio.run(model.generate_full(ids, max_tokens=8, temperature=0.0, steer=spec))
    assert full.text == per_request


async def _collect(agen):
    return [x async for x in agen]


def test_gradients_reach_a_steering_vector(eager_models):
    model = eager_models["qwen3"]  # frozen parameters: gradients still flow through the forward
    v = _vec(model, 22).requires_grad_(True)
    with steer(model, SteerSpec.add("resid_post.0", v, 2.0)):
        cache = run_with_cache(model, model.to_tokens(PROMPT), ["resid_post.2"], detach=False)
    cache["resid_post.2"].pow(2).sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.hf.parameters())


@pytest.mark.parametrize("spec_fn, error, match", [
    (lambda m: SteerSpec.add("resid_post.0", torch.randn(64)), ValueError, r"width 64.*d_model=128"),
    (lambda m: SteerSpec.add("resid_post.0", torch.randn(2, 64), positions=[0, 1]), ValueError, "width 64"),
    (lambda m: SteerSpec.add("resid_post.0", torch.randn(128, dtype=torch.float64)), TypeError,
     r"dtype torch.float64.*torch.float32"),
    (lambda m: SteerSpec.set("resid_post.0", torch.randn(128, dtype=torch.bfloat16)), TypeError,
     "bfloat16"),
    (lambda m: SteerSpec.add("resid_post.99", torch.randn(128)), ValueError, r"resid_post\.99.*3 layers"),
    (lambda m: SteerSpec.add("resid_streams.0", torch.randn(128)), ValueError, "'resid_streams'"),
    (lambda m: SteerSpec.add("z.0", torch.randn(128)), ValueError, r"z\.0 must be \[n_heads, d_head\]"),
    (lambda m: SteerSpec.add("pattern.0", torch.randn(128)), ValueError, r"pattern\.0.*not a steering site"),
    (lambda m: None, TypeError, "SteerSpec"),
    (lambda m: "resid_post.0", TypeError, "SteerSpec"),
])
def test_bad_steering_raises_on_entry(eager_models, spec_fn, error, match):
    model = eager_models["qwen3"]
    with count_forwards(model.hf) as calls:
        with pytest.raises(error, match=match):
            with steer(model, spec_fn(model)):
                pytest.fail("the block must not run")
    assert calls == [] and len(active_steering(model)) == 0
