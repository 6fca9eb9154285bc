"""Call wrappers of the random-bits CPU kernels (`random_cpu.cc`): jax's partitionable
threefry2x32 bits for only the rows that are used, bit for bit `jax.random.bits`: the fresh
rows of a managed table's reset (`row_bits`; `reset_rows` also turns them into
`jax.random.uniform`'s floats and writes them into the table in place; `zero_rows` zeroes
the same rows of the optimizer's per-row state in place) and a table's initial rows
(`table_bits`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._kernels._ffi import _register

__all__ = ["reset_rows", "row_bits", "table_bits", "zero_rows"]


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


def reset_rows(
    table,
    key_data,
    bounds,
    rows,
    here,
    *,
    fill: int,
    dim: int,
    buffer_row: int,
    row_offset: int,
    num_rows: int,
    col_offset: int,
    num_cols: int,
) -> jax.Array:
    """`table` (float32 `[R, W]`, updated in place: aliased to the result) with row
    `buffer_row + rows[i] - row_offset`, columns `:num_cols`, set to row i, columns
    `col_offset : col_offset + num_cols`, of `jax.random.uniform(key, (len(rows), dim),
    minval=bounds[0], maxval=bounds[1])`, for each i before the first `fill` whose row lies
    in `[row_offset, row_offset + num_rows)`, when `here` (a bool scalar) is true. Only
    those rows are drawn and written."""
    _register()
    out = jax.ShapeDtypeStruct(table.shape, jnp.float32)
    return jax.ffi.ffi_call("HybridrecResetRows", out, input_output_aliases={0: 0})(
        table,
        key_data.astype(jnp.uint32),
        bounds.astype(jnp.float32),
        rows.astype(jnp.int32),
        jnp.asarray(here, bool),
        **_block_attrs(fill, buffer_row, row_offset, num_rows),
        dim=np.int64(dim),
        col_offset=np.int64(col_offset),
        num_cols=np.int64(num_cols),
    )


def zero_rows(
    state, rows, here, *, fill: int, buffer_row: int, row_offset: int, num_rows: int
) -> jax.Array:
    """`state` (`[R, ...]`, any dtype; updated in place: aliased to the result) with row
    `buffer_row + rows[i] - row_offset` set to zero for each i before the first `fill` whose
    row lies in `[row_offset, row_offset + num_rows)`, when `here` (a bool scalar) is true."""
    _register()
    out = jax.ShapeDtypeStruct(state.shape, state.dtype)
    return jax.ffi.ffi_call("HybridrecZeroRows", out, input_output_aliases={0: 0})(
        state, rows.astype(jnp.int32), jnp.asarray(here, bool),
        **_block_attrs(fill, buffer_row, row_offset, num_rows),
    )  # fmt: skip


def _block_attrs(fill: int, buffer_row: int, row_offset: int, num_rows: int) -> dict:
    """The attributes naming a table block's rows and where a buffer stores them (the
    reset kernels'): rows before the first `fill` of `rows`, in `[row_offset, row_offset +
    num_rows)`, at buffer row `buffer_row + row - row_offset`."""
    return dict(
        fill=np.int32(fill),
        buffer_row=np.int64(buffer_row),
        row_offset=np.int64(row_offset),
        num_rows=np.int64(num_rows),
    )
