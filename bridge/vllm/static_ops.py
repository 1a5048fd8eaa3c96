"""The two custom ops vllm-static compiles into vLLM's decoder layers.

Each is a torch.library op whose schema marks what it mutates (``Tensor(a!)``): only persistent
tensors the runtime owns (and, for a steering site, the activation it steers), with a fake
implementation, so Dynamo and inductor keep it as one opaque node inside the compiled graph (no
graph break) and a CUDA graph replays it. They are defined with ``torch.library.Library`` and
one implementation for every device rather than with ``torch.library.custom_op``: the compiled
graph calls them on every step, even with no plan in flight, and ``custom_op``'s Python wrapper
(argument binding, autograd dispatch) cost about 4x as much per call as the op itself on CPU.
What varies per step is data in those tensors, filled by the runtime outside the graph before
each forward (``bridge.vllm.static_taps``); editing them never recompiles.

``tap``: copy rows into a capture buffer. ``rows[:count[0]]`` lists the rows of ``x`` that some
request captures, in order; they land in ``buf[:count]``. Padding rows are never listed, so they
write nowhere. On CUDA (where a replayed graph cannot read ``count`` on the host) every row ``r``
is copied to ``buf[dest[r]]`` instead, and rows nobody captures point at the buffer's last row, a
sink the runtime never reads. The runtime keeps ``count`` on the host too, so nothing reads it
back after the forward (no device-to-host sync per tap). ``y`` (optional) is added first:
vLLM's fused layers carry a point as a sum (``resid_post = h + r``). The copy happens inside the
op, so a later in-place kernel (CUDA's fused add+RMSNorm) cannot change a captured value.

``steer``: write rows of ``x`` in place from a bank of per-slot vectors. Row ``rows[i]`` takes
slot ``slots[i]`` (``count`` holds how many rows, and whether every one of them only adds); its
new value is ``s * x + v - (1 - s) * base - p * ((x + base) . u) u`` with
``v = vec[slot]``, ``u = dir[slot]``, ``(s, p) = coef[slot]``: add is ``(1, 0)``, set is
``(0, 0)``, ablate is ``(1, 1)`` with ``v = 0`` (``base`` is what the tensor is offset from the
point by, or zero); zero is ``(0, 0)`` and scale ``(factor, 0)`` with ``v = 0``, mean and patch
are set (``interp_engine._ops.AFFINE``). On CUDA every row is rewritten from ``slot_of[r]``;
slot 0 is the identity (``(1, 0)``, zero vectors), which rows nobody steers point at. With
``coef`` exactly 0/1 add and set round exactly as the eager math does.
"""

from __future__ import annotations

import torch

__all__ = ["NAMESPACE", "steer", "steer_fixed", "steer_rows", "tap", "tap_fixed", "tap_rows"]

NAMESPACE = "interp_engine"

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # kept alive for the process's lifetime
_LIB.define("tap(Tensor x, Tensor? y, Tensor(a!) buf, Tensor rows, Tensor count, Tensor dest) -> ()")
_LIB.define("steer(Tensor(a!) x, Tensor? base, Tensor vec, Tensor direction, Tensor coef, Tensor rows, "
            "Tensor slots, Tensor count, Tensor slot_of) -> ()")


def tap(x: torch.Tensor, y: torch.Tensor | None, buf: torch.Tensor, rows: torch.Tensor,
        count: torch.Tensor, dest: torch.Tensor) -> None:
    if x.is_cuda:
        tap_fixed(x, y, buf, dest)
    else:
        tap_rows(x, y, buf, rows, count)


def tap_fixed(x: torch.Tensor, y: torch.Tensor | None, buf: torch.Tensor, dest: torch.Tensor) -> None:
    """Every row to ``buf[dest[r]]`` (the sink row for rows nobody captures): fixed shapes, no
    host read, so a CUDA graph can replay it."""
    buf.index_copy_(0, dest[:x.shape[0]], x if y is None else x + y)


def tap_rows(x: torch.Tensor, y: torch.Tensor | None, buf: torch.Tensor, rows: torch.Tensor,
             count: torch.Tensor) -> None:
    """Rows ``rows[:count[0]]`` to ``buf[:count[0]]`` (``count`` lives on the CPU here: no device
    sync); ``count[1]`` is 1 when those rows are ``0 .. count[0] - 1``: one slice, copied (or
    summed) in one pass, the same values as the gather."""
    k, prefix = count.tolist()
    if k == 0:
        return
    out = buf[:k]
    if prefix:
        if k == x.shape[0]:  # every row of the forward (a prompt alone, or a batch capturing all)
            # no slices of x and y: 3.7 us a call against 5.3 in a tight loop (16 rows of 512)
            if y is None:
                out.copy_(x)
            else:
                torch.add(x, y, out=out)
        elif y is None:
            out.copy_(x[:k])
        else:
            torch.add(x[:k], y[:k], out=out)
        return
    index = rows[:k]
    torch.index_select(x, 0, index, out=out)  # the copy happens here, into the op's own buffer
    if y is not None:
        out.add_(y.index_select(0, index))


def steer(x: torch.Tensor, base: torch.Tensor | None, vec: torch.Tensor, direction: torch.Tensor,
          coef: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, count: torch.Tensor,
          slot_of: torch.Tensor) -> None:
    if x.is_cuda:
        steer_fixed(x, base, vec, direction, coef, slot_of)
    else:
        steer_rows(x, base, vec, direction, coef, rows, slots, count)


def steer_fixed(x, base, vec, direction, coef, slot_of) -> None:
    """Every row from its slot (0: the identity): fixed shapes, no host read (CUDA graphs)."""
    x.copy_(_rewrite(x, base, vec, direction, coef, slot_of[:x.shape[0]], None))


def steer_rows(x, base, vec, direction, coef, rows, slots, count) -> None:
    """Rows ``rows[:count[0]]`` from slots ``slots[:count[0]]``. ``count[1]`` is 1 when every
    listed slot adds (``(s, p) = (1, 0)``): then the rows take ``x + v`` in one ``index_add_``,
    the same sum the general rewrite computes (``1 * x + v - 0 * base - 0 * ...``) bit for bit,
    at a tenth of its small-op calls (the usual steering request, run on every step); 2 when
    they are also one span, ``count[2]`` on, all from slot ``count[3]``: a slice add; 3 when they
    are one span from ``count[2]`` with slots of their own (requests in a batch, each adding its
    vector): the slots' vectors gathered and added to that slice in one add (``index_add_`` on a
    CPU tensor adds row by row)."""
    k, add, start, slot = count.tolist()
    if k == 0:
        return
    if add == 2:  # one span of rows, one slot (a request adding one vector): a slice add
        x.narrow(0, start, k).add_(vec[slot])
        return
    if add == 3:  # one span of rows, a slot per row
        x.narrow(0, start, k).add_(vec.index_select(0, slots[:k]))
        return
    index = rows[:k]
    if add:
        x.index_add_(0, index, vec.index_select(0, slots[:k]))
        return
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


def _tap_fake(x, y, buf, rows, count, dest) -> None:
    return None


def _steer_fake(x, base, vec, direction, coef, rows, slots, count, slot_of) -> None:
    return None


_LIB.impl("tap", tap, "CompositeExplicitAutograd")
_LIB.impl("steer", steer, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::tap", _tap_fake, lib=_LIB)
torch.library.register_fake(f"{NAMESPACE}::steer", _steer_fake, lib=_LIB)
