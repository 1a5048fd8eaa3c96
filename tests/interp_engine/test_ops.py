"""The op table (interp_engine._ops) against formulas written here, on plain tensors: every op,
with and without a base (vLLM's fused resid_mid), on selected rows and columns; and the affine
form a compiled vllm-static site evaluates gives the same values as the table."""

from __future__ import annotations

import pytest
import torch

from interp_engine._ops import AFFINE, OP_MATH, Selection, affine, apply_write, effective_vector, selector_columns
from interp_engine._plan import OPS

W = 8
G = torch.Generator().manual_seed(0)
X, B, V = (torch.randn(2, 5, W, generator=G, dtype=torch.float64) for _ in range(3))
V = V[0, 0]
ROWS = torch.tensor([1, 3])
COLS = torch.tensor([0, 2, 3, 7])


def reference(kind: str, full: torch.Tensor, v: torch.Tensor, factor: float) -> torch.Tensor:
    """The op on the point's full value, written out."""
    if kind == "add":
        return full + factor * v
    if kind in ("set", "mean", "patch"):
        return v.expand_as(full).clone()
    if kind == "ablate":
        u = v / v.norm()
        return full - (full @ u)[..., None] * u
    if kind == "zero":
        return torch.zeros_like(full)
    if kind == "scale":
        return full * factor
    raise AssertionError(kind)


def test_every_op_has_math_and_an_affine_form():
    assert set(OPS) <= set(OP_MATH) and set(OPS) == set(AFFINE)


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("with_base", [False, True])
def test_apply_write_is_the_formula_on_the_selected_rows_and_columns(kind, with_base):
    factor = 1.7
    base = B if with_base else None
    for rows, cols in ((None, None), (ROWS, None), (None, COLS), (ROWS, COLS)):
        vec = effective_vector(kind, None if kind in ("zero", "scale") else V, factor, cols)
        got = apply_write(kind, X, vec, Selection(rows, None), base, cols)
        full = X if base is None else X + B
        want_full = full.clone()
        r = slice(None) if rows is None else rows
        c = slice(None) if cols is None else cols
        region = full[:, r][..., c]
        v = V if cols is None else V[cols]
        new = reference(kind, region, v, factor)
        tmp = want_full[:, r]
        tmp[..., c] = new
        want_full[:, r] = tmp
        want = want_full if base is None else want_full - B
        torch.testing.assert_close(got, want, msg=f"{kind} rows={rows} cols={cols}")


@pytest.mark.parametrize("kind", OPS)
def test_the_affine_form_equals_the_table(kind):
    """What vllm-static's steer op computes, s * x + v - (1 - s) * base - p ((x + base) . u) u,
    for each op's (s, p) and vectors."""
    factor = 0.3
    x, base = X[0], B[0]
    vec = effective_vector(kind, None if kind in ("zero", "scale") else V, factor)
    s, p = affine(kind, factor)
    v = vec if kind in ("add", "set", "mean", "patch") else torch.zeros(W, dtype=x.dtype)
    u = vec if kind == "ablate" else torch.zeros(W, dtype=x.dtype)
    full = x + base
    affine_value = s * x + v - (1 - s) * base - p * (full @ u)[:, None] * u
    torch.testing.assert_close(affine_value, apply_write(kind, x, vec, Selection(None, None), base))


def test_selector_columns():
    assert selector_columns(None, (4, 3)) is None
    assert selector_columns(("heads", (1, 3)), (4, 3)).tolist() == [3, 4, 5, 9, 10, 11]
    assert selector_columns(("neurons", (5, 0)), (16,)).tolist() == [5, 0]


def test_a_batched_per_position_vector_writes_row_by_row():
    vec = torch.randn(2, 2, W, generator=G, dtype=torch.float64)  # [batch, n_positions, width]
    got = apply_write("patch", X, vec, Selection(torch.tensor([4, 1]), torch.tensor([0, 1])))
    want = X.clone()
    want[:, 4], want[:, 1] = vec[:, 0], vec[:, 1]
    torch.testing.assert_close(got, want)
