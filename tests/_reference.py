"""Independent references for the eager suite, written against the Hugging Face modules
directly (never through interp_engine's specs or bridge): hand-written forward hooks on the
transformers submodules, hook counting, and forward counting.

Imported by the test modules as ``tests._reference`` (tests/ is a package, so pytest's default
import mode puts the repository root on sys.path).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from interp_engine import Address

PROMPT = "The quick brown fox jumps over the lazy dog."
PROMPTS = ("Paris is the capital of France, and Berlin is", "Hi there")


def decoder_layers(hf: nn.Module) -> nn.ModuleList:
    """The model's blocks, by its HF layout (``transformer.h`` on GPT-2, ``model.layers`` else)."""
    if hf.config.model_type == "gpt_neox":
        return hf.gpt_neox.layers
    return hf.transformer.h if hf.config.model_type == "gpt2" else hf.model.layers


def final_norm(hf: nn.Module) -> nn.Module:
    """The norm before the unembedding (``transformer.ln_f`` on GPT-2, ``model.norm`` else)."""
    if hf.config.model_type == "gpt_neox":
        return hf.gpt_neox.final_layer_norm
    return hf.transformer.ln_f if hf.config.model_type == "gpt2" else hf.model.norm


def hook_count(hf: nn.Module) -> int:
    """Every forward and forward-pre hook registered anywhere in the model."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in hf.modules())


@contextlib.contextmanager
def count_forwards(hf: nn.Module) -> Iterator[list[int]]:
    """Count top-level forwards of ``hf`` (and the input length of each) while the block runs."""
    calls: list[int] = []

    def pre(mod, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None and args:
            ids = args[0]
        calls.append(int(ids.shape[1]) if ids is not None else -1)

    handle = hf.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def all_addresses(model) -> list[Address]:
    """Every Address that exists on ``model`` (every point at every layer it has)."""
    out = []
    for spec in model.points():
        for layer in model.graph.layers_of(spec.name):
            out.append(Address(spec.name, layer))
    return out


@contextlib.contextmanager
def _hooks() -> Iterator[Callable]:
    handles = []

    def add(module: nn.Module, fn: Callable, pre: bool = False) -> None:
        if pre:
            handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(fn))

    try:
        yield add
    finally:
        for h in handles:
            h.remove()


# Routed-MoE archs whose router is ``layer.mlp.gate`` returning (logits, weights, indices), and
# those among them that select by softmax over all experts, then top-k (recomputed here).
_ROUTED = ("qwen3_moe", "mixtral", "deepseek_v4")
_SOFTMAX_TOPK = ("qwen3_moe", "mixtral")


def _first_input(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


@torch.no_grad()
def reference_points(model, ids: torch.Tensor) -> dict[tuple[str, int], torch.Tensor]:
    """Run ``model.hf`` once on ``ids`` [1, pos] with hand-written hooks and return
    ``(name, layer) -> tensor`` for every point but ``pattern`` (see ``reference_outputs``)."""
    hf = model.hf
    arch = model.graph.arch
    if arch == "gpt2":
        return _reference_gpt2(hf, ids, model.graph.n_heads)
    if arch == "gpt_neox":
        return _reference_gpt_neox(hf, ids, model.graph.n_heads)
    n_heads, n_kv, d_head = model.graph.n_heads, model.graph.n_kv_heads, model.graph.d_head
    got: dict[tuple[str, int], torch.Tensor] = {}
    b, p = ids.shape

    def put(key):
        def hook(mod, args, out):
            got[key] = out
        return hook

    def put_out0(key):
        def hook(mod, args, out):
            got[key] = out[0]
        return hook

    def put_in(key):
        def pre(mod, args, kwargs):
            got[key] = _first_input(args, kwargs)
        return pre

    with _hooks() as add:
        for L, layer in enumerate(hf.model.layers):
            add(layer, put_in(("resid_pre", L)), pre=True)
            add(layer, put(("resid_post", L)))
            attn = layer.self_attn
            if arch == "olmo2":  # post-norm: a block adds its post-norms; the MLP reads resid_mid
                add(layer.post_attention_layernorm, put(("attn_out", L)))
                add(layer.mlp, put_in(("resid_mid", L)), pre=True)
                add(layer.post_feedforward_layernorm, put(("mlp_out", L)))
            elif arch in ("gemma2", "gemma3"):  # sandwich norms: a block adds its post-norms
                add(layer.post_attention_layernorm, put(("attn_out", L)))
                add(layer.pre_feedforward_layernorm, put_in(("resid_mid", L)), pre=True)
                add(layer.post_feedforward_layernorm, put(("mlp_out", L)))
                add(attn.o_proj, put(("o_proj_out", L)))
            elif arch == "deepseek_v4":
                add(attn, put_out0(("attn_out", L)))
                add(layer.ffn_hc, put_in(("resid_mid", L)), pre=True)
                add(layer.mlp, put(("mlp_out", L)))
            else:
                add(attn, put_out0(("attn_out", L)))
                add(layer.post_attention_layernorm, put_in(("resid_mid", L)), pre=True)
                add(layer.mlp, put_out0(("mlp_out", L)) if arch == "gpt_oss" else put(("mlp_out", L)))
            if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection, q | k | v
                add(attn.qkv_proj, put(("qkv_proj", L)))
                add(attn.o_proj, put_in(("o_proj_in", L)), pre=True)
            elif arch != "deepseek_v4":
                add(attn.q_proj, put(("q_proj", L)))
                add(attn.k_proj, put(("k_proj", L)))
                add(attn.v_proj, put(("v_proj", L)))
                add(attn.o_proj, put_in(("o_proj_in", L)), pre=True)
            if arch == "gpt_oss":  # biased router at mlp.router; the MoE returns (hidden, scores)
                add(layer.mlp.router, put_in(("gate_in", L)), pre=True)
                add(layer.mlp.router, put(("gate_out", L)))
            elif arch in _ROUTED:
                add(layer.mlp.gate, put_in(("gate_in", L)), pre=True)
                add(layer.mlp.gate, put(("gate_out", L)))
            elif hasattr(layer.mlp, "gate_up_proj"):  # Phi-3: gate | up fused
                add(layer.mlp.gate_up_proj, put(("gate_up_proj", L)))
            else:
                add(layer.mlp.gate_proj, put(("gate_proj", L)))
                add(layer.mlp.up_proj, put(("up_proj", L)))
        out = hf(input_ids=ids)

    ref: dict[tuple[str, int], torch.Tensor] = {}
    for L, layer in enumerate(hf.model.layers):
        for name in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"):
            ref[(name, L)] = got[(name, L)]
        if ("qkv_proj", L) in got:  # cut the fused output at the widths of the HF weights
            qkv = got[("qkv_proj", L)]
            q_w = layer.self_attn.o_proj.weight.shape[1]  # n_heads * d_head
            kv_w = (qkv.shape[-1] - q_w) // 2
            got[("q_proj", L)] = qkv[..., :q_w]
            got[("k_proj", L)] = qkv[..., q_w:q_w + kv_w]
            got[("v_proj", L)] = qkv[..., q_w + kv_w:]
        if ("gate_up_proj", L) in got:
            d_mlp = layer.mlp.down_proj.weight.shape[1]
            got[("gate_proj", L)] = got[("gate_up_proj", L)][..., :d_mlp]
            got[("up_proj", L)] = got[("gate_up_proj", L)][..., d_mlp:]
        if arch != "deepseek_v4":
            attn = layer.self_attn
            q = got[("q_proj", L)].view(b, p, n_heads, d_head)
            k = got[("k_proj", L)].view(b, p, n_kv, d_head)
            if arch == "olmo2":  # one RMSNorm over all heads together, before the head split
                q = attn.q_norm(got[("q_proj", L)]).view(b, p, n_heads, d_head)
                k = attn.k_norm(got[("k_proj", L)]).view(b, p, n_kv, d_head)
            elif hasattr(attn, "q_norm"):  # Qwen3, Gemma 3: per-head RMSNorm before rotary
                q, k = attn.q_norm(q), attn.k_norm(k)
            ref[("q", L)], ref[("k", L)] = q, k
            ref[("v", L)] = got[("v_proj", L)].view(b, p, n_kv, d_head)
            ref[("z", L)] = got[("o_proj_in", L)].view(b, p, n_heads, d_head)
            ref[("o_proj_out", L)] = got.get(("o_proj_out", L))
        if arch == "gpt_oss":
            # Recompute the router from its input: biased logits, top-k, softmax over those k.
            router = layer.mlp.router
            x = got[("gate_in", L)].reshape(-1, router.weight.shape[1])
            mine = F.linear(x, router.weight, router.bias)
            torch.testing.assert_close(mine, got[("gate_out", L)][0], rtol=1e-5, atol=1e-5)
            top_v, top_i = torch.topk(mine, router.top_k, dim=-1)
            ref[("router_logits", L)] = mine.reshape(b, p, -1)
            ref[("expert_indices", L)] = top_i.reshape(b, p, -1)
            ref[("expert_weights", L)] = torch.softmax(top_v, dim=-1).reshape(b, p, -1)
        elif arch in _ROUTED:
            gate = layer.mlp.gate
            logits, weights, indices = got[("gate_out", L)]
            ref[("router_logits", L)] = logits.reshape(b, p, -1)
            if arch in _SOFTMAX_TOPK:
                # Recompute the router from its input: softmax, top-k, renormalise.
                x = got[("gate_in", L)].reshape(-1, gate.weight.shape[1])
                mine = F.linear(x, gate.weight).reshape(b, p, -1)
                torch.testing.assert_close(mine, ref[("router_logits", L)], rtol=1e-5, atol=1e-5)
                probs = torch.softmax(mine.float(), dim=-1)
                top_w, top_i = torch.topk(probs, gate.top_k, dim=-1)
                if arch == "mixtral" or gate.norm_topk_prob:  # Mixtral always renormalises
                    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
                ref[("expert_indices", L)] = top_i
                ref[("expert_weights", L)] = top_w.to(mine.dtype)
            else:
                ref[("expert_indices", L)] = indices.reshape(b, p, -1)
                ref[("expert_weights", L)] = weights.reshape(b, p, -1)
                if getattr(layer.mlp, "is_hash", False):
                    # Hash routing: the selection is a fixed lookup of the token ids.
                    assert torch.equal(ref[("expert_indices", L)], gate.tid2eid[ids].long())
            ref[("resid_streams", L)] = got[("resid_post", L)]
        if arch not in _ROUTED and arch != "gpt_oss":
            act = getattr(layer.mlp, "act_fn", None) or layer.mlp.activation_fn
            ref[("mlp_pre", L)] = got[("gate_proj", L)]
            ref[("mlp_act", L)] = act(got[("gate_proj", L)]) * got[("up_proj", L)]
    ref["logits"] = out.logits  # type: ignore[index]
    return ref


def _reference_gpt2(hf, ids: torch.Tensor, n_heads: int) -> dict:
    """GPT-2 from its modules: the block is recomputed by hand from ln_1 / attn / ln_2 / mlp
    (LayerNorms with bias, Conv1D weights stored [in, out]) and checked against the block's
    own output; q/k/v are c_attn's output cut into thirds."""
    got: dict = {}
    b, p = ids.shape
    with _hooks() as add:
        for L, block in enumerate(hf.transformer.h):
            add(block, lambda m, a, k, L=L: got.__setitem__(("resid_pre", L), _first_input(a, k)), pre=True)
            add(block, lambda m, a, o, L=L: got.__setitem__(("block_out", L), o))
            add(block.attn.c_proj, lambda m, a, k, L=L: got.__setitem__(("z_in", L), _first_input(a, k)),
                pre=True)
        out = hf(input_ids=ids)
    ref: dict = {}
    for L, block in enumerate(hf.transformer.h):
        x = got[("resid_pre", L)]
        a_in = F.layer_norm(x, x.shape[-1:], block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
        qkv = a_in @ block.attn.c_attn.weight + block.attn.c_attn.bias  # Conv1D: x W + b
        d = qkv.shape[-1] // 3
        for i, name in enumerate(("q", "k", "v")):
            ref[(name, L)] = qkv[..., i * d:(i + 1) * d].reshape(b, p, n_heads, -1)
        z = got[("z_in", L)]
        ref[("z", L)] = z.reshape(b, p, n_heads, -1)
        attn = z @ block.attn.c_proj.weight + block.attn.c_proj.bias
        mid = x + attn
        m_in = F.layer_norm(mid, mid.shape[-1:], block.ln_2.weight, block.ln_2.bias, block.ln_2.eps)
        pre = m_in @ block.mlp.c_fc.weight + block.mlp.c_fc.bias
        act = block.mlp.act(pre)
        mlp = act @ block.mlp.c_proj.weight + block.mlp.c_proj.bias
        torch.testing.assert_close(mid + mlp, got[("block_out", L)], rtol=1e-5, atol=1e-5)
        ref.update({("resid_pre", L): x, ("attn_out", L): attn, ("resid_mid", L): mid,
                    ("mlp_pre", L): pre, ("mlp_act", L): act, ("mlp_out", L): mlp,
                    ("resid_post", L): got[("block_out", L)]})
    ref["logits"] = out.logits
    return ref


def _reference_gpt_neox(hf, ids: torch.Tensor, n_heads: int) -> dict:
    """GPT-NeoX's parallel block by hand: attention and the MLP both read resid_pre through
    their own LayerNorms; query_key_value is laid out per head as q | k | v."""
    got: dict = {}
    b, p = ids.shape
    with _hooks() as add:
        for L, block in enumerate(hf.gpt_neox.layers):
            add(block, lambda m, a, k, L=L: got.__setitem__(("resid_pre", L), _first_input(a, k)), pre=True)
            add(block, lambda m, a, o, L=L: got.__setitem__(("block_out", L), o))
            add(block.attention.dense, lambda m, a, k, L=L: got.__setitem__(("z_in", L), _first_input(a, k)),
                pre=True)
        out = hf(input_ids=ids)
    ref: dict = {}
    for L, block in enumerate(hf.gpt_neox.layers):
        x = got[("resid_pre", L)]
        ln1, ln2 = block.input_layernorm, block.post_attention_layernorm
        qkv_w = block.attention.query_key_value
        qkv = F.linear(F.layer_norm(x, x.shape[-1:], ln1.weight, ln1.bias, ln1.eps), qkv_w.weight, qkv_w.bias)
        per_head = qkv.reshape(b, p, n_heads, -1)  # [.., head, 3 * d_head]
        d = per_head.shape[-1] // 3
        for i, name in enumerate(("q", "k", "v")):
            ref[(name, L)] = per_head[..., i * d:(i + 1) * d]
        z = got[("z_in", L)]
        ref[("z", L)] = z.reshape(b, p, n_heads, -1)
        attn = F.linear(z, block.attention.dense.weight, block.attention.dense.bias)
        mlp_in = F.layer_norm(x, x.shape[-1:], ln2.weight, ln2.bias, ln2.eps)  # reads x, not x + attn
        pre = F.linear(mlp_in, block.mlp.dense_h_to_4h.weight, block.mlp.dense_h_to_4h.bias)
        act = block.mlp.act(pre)
        mlp = F.linear(act, block.mlp.dense_4h_to_h.weight, block.mlp.dense_4h_to_h.bias)
        torch.testing.assert_close(x + attn + mlp, got[("block_out", L)], rtol=1e-5, atol=1e-5)
        ref.update({("resid_pre", L): x, ("attn_out", L): attn, ("mlp_pre", L): pre,
                    ("mlp_act", L): act, ("mlp_out", L): mlp, ("resid_post", L): got[("block_out", L)]})
    ref["logits"] = out.logits
    return ref


@torch.no_grad()
def reference_outputs(hf_copy: nn.Module, ids: torch.Tensor, with_attentions: bool = True):
    """``(hidden_states, attentions)`` as HF itself reports them, from a separate HF copy:
    ``output_hidden_states`` / ``output_attentions`` leave transformers' recording hooks on a
    model for good, so they are never asked of the shared models."""
    out = hf_copy(input_ids=ids, output_hidden_states=True, output_attentions=with_attentions)
    return out.hidden_states, out.attentions


def add_at_output(module: nn.Module, delta_fn: Callable[[torch.Tensor], torch.Tensor], index=None):
    """A hand-written steering hook: ``out + delta_fn(out)`` at a module's output (element
    ``index`` of a tuple output)."""
    def hook(mod, args, out):
        if index is None:
            return out + delta_fn(out)
        items = list(out)
        items[index] = items[index] + delta_fn(items[index])
        return tuple(items)
    return module.register_forward_hook(hook)


def assert_resid_mid_add_is_a_hand_add(model, module: nn.Module, index=None, seed: int = 0,
                                        tol: dict | None = None) -> None:
    """Steering ``add`` at resid_mid.1 (scale 2) gives the logits of adding the same vector by
    hand at ``module``'s output (element ``index`` of a tuple), and differs from the plain run."""
    from interp_engine import SteerSpec, run_with_cache, steer

    tol = tol or {"rtol": 1e-5, "atol": 1e-5}
    ids = model.to_tokens(PROMPT)
    v = torch.randn(model.d_model, generator=torch.Generator().manual_seed(seed))
    with steer(model, SteerSpec.add("resid_mid.1", v, scale=2.0)):
        logits, _ = run_with_cache(model, ids, [], return_logits=True)
    handle = add_at_output(module, lambda out: 2.0 * v, index=index)
    try:
        with torch.no_grad():
            want = model.hf(ids).logits
    finally:
        handle.remove()
    torch.testing.assert_close(logits, want, **tol)
    plain, _ = run_with_cache(model, ids, [], return_logits=True)
    assert not torch.allclose(plain, want, atol=1e-3)
