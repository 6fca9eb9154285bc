"""A table's uniform initial rows, bit for bit `jax.random.uniform(key, (rows, dim))`, drawn
only for the rows wanted and without compiling threefry.

`jax.random.uniform` of a whole table builds, on XLA:CPU, the 64-bit counters of every
element and the two threefry words before the floats (about four times the table in
temporaries: the peak of a large table's init), and each table shape compiles its own
program whose 20 unrolled threefry rounds take ~0.5 s of LLVM (MovieLens' seven tables paid
seconds of compiles before the first step). Partitionable threefry (jax's default) gives an
element's bits from its flat index alone, so rows `first : first + count` of the draw are
computed directly: on CPU by the built kernel (`_kernels.table_bits`, one custom call and
one small float conversion per shape), elsewhere by `jax.random.uniform` itself (the whole
draw, then the rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._kernels import table_bits, when_built
from sparse_jax._kernels._platform import by_platform

__all__ = ["bits_to_uniform", "draws_rows_alone", "threefry_key_data", "uniform_rows"]


def bits_to_uniform(bits, lo, hi):
    """`jax.random.uniform`'s float32 step from its 32 random bits, op for op. `lo` and `hi`
    must reach XLA as values, not constants (pass them through `optimization_barrier`): XLA
    folds constant bounds into the arithmetic (e.g. a span of exactly 1.0) and the last bits
    change."""
    one = np.array(1.0, np.float32).view(np.uint32)
    floats = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | one, jnp.float32)
    return jnp.maximum(lo, (floats - np.float32(1.0)) * (hi - lo) + lo)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _draw(key_data, bounds, num_rows: int, dim: int, first: int, count: int):
    """Rows `first : first + count` of the `[num_rows, dim]` draw; `bounds`: float32[2]
    (lo, hi), opaque to XLA even inside a program that passes constants (see
    `bits_to_uniform`), so a draw gives the numbers of an eager `jax.random.uniform`."""
    bounds = jax.lax.optimization_barrier(bounds)

    def xla(key_data, bounds):
        key = jax.random.wrap_key_data(key_data)
        whole = jax.random.uniform(key, (num_rows, dim), jnp.float32, bounds[0], bounds[1])
        return whole[first : first + count]

    def kernel(key_data, bounds):
        return bits_to_uniform(table_bits(key_data, first, count, dim), bounds[0], bounds[1])

    out = jax.ShapeDtypeStruct((count, dim), jnp.float32)
    (rows,) = by_platform([key_data, bounds], [out], default=xla, cpu=when_built(kernel, xla))
    return rows


def threefry_key_data(key) -> jax.Array | None:
    """The key's two uint32 words when it is a partitionable threefry2x32 key, else None."""
    if not jax.config.jax_threefry_partitionable:
        return None
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if str(jax.random.key_impl(key)) != "threefry2x32":
            return None
        return jax.random.key_data(key)
    raw_threefry = jax.config.jax_default_prng_impl == "threefry2x32"
    if key.shape != (2,) or key.dtype != jnp.uint32 or not raw_threefry:
        return None
    return key


def draws_rows_alone(key) -> bool:
    """Whether `uniform_rows(key, ...)` here computes only the rows asked for (CPU default
    backend, kernels built, a partitionable threefry key); else each call draws the whole
    table first, and a caller wanting several ranges should draw it once."""
    from sparse_jax._kernels._ffi import _register

    return (
        jax.default_backend() == "cpu"
        and threefry_key_data(key) is not None
        and _register() is None
    )


def uniform_rows(
    key, num_rows: int, dim: int, lo: float, hi: float, first: int = 0, count: int | None = None
) -> jax.Array:
    """float32[count, dim]: rows `first : first + count` (default: all from `first`) of
    `jax.random.uniform(key, (num_rows, dim), float32, lo, hi)`, bit for bit."""
    count = num_rows - first if count is None else count
    if not 0 <= first <= first + count <= num_rows:
        raise ValueError(
            f"uniform_rows: rows {first}:{first + count} are not inside a draw of {num_rows} rows"
        )
    key_data = threefry_key_data(key)
    if key_data is None:  # another PRNG: its own draw, then the rows
        whole = jax.random.uniform(key, (num_rows, dim), jnp.float32, lo, hi)
        return whole[first : first + count]
    bounds = np.array([lo, hi], np.float32)
    return _draw(key_data, bounds, num_rows, dim, first, count)
