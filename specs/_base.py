"""The declarative spec format: how each point maps to one architecture's modules on each engine.

A spec is pure data. The bridge reads it to place hooks; the core reads it to build the graph.
Module paths are templates with ``{L}`` for the layer index, relative to the engine's root
module (the HF ``*ForCausalLM`` on eager; the vLLM ``*ForCausalLM`` inside the worker on vLLM).

``how`` says which tensor of the module call is the point:
  ``in``   the first input (``hidden_states``)        ``out``  the output (a tensor)
  ``out0`` / ``out1`` / ``out2``: that element of a tuple output
``split`` (optional) takes one part of a fused output before ``post``: ``Split(parts, index)``
names each part's width as a product of graph dims (``("n_heads", "d_head")``), so a fused
``qkv_proj`` or ``gate_up_proj`` serves q/k/v or mlp_pre with no special case.
``post`` says how to reshape the raw tensor into the point's shape:
  ``None``  already ``[batch, pos, ...]``             ``heads``/``kv_heads``: split the last dim
  ``flat``  rows are flattened tokens: view as ``[batch, pos, -1]``
  ``heads_first``  already ``[batch, heads, pos, d_head]``: move heads after positions

Each spec also carries its registry data: the HF architecture classes it serves and its tiny
test-model recipes (``TinyRecipe``); ``specs/__init__`` finds every spec file by itself, and the
tiny-model factory, the test parametrisation and the CLI read their lists from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from interp_engine._graph import FinalNorm, ModelGraph, ResidualBasis
from interp_engine._points import POINTS, PointSpec, Split

__all__ = ["ArchSpec", "Routing", "Split", "Tap", "TinyRecipe", "VllmTap", "build_graph", "transformers_backend_taps"]


@dataclass(frozen=True)
class Tap:
    path: str
    how: str = "out"
    post: str | None = None
    split: Split | None = None

    def module_path(self, layer: int) -> str:
        return self.path.format(L=layer)


@dataclass(frozen=True)
class VllmTap:
    """Where a point lives inside vLLM's fused decoder layers, which return ``(h, r)`` with
    ``resid_post = h + r`` (``r`` is resid_mid, ``h`` is mlp_out) and take
    ``(positions, hidden, residual)`` (or ``(hidden, positions, residual)``: the spec's
    ``vllm_layer_hidden_arg``) with ``resid_pre = hidden + residual`` (``residual`` is None at
    layer 0, where ``hidden`` is the embeddings).

    ``source``: ``layer_in`` (resid_pre), ``layer_sum`` (h + r), ``layer_r``, ``layer_h``,
    ``module_out`` / ``module_in`` (output / first input of ``path``), ``fused_in_sum``
    (``x + residual`` at a fused add+norm ``path`` called as ``norm(x, residual)``),
    ``route_weights`` / ``route_indices`` (the selection recomputed from the router logits that
    ``path`` outputs, with the spec's ``routing`` rule: vLLM never returns its own).
    ``heads_out`` (the ``[tokens, heads, d_head]`` output of a per-head module such as Qwen3's
    ``q_norm``, one row per token).
    ``attn_qk`` (read only: ``pattern``): the query and key inputs of vLLM's ``Attention``
    module at ``path`` (after rotary embedding), kept per request; the worker rebuilds the
    probabilities from them with the kernel's own scale, window, soft-cap and sinks.
    Rows are flat tokens; ``split`` takes one part of a fused output (q of ``qkv_proj``, the
    gate of ``gate_up_proj``) in the worker, before the rows leave it (a write edits only the
    part's columns of the fused output);
    ``post`` ``heads`` splits the last dim into heads.
    """

    source: str
    path: str | None = None
    post: str | None = None
    sharded: bool = False  # under tensor parallelism each rank holds its heads' slice (concatenated)
    split: Split | None = None

    def module_path(self, layer: int) -> str | None:
        return None if self.path is None else self.path.format(L=layer)


@dataclass(frozen=True)
class Routing:
    """How an MoE architecture turns its router logits into the experts it runs: the top-k
    logits, then the softmax over those k (``renormalize``) or each one's share of the softmax
    over all experts, which is the rule vLLM's fused MoE applies (``interp_engine._ops.route``).
    ``renormalize`` is a bool, or the name of the HF config flag that decides it
    (``norm_topk_prob``). Declared only where the model's own router is exactly this rule (a
    biased router included: the bias is inside the logits vLLM reports); the vLLM runtime then
    serves expert_weights / expert_indices, and checks at start-up that vLLM's router agrees."""

    renormalize: bool | str = True

    def renormalizes(self, config: object) -> bool:
        if isinstance(self.renormalize, bool):
            return self.renormalize
        return bool(getattr(config, self.renormalize))


@dataclass(frozen=True)
class TinyRecipe:
    """How ``interp_engine.testing`` builds one small random checkpoint of this architecture.

    ``config`` is passed to ``transformers.<config_class>`` (tuples become lists);
    ``norm_offsets`` are added to the parameters whose names end with their keys, after the
    constant tensors are jittered; ``embedding_scale`` multiplies the input embedding; the
    tokenizer prepends ``<bos>`` when ``adds_bos``. Any change here changes the directory hash."""

    config_class: str
    seed: int
    config: Mapping[str, object]
    adds_bos: bool = False
    norm_offsets: Mapping[str, float] = field(default_factory=dict)
    embedding_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))
        object.__setattr__(self, "norm_offsets", MappingProxyType(dict(self.norm_offsets)))


