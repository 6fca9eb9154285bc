"""Writing fp32 results back into fp16 / bf16 tables: round to nearest, or stochastically.

FBGEMM's TBE rounds reduced-precision rows stochastically on write-back by default
(`stochastic_rounding=True`): an update smaller than half a unit in the last place (ulp) of a
narrow row would be lost every step by round-to-nearest, and stochastic rounding keeps it in
expectation. Here a value `x` between its two neighbours `lo < x < hi` of the narrow type
becomes `hi` with probability `(x - lo) / (hi - lo)` and `lo` otherwise, so the expected
result is `x` (unbiased up to the 2^-24 resolution of the uniform draw). Values the narrow
type holds exactly stay as they are; a value whose neighbours are not both finite (beyond the
largest finite value) and NaN round to nearest.

The uniform draw is a counter-based hash of (seed, step, row, column): the same seed and
the same batch give the same bits on every run, device and batch capacity, with no PRNG
key threaded through the step (no state, nothing to checkpoint). FBGEMM draws its bits from
its own generator, so stochastically rounded rows are not bitwise FBGEMM's; round-to-nearest
ones are (`stochastic_rounding=False`).
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["round_rows", "uniform_bits"]

_GOLDEN = 0x9E3779B9  # odd multipliers decorrelating the counters before the mix
_ROW = 0x85EBCA6B
_COL = 0xC2B2AE35


def _mix(h):
    """murmur3's 32-bit finalizer: every input bit flips each output bit with p ~ 1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_bits(seed: int, step, rows, dim: int):
    """`[len(rows), dim]` uint32 hash of (seed, step, row, column)."""
    row = rows.astype(jnp.uint32)[:, None] * jnp.uint32(_ROW)
    col = jnp.arange(dim, dtype=jnp.uint32)[None, :] * jnp.uint32(_COL)
    key = _mix(
        jnp.uint32(seed & 0xFFFFFFFF) ^ (jnp.asarray(step).astype(jnp.uint32) * jnp.uint32(_GOLDEN))
    )
    return _mix(_mix(key ^ row) ^ col)


def round_rows(x, dtype, *, stochastic: bool, seed: int, step, rows):
    """fp32 `[U, dim]` rows -> `dtype`. fp32 (or wider) targets, and `stochastic=False`,
    round to nearest (`astype`); `rows` are the rows' indices in the table (the hash's counter)."""
    dtype = jnp.dtype(dtype)
    if not stochastic or jnp.finfo(dtype).bits >= 32:
        return x.astype(dtype)
    x = x.astype(jnp.float32)
    near = x.astype(dtype)
    near32 = near.astype(jnp.float32)
    other = jnp.nextafter(near, jnp.where(near32 > x, -jnp.inf, jnp.inf).astype(dtype)).astype(
        jnp.float32
    )
    lo, hi = jnp.minimum(near32, other), jnp.maximum(near32, other)
    gap = hi - lo
    u = (uniform_bits(seed, step, rows, x.shape[1]) >> 8).astype(jnp.float32) * jnp.float32(
        2.0**-24
    )
    up = u * gap < x - lo  # u < (x - lo) / gap, without the division
    picked = jnp.where(up, hi, lo).astype(dtype)
    return jnp.where(jnp.isfinite(gap), picked, near)
