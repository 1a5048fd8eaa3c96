"""The two custom ops vllm-static compiles into vLLM's decoder layers.

Each is a ``torch.library.custom_op`` that mutates only persistent tensors the runtime owns (and,
for a steering site, the activation it steers), with a fake implementation, so Dynamo and
inductor keep it as one opaque node inside the compiled graph (no graph break) and a CUDA graph
replays it. What varies per step is data in those tensors, filled by the runtime outside the
graph before each forward (``bridge.vllm.static_taps``); editing them never recompiles.

``tap``: copy rows into a capture buffer. ``rows[:count[0]]`` lists the rows of ``x`` that some
request captures, in order; they land in ``buf[:count]``. Padding rows are never listed, so they
write nowhere. On CUDA (where a replayed graph cannot read ``count`` on the host) every row ``r``
is copied to ``buf[dest[r]]`` instead, and rows nobody captures point at the buffer's last row, a
sink the runtime never reads. ``y`` (optional) is added first: vLLM's fused layers carry a point as a sum
(``resid_post = h + r``). The copy happens inside the op, so a later in-place kernel (CUDA's
fused add+RMSNorm) cannot change a captured value.

``steer``: write rows of ``x`` in place from a bank of per-slot vectors. Row ``rows[i]`` takes
slot ``slots[i]``; its new value is ``s * x + v - (1 - s) * base - p * ((x + base) . u) u`` with
``v = vec[slot]``, ``u = dir[slot]``, ``(s, p) = coef[slot]``: add is ``(1, 0)``, set is
``(0, 0)``, ablate is ``(1, 1)`` with ``v = 0`` (``base`` is what the tensor is offset from the
point by, or zero); zero is ``(0, 0)`` and scale ``(factor, 0)`` with ``v = 0``, mean and patch
are set (``interp_engine._ops.AFFINE``). On CUDA every row is rewritten from ``slot_of[r]``; slot 0 is the identity
(``(1, 0)``, zero vectors), which rows nobody steers point at. With ``coef`` exactly 0/1 add and set round exactly as the eager math does.
"""

from __future__ import annotations

import torch

__all__ = ["NAMESPACE", "steer", "tap"]

NAMESPACE = "interp_engine"


@torch.library.custom_op(f"{NAMESPACE}::tap", mutates_args=("buf",))
def tap(x: torch.Tensor, y: torch.Tensor | None, buf: torch.Tensor, rows: torch.Tensor,
        count: torch.Tensor, dest: torch.Tensor) -> None:
    if x.is_cuda:  # fixed shapes, no host read: safe inside a CUDA graph
        n = x.shape[0]
        buf.index_copy_(0, dest[:n], x if y is None else x + y)
        return
    k = int(count[0])
    if k == 0:
        return
    index = rows[:k]
    value = x.index_select(0, index)
    if y is not None:
        value = value + y.index_select(0, index)
    buf[:k].copy_(value)


@tap.register_fake
def _tap_fake(x, y, buf, rows, count, dest) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::steer", mutates_args=("x",))
def steer(x: torch.Tensor, base: torch.Tensor | None, vec: torch.Tensor, direction: torch.Tensor,
          coef: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, count: torch.Tensor,
          slot_of: torch.Tensor) -> None:
    if x.is_cuda:  # every row, from its slot (0: identity): no host read inside a CUDA graph
        n = x.shape[0]
        x.copy_(_rewrite(x, base, vec, direction, coef, slot_of[:n], None))
        return
    k = int(count[0])
    if k == 0:
        return
    index = rows[:k]
    x.index_copy_(0, index, _rewrite(x, base, vec, direction, coef, slots[:k], index))


def _rewrite(x, base, vec, direction, coef, slot, index):
    """The new values of rows ``index`` of ``x`` (all rows when None), row i from ``slot[i]``."""
    region = x if index is None else x.index_select(0, index)
    c = coef.index_select(0, slot)
    s, p = c[:, 0:1], c[:, 1:2]
    new = s * region + vec.index_select(0, slot)
    full = region
    if base is not None:
        b = base if index is None else base.index_select(0, index)
        new = new - (1 - s) * b
        full = region + b
    u = direction.index_select(0, slot)
    new = new - p * (full * u).sum(-1, keepdim=True) * u
    return new.to(x.dtype)


@steer.register_fake
def _steer_fake(x, base, vec, direction, coef, rows, slots, count, slot_of) -> None:
    return None