@dataclass(frozen=True)
class ArchSpec:
    arch: str
    model_types: tuple[str, ...]
    graph_from_config: Callable[[object], ModelGraph]
    eager: Mapping[str, Tap]
    # The transformers ``*ForCausalLM`` class names this spec serves (config.architectures).
    hf_classes: tuple[str, ...] = ()
    # variant ("tiny", "bench", ...) -> recipe of a small random checkpoint for tests/benchmarks.
    tiny: Mapping[str, TinyRecipe] = field(default_factory=lambda: MappingProxyType({}))
    final_norm_path: str = "model.norm"
    # The final norm's kind ("rms" or "layer" for LayerNorm); its epsilon is read from the config.
    final_norm_kind: str = "rms"
    unembed_path: str = "lm_head"
    # The HF ``*ForCausalLM``'s base-model attribute, under which the eager taps live
    # (``model`` for most, ``transformer`` for GPT-2, ``gpt_neox`` for GPT-NeoX).
    hf_base: str = "model"
    # vLLM: where each point is read, and where each steerable point is written (writes
    # default to the read tap; resid_mid is written at the fused add+norm after attention).
    # Left empty (and no ``vllm_note`` refusal), vLLM runs the architecture through its
    # Transformers backend and the map is derived from the eager one (see __post_init__).
    vllm: Mapping[str, VllmTap] = field(default_factory=lambda: MappingProxyType({}))
    vllm_writes: Mapping[str, VllmTap] = field(default_factory=lambda: MappingProxyType({}))
    # Where hidden_states sits in a call of vLLM's decoder layer: Llama-family layers are called
    # as (positions, hidden_states, residual), GPT-OSS's as (hidden_states, positions, residual).
    vllm_layer_hidden_arg: int = 1
    # MoE: the routing rule that recomputes the selection from router_logits on vLLM (None: the
    # selection is eager-only; vLLM refuses expert_weights / expert_indices).
    routing: Routing | None = None
    vllm_final_norm_path: str = "model.norm"
    vllm_unembed_path: str = "lm_head"
    # With an empty ``vllm`` map: why vLLM cannot run this architecture at all (its refusal).
    vllm_note: str = ""
    # Points eager serves that vLLM's model of this architecture cannot give exactly: point ->
    # why (named in the refusal, with the point's capability).
    vllm_refused: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # With the Transformers backend (the default door): taps replacing the derived ones where
    # vLLM's own fusers rewrite the HF modules (q_proj/k_proj/v_proj into one qkv_proj,
    # gate_proj/up_proj into one gate_up_proj); None drops a point.
    vllm_fused: Mapping[str, VllmTap | None] = field(default_factory=lambda: MappingProxyType({}))
    # vLLM's ``model_impl`` for this architecture: "" (vLLM's native model) or "transformers"
    # (vLLM's Transformers backend, which runs the HF modules inside vLLM); set by the default door.
    vllm_model_impl: str = ""
    # Why this architecture must run the eager attention kernel on the eager backend (a feature
    # the fast SDPA kernel lacks), or "" when the fast default is exact.
    eager_attention_only: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "vllm_refused", MappingProxyType(dict(self.vllm_refused)))
        object.__setattr__(self, "vllm_fused", MappingProxyType(dict(self.vllm_fused)))
        if self.vllm_fused and self.vllm and self.vllm_model_impl != "transformers":  # (a copy keeps its own)
            raise ValueError(f"{self.arch}: vllm_fused amends the map derived for vLLM's Transformers "
                             "backend; a spec with its own vllm map writes its taps there")
        routed = [n for n, t in self.vllm.items() if t.source in ("route_weights", "route_indices")]
        if routed and self.routing is None:
            raise ValueError(f"{self.arch}: vLLM taps {routed} recompute the routing, so the spec must "
                             "declare its rule (routing=Routing(...))")
        for name, tap in self.eager.items():
            if tap.split is not None and POINTS[name].writable:
                raise ValueError(f"{self.arch}: point {name!r} is writable, so its tap cannot read "
                                 "one part of a fused output (a write would have nowhere to go)")
        if not self.vllm and not self.vllm_note:
            # The default door: no native vLLM map, so vLLM runs the HF modules themselves
            # through its Transformers backend, under its own root ``model``.
            object.__setattr__(self, "vllm", merged(transformers_backend_taps(self.eager, self.hf_base),
                                                    **self.vllm_fused))
            object.__setattr__(self, "vllm_model_impl", "transformers")
            object.__setattr__(self, "vllm_final_norm_path", _rebase(self.final_norm_path, self.hf_base))
            object.__setattr__(self, "vllm_writes", MappingProxyType({}))

    @property
    def vllm_served(self) -> bool:
        """Whether vLLM runs this architecture (its vLLM map is not empty)."""
        return bool(self.vllm)

    def point_table(self, graph_dims: Mapping[str, tuple[str, ...]] | None = None) -> tuple[PointSpec, ...]:
        dims = graph_dims or {}
        table = []
        for name, point in POINTS.items():
            if name not in self.eager:
                continue
            on_vllm = point.vllm and name in self.vllm
            table.append(point.with_backends(
                vllm=on_vllm, vllm_static=point.vllm_static and on_vllm,
                dims=dims.get(name, point.dims),
                writable=point.writable and name not in dims,
            ))
        return tuple(table)


