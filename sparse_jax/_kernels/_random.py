"""Call wrappers of the random-bits CPU kernels (`random_cpu.cc`): jax's partitionable
threefry2x32 bits for only the rows that are used, bit for bit `jax.random.bits`: the fresh
rows of a managed table's reset (`row_bits`) and a table's initial rows (`table_bits`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._kernels._ffi import _register

__all__ = ["row_bits", "table_bits"]


def row_bits(key_data, rows, dim: int, fill: int) -> jax.Array:
    """uint32[len(rows), dim]: `jax.random.bits(key, (len(rows), dim))` (partitionable
    threefry2x32, `key_data` its two words) for the rows before the first `fill` in `rows`,
    0 after: the bits of the fresh rows a reset uses, and only those are computed."""
    _register()
    out = jax.ShapeDtypeStruct((rows.shape[0], dim), jnp.uint32)
    return jax.ffi.ffi_call("HybridrecRowBits", out)(
        key_data.astype(jnp.uint32), rows.astype(jnp.int32), fill=np.int32(fill)
    )


def table_bits(key_data, first: int, count: int, dim: int) -> jax.Array:
    """uint32[count, dim]: rows `first : first + count` of `jax.random.bits(key, (rows, dim))`
    for any `rows >= first + count` (partitionable threefry2x32: an element's bits depend on
    its flat index only), computed directly: no counters, no other rows."""
    _register()
    out = jax.ShapeDtypeStruct((count, dim), jnp.uint32)
    return jax.ffi.ffi_call("HybridrecTableBits", out)(
        key_data.astype(jnp.uint32), first=np.int64(first)
    )
