"""return_logits="last" on eager: each row's final real position of the HF forward's logits,
padded batches included (a right-padded row ends before the batch's last column)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import run_with_cache
from interp_engine.testing import TINY_ARCHS


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_last_is_each_rows_final_real_position(model_pool, arch):
    model = model_pool.get(arch)
    batch = model.to_tokens(["Paris is the capital of", "Hi"])
    full, _ = run_with_cache(model, batch, [], return_logits=True)
    last, cache = run_with_cache(model, batch, ["resid_post.0"], return_logits="last")
    assert last.shape == (2, model.d_vocab) and "resid_post.0" in cache
    lengths = batch.attention_mask.sum(-1)
    assert int(lengths[1]) < batch.attention_mask.shape[1]  # the second row is padded
    for row in range(2):
        want = full[row, int(lengths[row]) - 1]
        torch.testing.assert_close(last[row], want, atol=1e-5, rtol=1e-5)
    one = model.to_tokens("Hi")
    alone, _ = run_with_cache(model, one, [], return_logits="last")
    torch.testing.assert_close(alone[0], last[1], atol=1e-5, rtol=1e-5)
