"""The workloads both sides time, and the timing loop: plain data and the standard library
only, so the peers' environment (which has no interp_engine) imports it too."""

from __future__ import annotations

import sys
from pathlib import Path

# benchmarks/_timing.py is standard library only, so the peers' environment imports it too
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import interleaved_medians  # noqa: E402

CAPTURE_SHAPES = (("tiny", 1, 16), ("bench", 4, 128))
"""(tiny-model variant, batch, positions) for capturing every layer's resid_post."""
GEN_TOKENS = 32
STEER_LAYER = 1
STEER_SCALE = 4.0
PROMPT = "The capital of France is"


def medians(fns: dict, repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each fn, rounds interleaved so machine noise hits all alike
    (the one timing loop of benchmarks/_timing.py)."""
    return interleaved_medians(fns, repeats, warmup)
