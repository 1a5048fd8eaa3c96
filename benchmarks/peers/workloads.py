"""The workloads both sides time, and the timing loop: plain data and the standard library
only, so the peers' environment (which has no interp_engine) imports it too."""

from __future__ import annotations

import statistics
import time

CAPTURE_SHAPES = (("tiny", 1, 16), ("bench", 4, 128))
"""(tiny-model variant, batch, positions) for capturing every layer's resid_post."""
GEN_TOKENS = 32
STEER_LAYER = 1
STEER_SCALE = 4.0
PROMPT = "The capital of France is"


def medians(fns: dict, repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each fn, rounds interleaved so machine noise hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}
