"""The capacity ladder: a small set of static sizes so `jit` sees few distinct shapes.

Jagged batches have a different number of ids every step. XLA compiles one program per
shape, so values are padded up to the next rung of a ladder (a new rung compiles once, and
rarely), and the longest bag of each feature is padded up to a rung of its own (the length
cap used by the per-position pooling, `length_cap`).

The padding rule, written once (`pad_ids`, `length_caps`) and used by every path that pads
(`KeyedJaggedTensor.pad`, `prepare`'s `pad_host`, the sharded `split_batch` / `pad_parts`,
hybrid's torch collate): padding ids are 0 with weight 0, after the last bag (they belong to
no bag); a feature's cap is the `length_cap` of its longest bag, raised to a floor. A sharded
batch's position matrices are one per buffer, so it takes the largest of its features' caps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["DEFAULT_LADDER", "capacity_for", "length_cap", "length_caps", "make_ladder", "pad_ids"]


def make_ladder(
    smallest: int = 128, largest: int = 1 << 27, steps_per_octave: int = 2
) -> tuple[int, ...]:
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
        raise ValueError(
            f"a capacity ladder must be a non-empty increasing list of sizes >= 1, got {rungs}"
        )
    for rung in rungs:
        if rung >= n:
            return rung
    raise ValueError(
        f"{what}: {n} ids exceed the largest capacity {rungs[-1]} of the ladder; add a larger "
        "rung (capacity ladder) or use a smaller batch"
    )


def length_cap(max_length: int) -> int:
    """The padded bag length for per-position pooling (at least 1): 1, 2 or 4 up to 4, then
    a multiple of 4 up to 32, then four rungs an octave (40, 48, 56, 64, 80, 96, ...): at
    most 3 positions of padding up to 32, under a quarter of the bag past it.

    The pooled lookup's XLA form loops over the cap's positions, 4 an iteration: a power of
    two (the rule before) padded W1's bags of 20 to 32, 60% more gathers (measured: the XLA
    forward 1.2-1.5x slower than at cap 20). A cap only grows with the longest bag seen, so
    the finer rungs cost at most a few more compiles (14 rungs up to 64 where powers of two
    had 7)."""
    m = max(int(max_length), 1)
    if m <= 4:
        return 1 << (m - 1).bit_length()
    if m <= 32:
        return -(-m // 4) * 4
    step = 1 << ((m - 1).bit_length() - 3)  # an octave (2^k, 2^(k+1)] in 4 rungs of 2^(k-2)
    return -(-m // step) * step


def pad_ids(values: np.ndarray, capacity: int, *, fill=0) -> np.ndarray:
    """`values` (ids or weights; the last axis holds the ids) in an array of `capacity` along
    the last axis, `fill` after them: the one padding rule (padding ids 0, weights 0)."""
    values = np.asarray(values)
    n = values.shape[-1]
    if capacity < n:
        raise ValueError(f"capacity {capacity} is below the batch's {n} ids")
    out = np.full((*values.shape[:-1], capacity), fill, values.dtype)
    out[..., :n] = values
    return out


def length_caps(lengths_by_key: np.ndarray, floors: Sequence[int] | None = None) -> tuple[int, ...]:
    """Per key (rows of `lengths_by_key`, `[keys, stride]`) the `length_cap` of its longest
    bag, at least `length_cap(floor)`."""
    lengths_by_key = np.asarray(lengths_by_key)
    longest = (
        lengths_by_key.max(axis=1)
        if lengths_by_key.shape[1]
        else np.zeros(lengths_by_key.shape[0], np.int64)
    )
    caps = [length_cap(int(m)) for m in longest]
    if floors is not None:
        if len(floors) != len(caps):
            raise ValueError(f"{len(floors)} length caps for {len(caps)} keys")
        caps = [max(c, length_cap(int(f))) for c, f in zip(caps, floors, strict=True)]
    return tuple(caps)
