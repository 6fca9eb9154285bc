"""Interleaved timing: warm-up, then rounds that run every case once (order rotated per round).

The machine is shared and noisy, so cases are never timed in separate blocks: each round
runs all of them back to back, and figures are medians over rounds. Ratios are reported
two ways: ratio of the medians, and the median of the per-round ratios (both cases ran
within the same few hundred milliseconds, so load drift largely cancels).

A case is a callable that runs one repetition and returns its segments in seconds, e.g.
`{"fwd": ..., "bwd": ..., "total": ...}`; it must block until its results are ready.
`clocked(fn)` makes such a case from `fn(clock)`, and the harness does the waiting:
`clock.mark(segment, *outputs)` waits until every JAX array in `outputs` is computed
before it reads the time, and whatever `fn` returns is waited for before "total" stops. A
JAX call only dispatches its work; a timer that stops before the results exist measures
the dispatch, and the work then runs during whatever is timed next.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Clock", "clocked", "interleaved", "paired_ratio", "settle", "summarize"]

Case = Callable[[], dict[str, float]]


def settle(outputs: Any) -> None:
    """Wait until every JAX array in `outputs` (any pytree) is computed. torch on CPU is
    synchronous; a CUDA tensor waits for its stream."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.block_until_ready(outputs)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Clock:
    """One repetition's clock. `mark(segment, *outputs)` settles the outputs, then records
    the time since the previous mark (or the start) under `segment`."""

    def __init__(self):
        self.start = self._last = time.perf_counter()
        self.segments: dict[str, float] = {}

    def mark(self, segment: str, *outputs: Any) -> None:
        settle(outputs)
        now = time.perf_counter()
        self.segments[segment] = now - self._last
        self._last = now

    def finish(self, outputs: Any) -> dict[str, float]:
        settle(outputs)
        return {**self.segments, "total": time.perf_counter() - self.start}


def clocked(fn: Callable[[Clock], Any]) -> Case:
    """A timing case from `fn(clock)`: its marks, and "total" from the start until what it
    returned is computed."""

    def case() -> dict[str, float]:
        clock = Clock()
        return clock.finish(fn(clock))

    return case


def interleaved(
    cases: dict[str, Case],
    *,
    warmup: int = 3,
    repeats: int = 30,
    min_repeats: int = 5,
    budget_s: float | None = None,
    pause_s: float = 0.0,
    lead_in_s: float = 0.0,
) -> dict[str, dict[str, list[float]]]:
    """{case: {segment: [seconds per round]}}. Stops after `repeats` rounds, or earlier once
    `budget_s` is spent (but never before `min_repeats` rounds). `pause_s`: an untimed sleep
    before each case, so that the thread pools the previous case woke (OpenMP teams of torch
    and of our kernels, XLA's pool) stop spinning before the next case's clock starts; on 2
    cores their spinning otherwise steals the next case's first milliseconds. `lead_in_s`:
    before its timed run in a round, a case runs untimed (at least once) until this many
    seconds have passed, so the timed run finds its own thread pools awake and the previous
    case's asleep (an idle OpenMP worker spins for milliseconds before it sleeps), as in a
    loop of that case alone."""
    names = list(cases)
    for _ in range(warmup):
        for n in names:
            cases[n]()
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    start = time.perf_counter()
    try:
        for r in range(repeats):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                if pause_s:
                    time.sleep(pause_s)
                if lead_in_s > 0:
                    until = time.perf_counter() + lead_in_s
                    cases[n]()
                    while time.perf_counter() < until:
                        cases[n]()
                for seg, t in cases[n]().items():
                    samples[n].setdefault(seg, []).append(t)
            if (
                budget_s is not None
                and r + 1 >= min_repeats
                and time.perf_counter() - start > budget_s
            ):
                break
    finally:
        if was_enabled:
            gc.enable()
    return samples


def summarize(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs, np.float64)
    return {
        "median_ms": float(np.median(a) * 1e3),
        "p25_ms": float(np.percentile(a, 25) * 1e3),
        "p75_ms": float(np.percentile(a, 75) * 1e3),
        "n": int(a.size),
    }


def paired_ratio(num: list[float], den: list[float]) -> dict[str, float]:
    """Ratio of medians and the median / IQR of per-round ratios (num / den; < 1: num is faster)."""
    a, b = np.asarray(num, np.float64), np.asarray(den, np.float64)
    n = min(a.size, b.size)
    per_round = a[:n] / b[:n]
    return {
        "ratio_of_medians": float(np.median(a) / np.median(b)),
        "paired_median": float(np.median(per_round)),
        "paired_p25": float(np.percentile(per_round, 25)),
        "paired_p75": float(np.percentile(per_round, 75)),
    }
