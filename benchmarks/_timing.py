"""Shared timing helpers: interleaved medians, so machine noise hits every variant alike."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from typing import Callable, Iterable


LAST_REPEATS = [0]  # rounds the last interleaved_medians ran (for the report)
LAST_STEPS: dict[str, list[int]] = {}  # vLLM engine steps each round of the last run took, by name
_STEPS = [0]  # engine steps so far in this process, once count_engine_steps() is on


def count_engine_steps() -> None:
    """Count every ``LLMEngine.step`` in this process (the callers' own and interp_engine's
    driver thread's, which steps a multiprocess engine), so ``interleaved_samples`` records
    how many steps each round took (``LAST_STEPS``). Each step hands back one forward's outputs,
    so a round of 16 prefills that took 2 steps ran in two forwards: vLLM's engine core starts a
    forward as soon as the first request of a batch has arrived, and the others wait for the
    next. Whether a round splits varies from round to round for every client (plain
    ``llm.generate`` too), and a split round pays a forward's fixed cost once more; the count
    says how often it happened to each column, next to its times. Instrumentation for the
    benchmarks only (a wrapper on vLLM's class, installed once)."""
    from vllm.v1.engine.llm_engine import LLMEngine

    step = LLMEngine.step
    if getattr(step, "_counted", False):
        return

    def counted(self, *args, **kwargs):
        _STEPS[0] += 1
        return step(self, *args, **kwargs)

    counted._counted = True
    LLMEngine.step = counted


def interleaved_samples(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3,
                        min_seconds: float = 0.0, max_repeats: int = 200) -> dict[str, list[float]]:
    """Run each fn ``warmup`` times, then ``repeats`` rounds of one call each, interleaved, each
    round in a fresh (seeded) random order; return each name's seconds per call, round by round
    (index i of every list is round i).

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
    steps: dict[str, list[int]] = {name: [] for name in fns}
    names = list(fns)
    order = random.Random(0)
    for _ in range(repeats):
        # each round in its own order: a call can be slowed by the one before it (another
        # engine's processes still spinning on the cores, its caches), and in one fixed order a
        # column would always follow the same other one
        order.shuffle(names)
        for name in names:
            fn = fns[name]
            n0 = _STEPS[0]
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
            steps[name].append(_STEPS[0] - n0)
    LAST_REPEATS[0] = repeats
    LAST_STEPS.clear()
    LAST_STEPS.update(steps)
    return samples


def steps_per_round(name: str) -> str:
    """``name``'s engine steps per round in the last run (``count_engine_steps``): the mean, and
    the share of rounds that took the fewest ("" where steps were not counted)."""
    counts = LAST_STEPS.get(name)
    if not counts or not any(counts):
        return ""
    fewest = min(counts)
    share = sum(c == fewest for c in counts) / len(counts)
    return f"steps/round {statistics.fmean(counts):5.2f} ({share:4.0%} in {fewest})"


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3,
                        min_seconds: float = 0.0, max_repeats: int = 200) -> dict[str, float]:
    """The median seconds per call of each fn, from ``interleaved_samples``."""
    return medians(interleaved_samples(fns, repeats, warmup, min_seconds, max_repeats))


def paired_ratio(samples: dict[str, list[float]], name: str, baseline: str) -> tuple[float, float, float]:
    """``name``'s time over ``baseline``'s in the same round, over the rounds: (median, low, high),
    where low..high is a 95% confidence interval of that median (distribution-free: the order
    statistics n/2 -+ 0.98 sqrt(n) of the sorted ratios). Pairing cancels a slow stretch of the
    machine that spans a round (it slows both calls alike) where it would move one median and not
    the other. A target inside low..high is not told apart from the measurement by this run."""
    return _median_ci([a / b for a, b in zip(samples[name], samples[baseline])])


def paired_ratio_same_steps(samples: dict[str, list[float]], name: str, baseline: str,
                            counts: dict[str, list[int]] | None = None) -> tuple[float, float, float, int] | None:
    """``paired_ratio`` over only the rounds in which ``name`` and ``baseline`` took as many
    engine steps (``counts``: those ``interleaved_samples`` counted for ``samples``, by default
    the last run's ``LAST_STEPS``), and how many rounds those were: the cost of ``name``'s own
    work with the engine's batching alike on both sides. None where steps were not counted or no
    round matched."""
    counts = LAST_STEPS if counts is None else counts
    steps, base = counts.get(name), counts.get(baseline)
    if not steps or not base or not any(steps):
        return None
    ratios = [a / b for a, b, m, k in zip(samples[name], samples[baseline], steps, base) if m == k]
    return (*_median_ci(ratios), len(ratios)) if ratios else None


def _median_ci(ratios: list[float]) -> tuple[float, float, float]:
    """The median of ``ratios`` and a distribution-free 95% interval of it (``paired_ratio``)."""
    ratios = sorted(ratios)
    n = len(ratios)
    half = 0.98 * math.sqrt(n)
    lo = max(0, math.floor(n / 2 - half) - 1)  # ranks n/2 -+ 0.98 sqrt(n), 1-based, as indices
    hi = min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(ratios), ratios[lo], ratios[hi]


def verdict(spread: tuple[float, float, float], target: float) -> str:
    """A paired ratio (``paired_ratio``) against its target: met (its interval lies below),
    MISSED (above), or within noise (the interval holds the target)."""
    _, lo, hi = spread
    if hi <= target:
        return "met"
    if lo > target:
        return "MISSED"
    return "within noise"


def gathered(make: Callable[[], Iterable]) -> Callable[[], None]:
    """A timed function: the coroutines ``make()`` returns, gathered (concurrent requests), run
    on one event loop that every round of every column shares (as a server's loop serves its
    requests; a new loop per round, ``asyncio.run``, costs about 0.1 ms here, which no engine's
    own work holds). Their results are dropped inside the loop once all are in."""
    async def go() -> None:
        results = await asyncio.gather(*make())
        del results
    return lambda: _loop().run_until_complete(go())


_LOOPS: list[asyncio.AbstractEventLoop] = []


def _loop() -> asyncio.AbstractEventLoop:
    """The benchmarks' one event loop (made on first use; the process's exit closes it)."""
    if not _LOOPS:
        _LOOPS.append(asyncio.new_event_loop())
    return _LOOPS[0]


def report(title: str, values: dict[str, float], baseline: str, targets: dict[str, str] | None = None,
           samples: dict[str, list[float]] | None = None) -> None:
    """One line per name: its median, its ratio to ``baseline``'s median and, given the
    round-by-round ``samples``, the paired ratio's median and 95% CI (``paired_ratio``)."""
    base = values[baseline]
    print(f"\n{title}")
    for name, value in values.items():
        ratio = value / base
        paired = ""
        if samples is not None and name != baseline:
            mid, lo, hi = paired_ratio(samples, name, baseline)
            paired = f"   paired {mid:6.3f} (95% CI {lo:.3f}-{hi:.3f})"
        target = f"   target {targets[name]}" if targets and name in targets else ""
        steps = steps_per_round(name)
        steps = f"   {steps}" if steps else ""
        print(f"  {name:<44} median {value * 1e3:9.3f} ms   ratio {ratio:6.3f}{paired}{target}{steps}")
