"""Fresh rows for the slots an id map gave to new ids, so an id evicted and seen again
starts over: the table's init (`init_fn`, else its uniform init) drawn for those rows only,
and zero per-row optimizer state. One routine for both stores: an unsharded collection's
stacked buffers (one block per table) and, inside `shard_map`, the blocks of a sharded
table that each device holds.

On CPU, for a float32 buffer and the uniform init under jax's partitionable threefry, one
kernel call per block draws, converts and writes the rows used, in place
(`_write_fresh`), and one more per per-row state buffer zeroes those rows in place
(`_zero_block_rows`); the XLA form (other platforms, narrow tables, another init) draws the
`limit` rows and scatters them, and scatters the zeros. Both give the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sparse_jax._kernels import mask_positions, row_bits, when_built, zero_rows
from sparse_jax._kernels import reset_rows as write_fresh_rows
from sparse_jax._kernels._platform import by_platform
from sparse_jax._uniform_init import bits_to_uniform, threefry_key_data

__all__ = ["RowBlock", "reset_rows"]


def _marked_rows(mask: jax.Array, size: int, fill: int) -> jax.Array:
    """int32[size]: the rows `mask` marks, ascending, then `fill` (`jnp.nonzero`); on CPU one
    pass of the built kernel (XLA CPU's `nonzero` over a 2^20-row mask costs ~10 ms)."""

    def xla(m):
        return jnp.nonzero(m, size=size, fill_value=fill)[0].astype(jnp.int32)

    def kernel(m):
        return mask_positions(m, size, fill)

    out = jax.ShapeDtypeStruct((size,), jnp.int32)
    (rows,) = by_platform([mask], [out], default=xla, cpu=when_built(kernel, xla))
    return rows


def _fresh_rows(config, key: jax.Array, rows: jax.Array) -> jax.Array:
    """`config.initial_weights(key, rows=len(rows))`: the draw whose first rows become the
    rows `rows` marks (ascending, then fill). On CPU, for the uniform init under jax's
    partitionable threefry (its defaults), only the rows used are drawn (`row_bits`; the
    whole draw of `min(zch_size, history_capacity)` rows costs about as much as the remap)
    and turned into floats exactly as `jax.random.uniform` does: the same numbers."""
    k, dim = rows.shape[0], config.embedding_dim
    key_data = _key_data(config, key)
    if key_data is None:  # another init or PRNG: its whole draw
        return config.initial_weights(key, rows=k)

    def xla(key_data, bounds, rows):
        del bounds, rows
        return _whole_draw(config, key_data, k)

    def kernel(key_data, bounds, rows):
        return bits_to_uniform(row_bits(key_data, rows, dim, config.num_embeddings), *bounds)

    out = jax.ShapeDtypeStruct((k, dim), jnp.float32)
    (fresh,) = by_platform(
        [key_data, _bounds(config), rows], [out], default=xla, cpu=when_built(kernel, xla)
    )
    return fresh


def _key_data(config, key) -> jax.Array | None:
    """The key's threefry words when the fresh rows are the table's uniform init under jax's
    partitionable threefry (so they can be drawn row by row), else None."""
    return threefry_key_data(key) if config.init_fn is None else None


def _whole_draw(config, key_data, k: int) -> jax.Array:
    return config.initial_weights(jax.random.wrap_key_data(key_data), rows=k)


def _bounds(config) -> jax.Array:
    return jax.lax.optimization_barrier(  # see bits_to_uniform
        jnp.array([config.weight_init_min, config.weight_init_max], jnp.float32)
    )


def _rows_in_block(rows, block: RowBlock, limit: int) -> jax.Array:
    """Where each of `rows` (table rows) is in `block`'s buffer, `limit` (dropped) for the
    rows outside the block or when this device does not store it."""
    inside = (rows >= block.row_offset) & (rows < block.row_offset + block.num_rows) & block.here
    return jnp.where(inside, block.buffer_row + rows - block.row_offset, limit)


def _set_block_rows(w, rows, fresh, block: RowBlock) -> jax.Array:
    """`w` with the buffer row of `rows[i]`, when it lies in `block` (and the block is
    here), set to row i of the draw `fresh`, the block's columns of it."""
    at = _rows_in_block(rows, block, w.shape[0])
    c0, cn = block.col_offset, block.num_cols
    return w.at[at, :cn].set(fresh[:, c0 : c0 + cn].astype(w.dtype), mode="drop")


def _write_fresh(w, config, key_data, rows, block: RowBlock) -> jax.Array:
    """`w` (a float32 buffer holding `block`) with the rows of `rows` in the block set to
    their fresh rows (row i of the draw for `rows[i]`). On CPU one kernel call draws,
    converts and writes only the rows used, in place (`_kernels.reset_rows`); XLA's form
    draws all `len(rows)` rows and scatters them (what `_fresh_rows` and a scatter give)."""
    k = rows.shape[0]

    def xla(w, key_data, bounds, rows, here):
        del bounds
        return _set_block_rows(w, rows, _whole_draw(config, key_data, k), block._replace(here=here))

    def kernel(w, key_data, bounds, rows, here):
        return write_fresh_rows(
            w,
            key_data,
            bounds,
            rows,
            here,
            fill=config.num_embeddings,
            dim=config.embedding_dim,
            buffer_row=block.buffer_row,
            row_offset=block.row_offset,
            num_rows=block.num_rows,
            col_offset=block.col_offset,
            num_cols=block.num_cols,
        )

    here = jnp.asarray(block.here, bool)
    (w,) = by_platform(
        [w, key_data, _bounds(config), rows, here],
        [jax.ShapeDtypeStruct(w.shape, w.dtype)],
        default=xla,
        cpu=when_built(kernel, xla),
    )
    return w


def _zero_block_rows(leaf, rows, block: RowBlock, fill: int) -> jax.Array:
    """A per-row state buffer `leaf` (`[buffer rows, ...]`, holding `block`'s rows) with the
    rows of `rows` in the block zeroed. On CPU one kernel call writes only those rows, in
    place (`_kernels.zero_rows`); XLA's form scatters zeros over every entry of `rows`."""

    def xla(leaf, rows, here):
        at = _rows_in_block(rows, block._replace(here=here), leaf.shape[0])
        return leaf.at[at].set(0, mode="drop")

    def kernel(leaf, rows, here):
        return zero_rows(
            leaf,
            rows,
            here,
            fill=fill,
            buffer_row=block.buffer_row,
            row_offset=block.row_offset,
            num_rows=block.num_rows,
        )

    (leaf,) = by_platform(
        [leaf, rows, jnp.asarray(block.here, bool)],
        [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)],
        default=xla,
        cpu=when_built(kernel, xla),
    )
    return leaf


