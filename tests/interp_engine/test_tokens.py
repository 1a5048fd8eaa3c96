"""Token batches (interp_engine/_tokens.py): what users pass becomes ids plus a mask, checked."""

from __future__ import annotations

import re

import pytest
import torch

from interp_engine._tokens import TokenBatch, as_batch

D_VOCAB = 100


@pytest.mark.parametrize("tokens", [[5, 6, 7], (5, 6, 7), [[5, 6, 7]], [[5, 6, 7], [8, 9, 10]], [(1,), [2]]])
def test_prompts_of_one_length_are_one_unpadded_batch(tokens):
    rows = [list(tokens)] if isinstance(tokens[0], int) else [list(r) for r in tokens]
    batch = as_batch(tokens, D_VOCAB)
    assert batch.ids.dtype == torch.long and batch.ids.tolist() == rows
    assert batch.attention_mask.tolist() == [[1] * len(rows[0])] * len(rows)
    assert batch.padded is False and batch.lengths == [len(r) for r in rows]
    assert [batch.row(i) for i in range(len(rows))] == rows


def test_rows_of_different_lengths_are_right_padded_and_rows_come_back_whole():
    batch = as_batch([[5, 6, 7], [8]], D_VOCAB, pad_id=3)
    assert batch.ids.tolist() == [[5, 6, 7], [8, 3, 3]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.padded is True and batch.row(0) == [5, 6, 7] and batch.row(1) == [8]
    given = TokenBatch(torch.tensor([[4, 0]]), torch.tensor([[1, 0]]))
    assert given.padded and given.row(0) == [4]


@pytest.mark.parametrize("tokens, bad", [([5, D_VOCAB], [D_VOCAB]), ([[5, 6], [7, -2]], [-2]),
                                         ([[5, 6], [D_VOCAB + 1]], [D_VOCAB + 1]), ([[-1, 6], [7, 8]], [-1])])
def test_ids_outside_the_vocabulary_are_named_in_any_row(tokens, bad):
    with pytest.raises(ValueError, match=re.escape(f"outside the vocabulary [0, {D_VOCAB}): {bad}")):
        as_batch(tokens, D_VOCAB)


@pytest.mark.parametrize("tokens, error, match", [
    ([], ValueError, "empty prompt"), ([[1], []], ValueError, "empty prompt in batch"),
    ([[1, True]], TypeError, "must be ints"), ([1, [2]], TypeError, "mixed"), ([True, 2], TypeError, "mixed"),
])
def test_malformed_prompts_are_refused(tokens, error, match):
    with pytest.raises(error, match=match):
        as_batch(tokens, D_VOCAB)
