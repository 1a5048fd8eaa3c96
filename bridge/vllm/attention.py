"""The attention pattern inside the vLLM worker: what vLLM's attention kernel computes, read off
the kernel's own layer, and a check that it is a computation the pattern can be rebuilt from.

vLLM's paged kernels never form the probability matrix. The runtime taps the inputs of each
layer's ``Attention`` module (queries and keys after rotary embedding, flat per token), keeps a
request's rows like any other capture, and when the request ends rebuilds the pattern with
``interp_engine._ops.attention_pattern`` from the parameters the kernel itself runs with: its
scale (Gemma's ``query_pre_attn_scalar`` included), its sliding window, its logit soft-cap and
its attention sinks. ``mismatches`` names, at start-up, each layer whose kernel does something
else (ALiBi, a KV cache shared with another layer, a quantised KV cache, a non-causal kernel), so
the client refuses ``pattern`` there before any forward.
"""

from __future__ import annotations

from typing import Any

import torch

from interp_engine._ops import attention_pattern

__all__ = ["kernel_args", "mismatches", "pattern_from_rows"]


def kernel_args(layer: Any) -> dict:
    """The softmax's parameters of vLLM's ``Attention`` module ``layer``."""
    impl = layer.impl
    softcap = getattr(impl, "logits_soft_cap", None)
    sinks = getattr(impl, "sinks", None)
    return {"scale": float(impl.scale), "window": layer.sliding_window or None,
            "softcap": float(softcap) if softcap else None,
            "sinks": None if sinks is None else sinks.detach().to("cpu", torch.float32)}


def _differences(layer: Any) -> list[str]:
    found = []
    impl = getattr(layer, "impl", None)
    if impl is None or not hasattr(impl, "scale"):
        return [f"its attention module ({type(layer).__name__}) is not vLLM's Attention layer"]
    if getattr(layer, "has_sink", False) and getattr(impl, "sinks", None) is None:
        found.append(f"its kernel ({type(impl).__name__}) applies attention sinks it does not expose")
    if getattr(impl, "alibi_slopes", None) is not None:
        found.append("the kernel adds ALiBi biases")
    kind = getattr(layer, "attn_type", "decoder")
    if getattr(kind, "value", kind) != "decoder":
        found.append(f"the kernel is not causal decoder attention ({layer.attn_type})")
    if getattr(layer, "kv_sharing_target_layer_name", None):
        found.append(f"it reads the keys of layer {layer.kv_sharing_target_layer_name}")
    if getattr(layer, "kv_cache_dtype", "auto") not in ("auto", None):
        found.append(f"the keys are stored quantised (kv_cache_dtype={layer.kv_cache_dtype!r})")
    return found


def mismatches(root: Any, spec: Any, layers: list[int]) -> dict[int, str]:
    """Layers whose attention kernel the pattern cannot be rebuilt for exactly, with why."""
    tap = spec.vllm.get("pattern")
    if tap is None:
        return {}
    out = {}
    for layer in layers:
        try:
            module = root.get_submodule(tap.module_path(layer))
        except AttributeError:
            out[layer] = f"vLLM's model has no attention module at {tap.module_path(layer)}"
            continue
        found = _differences(module)
        if found:
            out[layer] = "vLLM's attention kernel at this layer differs: " + "; ".join(found)
    return out


def pattern_from_rows(layer: Any, rows: torch.Tensor) -> torch.Tensor:
    """``[n_heads, pos, key_pos]`` from one request's rows of q | k (``[pos, (n_heads +
    n_kv_heads) * d_head]``, position ``i`` at row ``i``) as ``layer`` received them."""
    n_heads, n_kv, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    q = rows[:, : n_heads * d].reshape(-1, n_heads, d)
    k = rows[:, n_heads * d:].reshape(-1, n_kv, d)
    return attention_pattern(q, k, **kernel_args(layer))
