"""Shared timing helpers: interleaved medians, so machine noise hits every variant alike."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from typing import Callable, Iterable


LAST_REPEATS = [0]  # rounds the last interleaved_medians ran (for the report)


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3,
                        min_seconds: float = 0.0, max_repeats: int = 200) -> dict[str, float]:
    """Run each fn ``warmup`` times, then ``repeats`` rounds of one call each, interleaved;
    return the median seconds per call for each name.

    ``min_seconds``: run more rounds (up to ``max_repeats``) where ``repeats`` of them would
    take less, judged by the last warmup round. Short calls (a prefill) are the noisiest: an
    engine that schedules 16 requests in one step one time and in two the next makes their
    times bimodal, and a median of 5 then lands on either mode."""
    round_s = 0.0
    for _ in range(warmup):
        t0 = time.perf_counter()
        for fn in fns.values():
            fn()
        round_s = time.perf_counter() - t0
    if min_seconds > 0 and round_s > 0:
        repeats = max(repeats, min(max_repeats, math.ceil(min_seconds / round_s)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    LAST_REPEATS[0] = repeats
    return {name: statistics.median(values) for name, values in samples.items()}


def gathered(make: Callable[[], Iterable]) -> Callable[[], None]:
    """A timed function: one ``asyncio.run`` of the coroutines ``make()`` returns, gathered
    (concurrent requests), whose results are dropped inside the loop once all are in. Python
    3.11's ``asyncio.run`` formats the repr of the result its coroutine returns (its SIGINT
    handler's repr holds the main task), which for captured tensors takes longer than the
    requests did: returning them would time ``repr``, not the engine."""
    async def go() -> None:
        results = await asyncio.gather(*make())
        del results
    return lambda: asyncio.run(go())


def report(title: str, medians: dict[str, float], baseline: str, targets: dict[str, str] | None = None) -> None:
    base = medians[baseline]
    print(f"\n{title}")
    for name, value in medians.items():
        ratio = value / base
        target = f"   target {targets[name]}" if targets and name in targets else ""
        print(f"  {name:<44} median {value * 1e3:9.3f} ms   ratio {ratio:6.3f}{target}")
