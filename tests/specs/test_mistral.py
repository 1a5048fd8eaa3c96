"""Mistral: the Llama layout with sliding-window attention (16 in the tiny recipe). Every point
is checked against the HF modules in tests/bridge/test_eager_capture.py and eager == vLLM in
tests/bridge/vllm/test_backend.py; here: the window really acts on the points we serve."""

from __future__ import annotations

import torch

from interp_engine import run_with_cache
from tests._reference import reference_points

LONG = "The cat sat on the mat while the dog slept by the door, and the train left at nine."


def test_the_window_is_honoured(eager_models):
    model = eager_models["mistral"]
    window = model.hf.config.sliding_window
    ids = model.to_tokens(LONG)
    assert ids.shape[1] > window + 4
    cache = run_with_cache(model, ids, ["pattern.0", "z.1"])
    pattern = cache["pattern.0"][0]  # [heads, pos, key_pos]
    q = torch.arange(ids.shape[1])
    outside = (q[:, None] - q[None, :]) >= window  # keys the window drops
    assert outside.any()
    assert torch.all(pattern[:, outside] == 0)
    assert torch.all(pattern[:, ~outside & (q[:, None] >= q[None, :])] > 0)
    torch.testing.assert_close(cache["z.1"], reference_points(model, ids)[("z", 1)], rtol=1e-5, atol=1e-5)
