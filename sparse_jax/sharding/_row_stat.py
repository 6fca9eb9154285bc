"""Row-wise Adagrad under column splits: one statistic per table row, whatever the plan.

The rule adds `mean(g * g)` over a row's `dim` columns to the row's state. A plan that
splits a table's columns puts each column block on another device, and each block sees
only its own columns: TorchRec then keeps one state value per row *per block*, so changing
the plan silently changes the optimizer. Here every block's `sum(g * g)` over its columns
is added into one vector indexed by (column-split table, row), summed over the mesh, and
every block applies the rule with the row's full sum divided by the table's `dim`: the
state (the same value in every block) and the weights are the unsharded model's.

Replicas of a block (the mesh axes it is not sharded over) compute identical sums; each
adds its sum divided by the replica count, so the mesh-wide sum counts the block once.
Cost per step: one psum of a float32 vector as long as the column-split tables' rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import _guard
from sparse_jax.optim._apply import dedup_row_grads
from sparse_jax.optim._base import RowRule
from sparse_jax.sharding._work import ShardBuffer, ShardedStatic

__all__ = ["RowSpace", "apply_rowwise_split", "partial_sums", "row_space"]


@dataclasses.dataclass(frozen=True)
class RowSpace:
    """Where each column-split table's rows sit in the statistic vector."""

    base: dict[str, int]  # table -> first index
    dims: dict[str, int]  # table -> full embedding dim
    size: int

    def splits(self, buf: ShardBuffer) -> bool:
        return any(block[0] in self.base for block in buf.blocks)


def row_space(static: ShardedStatic) -> RowSpace:
    dims = {t.name: t.embedding_dim for t in static.layout.tables}
    split = {}
    for buf in static.buffers:
        for table, _, _, _, _, _, col_size in buf.blocks:
            if col_size < dims[table]:
                split[table] = dims[table]
    base, size = {}, 0
    for t in static.layout.tables:  # table order: the same on every process
        if t.name in split:
            base[t.name] = size
            size += t.num_embeddings
    return RowSpace(base, split, size)


def _block_tables(space: RowSpace, static: ShardedStatic, buf: ShardBuffer):
    """Per coordinate, the buffer's blocks as `[n_coords, K]` arrays: first local row, row
    count, the statistic index of the block's first local row (-1: not a split table), and
    the table's full dim. Padding blocks are empty."""
    dims = {t.name: t.embedding_dim for t in static.layout.tables}
    per = [[] for _ in range(buf.group_size)]
    for table, c, local, row_off, row_size, _, _ in buf.blocks:
        gbase = space.base[table] + row_off - local if table in space.base else -1
        per[c].append((local, row_size, gbase, dims[table]))
    k = max(1, max(len(p) for p in per))
    arr = np.zeros((buf.group_size, k, 4), np.int64)
    arr[:, :, 0] = np.iinfo(np.int32).max  # empty blocks start past every row
    arr[:, :, 3] = 1
    for c, blocks in enumerate(per):
        for j, b in enumerate(sorted(blocks)):
            arr[c, j] = b
    return (jnp.asarray(arr[..., i].astype(np.int32)) for i in range(4))


def _locate(space: RowSpace, static: ShardedStatic, buf: ShardBuffer, unique):
    """(statistic index or `space.size`, full dim) of each local row (-1: none)."""
    starts, sizes, gbase, dims = _block_tables(space, static, buf)
    c = jax.lax.axis_index(buf.axes) if buf.axes else 0
    starts, sizes, gbase, dims = starts[c], sizes[c], gbase[c], dims[c]
    k = jnp.clip(jnp.searchsorted(starts, unique, side="right") - 1, 0, starts.shape[0] - 1)
    inside = (unique >= 0) & (unique >= starts[k]) & (unique < starts[k] + sizes[k])
    split = inside & (gbase[k] >= 0)
    return jnp.where(split, gbase[k] + unique, space.size), jnp.where(inside, dims[k], buf.width)


def partial_sums(space: RowSpace, static: ShardedStatic, buf: ShardBuffer, stream, stat):
    """Dedup one buffer's id stream and add its blocks' `sum(g * g)` into `stat`; returns
    (stat, what `apply_rowwise_split` needs)."""
    rows, bag, scale, bag_grads, num_rows = stream
    unique, grads = dedup_row_grads(rows, bag, scale, bag_grads, num_rows=num_rows)
    index, dim = _locate(space, static, buf, unique)
    sq = jnp.sum(grads * grads, axis=1)
    stat = stat.at[index].add(sq / static.num_replicas(buf), mode="drop")
    return stat, (unique, grads, index, dim, sq)


def apply_rowwise_split(rule: RowRule, table, state, deduped, stat, step):
    """The row-wise Adagrad step of one buffer with each row's statistic over its whole
    table row (`stat`, summed over the mesh): `(new table, new state)`. Narrow tables are
    written back as `apply_row_rule` writes them (`round_rows`)."""
    unique, grads, index, dim, sq = deduped
    num_rows = table.shape[0]
    full = jnp.where(index < stat.shape[0], stat.at[index].get(mode="fill", fill_value=0), sq)
    rows = jnp.where(unique < 0, num_rows, unique)
    good = _guard.current()
    if good is not None:  # the non-finite guard: a skipped step writes no row
        rows = jnp.where(good, rows, num_rows)
    s = state["momentum1"].at[rows].get(mode="fill", fill_value=0) + full / dim.astype(jnp.float32)
    w = table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)
    new_w = w - (rule.hyperparams["lr"] / (jnp.sqrt(s) + rule.hyperparams["eps"]))[:, None] * grads
    new_w = rule.write_back(new_w, table.dtype, step=step, at=rows)
    table = table.at[rows].set(new_w, mode="drop", unique_indices=True)
    momentum = state["momentum1"].at[rows].set(s, mode="drop", unique_indices=True)
    return table, {**state, "momentum1": momentum}