class RowBlock(NamedTuple):
    """Rows `row_offset : row_offset + num_rows` and columns `col_offset : col_offset +
    num_cols` of a table, stored in params buffer `buffer` from row `buffer_row` on; `here`:
    whether this device holds the block (a traced bool inside `shard_map`, True unsharded)."""

    buffer: str
    buffer_row: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    here: Any = True


def reset_rows(
    params: Mapping[str, jax.Array],
    opt_tables: Mapping[str, Any],
    evicted: Mapping[str, jax.Array],
    key: jax.Array,
    *,
    configs: Mapping[str, Any],
    limits: Mapping[str, int],
    blocks: Mapping[str, Sequence[RowBlock]],
):
    """(params, opt_tables) with every table row `evicted[table]` (bool over the table's
    rows) marks drawn afresh in each of `blocks[table]`, and its per-row optimizer state
    zeroed. `limits[table]`: at most that many rows are marked, and that many rows are drawn
    (from `fold_in(key, i)` for the i-th table by name, the same draw on every device).
    `evicted[table]` may also be the marked rows themselves: int32[limit], ascending, then
    the table's `num_embeddings` (what `jnp.nonzero` of the mask gives)."""
    params, opt_tables = dict(params), dict(opt_tables)
    for i, name in enumerate(sorted(evicted)):
        config, k = configs[name], limits[name]
        marked = evicted[name]
        if marked.dtype == jnp.bool_:
            rows = _marked_rows(marked, k, config.num_embeddings)  # fill: dropped
        elif marked.shape == (k,):  # the rows already (the hashed form's profile gives them)
            rows = marked
        else:
            raise ValueError(
                f"reset_rows: table {name!r}'s evicted rows have shape {marked.shape}, expected "
                f"({k},) (or a bool mask over the table's rows)"
            )
        table_key = jax.random.fold_in(key, i)
        key_data, fresh = _key_data(config, table_key), None
        for block in blocks[name]:
            w = params[block.buffer]
            limit = w.shape[0]
            if key_data is not None and w.dtype == jnp.float32:
                params[block.buffer] = _write_fresh(w, config, key_data, rows, block)
            else:
                if fresh is None:  # drawn once for the table's blocks
                    fresh = _fresh_rows(config, table_key, rows)
                params[block.buffer] = _set_block_rows(w, rows, fresh, block)
            leaves = opt_tables.get(block.buffer)
            if isinstance(leaves, Mapping):
                opt_tables[block.buffer] = {
                    n: (
                        _zero_block_rows(leaf, rows, block, config.num_embeddings)
                        if leaf.ndim and leaf.shape[0] == limit
                        else leaf
                    )
                    for n, leaf in leaves.items()
                }
    return params, opt_tables
