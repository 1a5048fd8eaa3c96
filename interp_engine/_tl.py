"""TransformerLens hook names as a way in: ``from_tl("blocks.3.hook_resid_post")`` is
``Address("resid_post", 3)``. One table (``TL_HOOKS``) says, for every TransformerLens hook,
the point it is, or why there is none; docs/transformerlens.md prints it.

Only names are mapped: TransformerLens' own weight conventions (folded LayerNorms, centred
unembeddings) are not applied, so a value matches TransformerLens' only for a model loaded
without those processing steps (``HookedTransformer.from_pretrained_no_processing``)."""

from __future__ import annotations

import re
from types import MappingProxyType

from ._address import Address

__all__ = ["TL_HOOKS", "from_tl"]

_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.(.+)$")

# TransformerLens hook (within ``blocks.{L}.`` unless it starts with "hook_embed" etc.) ->
# our point name, or "" and the reason there is none.
TL_HOOKS = MappingProxyType({
    "hook_resid_pre": ("resid_pre", ""),
    "hook_resid_mid": ("resid_mid", "refused on parallel-block models, where it has no meaning"),
    "hook_resid_post": ("resid_post", ""),
    "hook_attn_out": ("attn_out", ""),
    "hook_mlp_out": ("mlp_out", ""),
    "attn.hook_q": ("q", "before rotary embedding, after any per-head q norm"),
    "attn.hook_k": ("k", "one per KV head on grouped-query models, as TransformerLens' GQA"),
    "attn.hook_v": ("v", "one per KV head on grouped-query models"),
    "attn.hook_z": ("z", ""),
    "attn.hook_pattern": ("pattern", ""),
    "mlp.hook_pre": ("mlp_pre", "the gate pre-activation on gated MLPs"),
    "mlp.hook_post": ("mlp_act", "act(gate) * up on gated MLPs"),
    # no counterpart
    "attn.hook_attn_scores": ("", "pre-softmax scores are not a point; pattern holds the "
                                  "probabilities (the eager kernel never keeps the scores)"),
    "attn.hook_rot_q": ("", "after rotary embedding: q is served before it"),
    "attn.hook_rot_k": ("", "after rotary embedding: k is served before it"),
    "attn.hook_result": ("", "per-head outputs are computed from a cache, not captured: "
                             "head_contributions(model, cache, L) with z.L"),
    "mlp.hook_pre_linear": ("", "the up projection of a gated MLP is not a point"),
    "hook_attn_in": ("", "a per-head copy of resid_pre that feeds only attention; writing it "
                         "differs from writing resid_pre, so it is not aliased"),
    "hook_q_input": ("", "a copy of resid_pre that feeds only the queries"),
    "hook_k_input": ("", "a copy of resid_pre that feeds only the keys"),
    "hook_v_input": ("", "a copy of resid_pre that feeds only the values"),
    "hook_mlp_in": ("", "a copy of resid_mid that feeds only the MLP; writing it differs from "
                        "writing resid_mid, so it is not aliased"),
    "ln1.hook_scale": ("", "norm internals are not points"),
    "ln1.hook_normalized": ("", "norm internals are not points"),
    "ln2.hook_scale": ("", "norm internals are not points"),
    "ln2.hook_normalized": ("", "norm internals are not points"),
})

# Hooks outside the blocks.
TL_MODEL_HOOKS = MappingProxyType({
    "hook_embed": "token embeddings alone are not a point: resid_pre.0 is what layer 0 reads "
                  "(token + position embeddings on GPT-2)",
    "hook_pos_embed": "position embeddings alone are not a point: resid_pre.0 includes them",
    "hook_tokens": "token ids are the input, not an activation",
    "ln_final.hook_scale": "the final norm is applied by the lens (decode_residuals), not captured",
    "ln_final.hook_normalized": "the final norm is applied by the lens (decode_residuals), not captured",
    "unembed.hook_out": "logits come from run_with_cache(..., return_logits=True)",
})


def from_tl(name: str) -> Address:
    """The Address of a TransformerLens hook name (``"blocks.3.attn.hook_z"`` -> ``z.3``).
    Raises ValueError naming the reason when the hook has no counterpart."""
    if not isinstance(name, str):
        raise TypeError(f"from_tl takes a TransformerLens hook name (str), got {name!r}")
    if name in TL_MODEL_HOOKS:
        raise ValueError(f"TransformerLens hook {name!r} has no interp_engine point: {TL_MODEL_HOOKS[name]}")
    match = _BLOCK_RE.match(name)
    if match is None or match.group(2) not in TL_HOOKS:
        known = ", ".join(f"blocks.L.{h}" for h, (p, _) in TL_HOOKS.items() if p)
        raise ValueError(f"unknown TransformerLens hook name {name!r}; hooks with a counterpart: {known}")
    layer, hook = match.groups()
    point, why = TL_HOOKS[hook]
    if not point:
        raise ValueError(f"TransformerLens hook {name!r} has no interp_engine point: {why}")
    return Address(point, int(layer))
