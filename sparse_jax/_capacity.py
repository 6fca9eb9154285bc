"""The capacity ladder: a small set of static sizes so `jit` sees few distinct shapes.

Jagged batches have a different number of ids every step. XLA compiles one program per
shape, so values are padded up to the next rung of a ladder (a new rung compiles once, and
rarely), and the longest bag of each feature is padded up to a power of two (the length
cap used by the per-position pooling).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DEFAULT_LADDER", "capacity_for", "length_cap", "make_ladder"]


def make_ladder(smallest: int = 128, largest: int = 1 << 27, steps_per_octave: int = 2) -> tuple[int, ...]:
    """Rungs `smallest * 2**(k / steps_per_octave)` rounded up to multiples of 8, up to `largest`."""
    if smallest < 1 or largest < smallest or steps_per_octave < 1:
        raise ValueError(
            f"capacity ladder needs 1 <= smallest <= largest and steps_per_octave >= 1, got "
            f"smallest={smallest}, largest={largest}, steps_per_octave={steps_per_octave}"
        )
    rungs: list[int] = []
    k = 0
    while True:
        size = smallest * 2 ** (k / steps_per_octave)
        rung = -(-int(round(size)) // 8) * 8
        if rung > largest:
            break
        if not rungs or rung > rungs[-1]:
            rungs.append(rung)
        k += 1
    return tuple(rungs)


DEFAULT_LADDER: tuple[int, ...] = make_ladder()


def capacity_for(n: int, ladder: Sequence[int] | None = None, *, what: str = "batch") -> int:
    """The smallest rung that holds `n` ids. Raises when `n` is above the top rung."""
    rungs = tuple(DEFAULT_LADDER if ladder is None else ladder)
    if not rungs or rungs[0] < 1 or any(b <= a for a, b in zip(rungs, rungs[1:], strict=False)):
        raise ValueError(f"a capacity ladder must be a non-empty increasing list of sizes >= 1, got {rungs}")
    for rung in rungs:
        if rung >= n:
            return rung
    raise ValueError(
        f"{what}: {n} ids exceed the largest capacity {rungs[-1]} of the ladder; add a larger "
        "rung (capacity ladder) or use a smaller batch"
    )


def length_cap(max_length: int) -> int:
    """Power of two >= `max_length` (at least 1): the padded bag length for per-position pooling."""
    cap = 1
    while cap < max_length:
        cap *= 2
    return cap
