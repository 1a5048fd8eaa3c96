"""Shared timing helpers: interleaved medians, so machine noise hits every variant alike."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Callable, Iterable


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Run each fn ``warmup`` times, then ``repeats`` rounds of one call each, interleaved;
    return the median seconds per call for each name."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
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