def _get(config: object, *names: str, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _final_norm(spec: ArchSpec, config: object) -> FinalNorm | None:
    eps = _get(config, "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps")
    return None if eps is None else FinalNorm(spec.final_norm_kind, float(eps))


def build_graph(spec: ArchSpec, config: object, *, moe_layers: tuple[int, ...] = (),
                n_experts: int = 0, top_k: int = 0, d_mlp: int | None = None,
                basis: ResidualBasis | None = None,
                graph_dims: Mapping[str, tuple[str, ...]] | None = None) -> ModelGraph:
    """The common part of every ``graph_from_config``: read the usual HF config fields."""
    n_heads = int(config.num_attention_heads)
    d_model = int(config.hidden_size)
    d_head = int(_get(config, "head_dim", default=d_model // n_heads))
    graph = ModelGraph(
        arch=spec.arch,
        n_layers=int(config.num_hidden_layers),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(_get(config, "num_key_value_heads", default=n_heads)),
        d_head=d_head,
        d_vocab=int(config.vocab_size),
        d_mlp=d_mlp,
        n_experts=n_experts,
        top_k=top_k,
        moe_layers=moe_layers,
        residual_basis=basis or ResidualBasis(1, True, True),
        final_logit_softcap=_get(config, "final_logit_softcapping"),
        final_norm=_final_norm(spec, config),
    )
    return graph.with_points(spec.point_table(graph_dims))


# The shape every tiny recipe starts from: 3 layers, hidden 128, 4 query heads and 2 KV heads of
# 32 (vLLM's CPU attention needs head_dim >= 32), the 512-token test tokenizer, float32.
TINY_SHAPE = MappingProxyType({
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
})

# Parts of fused projections, as widths in graph dims (in the order the model lays them out).
QKV_PARTS = (("n_heads", "d_head"), ("n_kv_heads", "d_head"), ("n_kv_heads", "d_head"))
GATE_UP_PARTS = (("d_mlp",), ("d_mlp",))

# Taps shared by the Llama-family layouts (pre-norm, attention then MLP, one residual stream).
LAYER = "model.layers.{L}"
COMMON_EAGER = MappingProxyType({
    "resid_pre": Tap(LAYER, "in"),
    "resid_mid": Tap(LAYER + ".post_attention_layernorm", "in"),
    "resid_post": Tap(LAYER, "out"),
    "attn_out": Tap(LAYER + ".self_attn", "out0"),
    "mlp_out": Tap(LAYER + ".mlp", "out"),
    "q": Tap(LAYER + ".self_attn.q_proj", "out", "heads"),
    "k": Tap(LAYER + ".self_attn.k_proj", "out", "kv_heads"),
    "v": Tap(LAYER + ".self_attn.v_proj", "out", "kv_heads"),
    "z": Tap(LAYER + ".self_attn.o_proj", "in", "heads"),
    "pattern": Tap(LAYER + ".self_attn", "out1"),
    "mlp_pre": Tap(LAYER + ".mlp.gate_proj", "out"),
    "mlp_act": Tap(LAYER + ".mlp.down_proj", "in"),
})

# vLLM's fused (h, r) layout: resid_post = h + r, resid_mid = r, mlp_out = h.
COMMON_VLLM = MappingProxyType({
    "resid_pre": VllmTap("layer_in", LAYER),
    "resid_mid": VllmTap("layer_r", LAYER),
    "resid_post": VllmTap("layer_sum", LAYER),
    "attn_out": VllmTap("module_out", LAYER + ".self_attn"),
    "mlp_out": VllmTap("layer_h", LAYER),
    "z": VllmTap("module_in", LAYER + ".self_attn.o_proj", "heads", sharded=True),
    # vLLM fuses q | k | v into qkv_proj (its output is before rotary embedding, as eager's
    # q_proj / k_proj / v_proj outputs are) and gate | up into gate_up_proj: the worker takes
    # the part. Its fused act-and-mul feeds down_proj the same act(gate) * up that eager reads
    # there (mlp_act).
    "q": VllmTap("module_out", LAYER + ".self_attn.qkv_proj", "heads", split=Split(QKV_PARTS, 0)),
    "k": VllmTap("module_out", LAYER + ".self_attn.qkv_proj", "kv_heads", split=Split(QKV_PARTS, 1)),
    "v": VllmTap("module_out", LAYER + ".self_attn.qkv_proj", "kv_heads", split=Split(QKV_PARTS, 2)),
    "mlp_pre": VllmTap("module_out", LAYER + ".mlp.gate_up_proj", split=Split(GATE_UP_PARTS, 0)),
    "mlp_act": VllmTap("module_in", LAYER + ".mlp.down_proj", sharded=True),
    # vLLM's attention kernel module, called with q and k after rotary embedding
    "pattern": VllmTap("attn_qk", LAYER + ".self_attn.attn"),
})
# Architectures with per-head q/k norms (Qwen3, Gemma 3): vLLM applies them to
# [tokens, heads, d_head] views of qkv_proj's parts before rotary embedding, as eager does.
QK_NORM_VLLM = MappingProxyType({
    "q": VllmTap("heads_out", LAYER + ".self_attn.q_norm", "heads"),
    "k": VllmTap("heads_out", LAYER + ".self_attn.k_norm", "kv_heads"),
})
# resid_mid is written where attention's output meets the residual: norm(attn_out, resid_pre).
COMMON_VLLM_WRITES = MappingProxyType({
    "resid_mid": VllmTap("fused_in_sum", LAYER + ".post_attention_layernorm"),
})

# Gemma's sandwich norms: each sublayer's output is normed before it joins the residual, so
# attn_out and mlp_out are read after the post-sublayer norms, and resid_mid before the
# pre-feedforward norm. On vLLM, attention's output meets the residual at that fused norm.
SANDWICH_EAGER = MappingProxyType({
    "attn_out": Tap(LAYER + ".post_attention_layernorm", "out"),
    "resid_mid": Tap(LAYER + ".pre_feedforward_layernorm", "in"),
    "mlp_out": Tap(LAYER + ".post_feedforward_layernorm", "out"),
})
SANDWICH_VLLM = MappingProxyType({
    "attn_out": VllmTap("module_out", LAYER + ".post_attention_layernorm"),
})
SANDWICH_VLLM_WRITES = MappingProxyType({
    "resid_mid": VllmTap("fused_in_sum", LAYER + ".pre_feedforward_layernorm"),
})


def merged(base: Mapping, **changes) -> Mapping:
    out = dict(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return MappingProxyType(out)


_TRANSFORMERS_SOURCES = {"in": "module_in", "out": "module_out", "out0": "module_out"}
_TRANSFORMERS_ROOT = "model"  # where vLLM's Transformers backend keeps the HF base model
_TRANSFORMERS_ATTN = "attn"  # the attribute of each HF attention module holding vLLM's Attention


def _rebase(path: str, hf_base: str) -> str:
    if not path.startswith(hf_base + "."):
        raise ValueError(f"eager path {path!r} is not under the HF base model {hf_base!r}")
    return _TRANSFORMERS_ROOT + path[len(hf_base):]


def transformers_backend_taps(eager: Mapping[str, Tap], hf_base: str) -> Mapping[str, VllmTap]:
    """The vLLM map of an architecture that vLLM runs through its Transformers backend
    (``model_impl="transformers"``): the same HF modules, under the backend's ``model`` instead
    of the HF ``*ForCausalLM``'s ``hf_base``, read at their inputs and outputs. Derived from the
    eager map for every point vLLM can serve; fused-split taps stay eager-only. A write at a
    module input edits the tensor in place on vLLM, so a block that keeps that tensor as its
    residual (``residual = h; h = mlp(h)``) sees it on both paths, as eager's resid_mid does.
    A part of a fused output (GPT-NeoX's query_key_value) is taken in the worker, as eager does.
    Where vLLM's fusers merge HF projections, the spec's ``vllm_fused`` replaces these taps.
    ``pattern`` is read at the ``Attention`` module the backend attaches to each HF attention
    module (``.attn``), which its attention function calls with q and k after rotary."""
    out = {}
    for name, tap in eager.items():
        point = POINTS[name]
        if name == "pattern" and point.vllm:  # the backend's Attention module, set on the HF one
            out[name] = VllmTap("attn_qk", _rebase(tap.path, hf_base) + "." + _TRANSFORMERS_ATTN)
            continue
        if not point.vllm or tap.how not in _TRANSFORMERS_SOURCES:
            continue
        out[name] = VllmTap(_TRANSFORMERS_SOURCES[tap.how], _rebase(tap.path, hf_base), tap.post,
                            sharded=name == "z", split=tap.split)
    return MappingProxyType(out)
