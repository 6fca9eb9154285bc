"""The per-device bodies run inside `shard_map`: the pooled forward and the fused update.

Both loop over the shard buffers (see `_work.py`); `_input_dist.py` says which ids each
device handles. Forward: pool my work items' ids for the group batch, all_to_all the
`[M, n_A, B_l, W]` partial blocks back to the devices that own those samples, and add each
block at its feature's output columns (row-wise partials sum; column blocks land side by
side). Update: the mirror all_to_all brings each shard owner its items' pooled gradient;
the id stream and bag gradients are all-gathered over the replica axes, so every replica
applies the identical fused `apply_row_rule` (row-wise Adagrad on column-split tables:
`_row_stat`, the row's statistic summed over its column blocks first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_jax import _guard, _lookup
from sparse_jax._row_update import update_rows
from sparse_jax.optim._base import RowRule
from sparse_jax.sharding import _row_stat
from sparse_jax.sharding._input_dist import positions, routed_stream, stream
from sparse_jax.sharding._local_batch import LocalBatches
from sparse_jax.sharding._work import ShardBuffer, ShardedStatic

__all__ = ["forward_local", "update_local"]


def _item_column(static: ShardedStatic, buf: ShardBuffer, c: int, m: int) -> int | None:
    """First output column of work item `m` of coordinate `c` (None: a padding item)."""
    items = buf.items[c]
    if m >= len(items):
        return None
    return static.layout.features[items[m].feature].out_offset + items[m].col_offset


def forward_local(static: ShardedStatic, params, local: LocalBatches):
    """My samples' pooled embeddings `[B_l, sum of dims]` (fp32)."""
    b_l = local.local_batch
    out = jnp.zeros((b_l, sum(static.layout.output_dims)), jnp.float32)
    for buf in static.buffers:
        m, n_a = buf.max_items, buf.group_size
        if local.route_capacity and buf.axes:
            rows, bag, scale = routed_stream(static, buf, local)
            gathered = params[buf.name].at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)
            pooled = jax.ops.segment_sum(gathered * scale[:, None], bag, num_segments=m * n_a * b_l)
        else:
            rows, w = positions(static, buf, local)
            flat_rows = jnp.minimum(rows, buf.rows_per_device - 1).reshape(-1, rows.shape[-1])
            pooled = _lookup.sum_positions(
                params[buf.name], flat_rows, w.reshape(-1, w.shape[-1]), static.kernel
            )
        pooled = pooled.reshape(m, n_a, b_l, buf.width)
        if buf.axes:
            pooled = jax.lax.all_to_all(pooled, buf.axes, 1, 1)
        for j in range(buf.group_size):
            for k in range(m):
                col = _item_column(static, buf, j, k)
                if col is not None:
                    out = out.at[:, col : col + buf.width].add(pooled[k, j])
    return out


def _buffer_stream(static: ShardedStatic, buf: ShardBuffer, local: LocalBatches, grad):
    """One buffer's id stream and bag gradients on its shard owner, replicas' streams
    gathered: `(rows, bag, scale, bag_grads, rows_per_device)`."""
    b_l = local.local_batch
    rows, bag, scale = stream(static, buf, local)
    m, n_a = buf.max_items, buf.group_size
    send = jnp.stack(
        [
            jnp.stack(
                [
                    grad[:, col : col + buf.width]
                    if (col := _item_column(static, buf, j, k)) is not None
                    else jnp.zeros((b_l, buf.width), grad.dtype)
                    for j in range(buf.group_size)
                ]
            )
            for k in range(m)
        ]
    )  # [M, n_A (destination), B_l, W]
    recv = jax.lax.all_to_all(send, buf.axes, 1, 1) if buf.axes else send
    nb = m * n_a * b_l
    bag_grads = recv.reshape(nb, buf.width)
    replica_axes = static.replica_axes(buf)
    if replica_axes:
        n_r = static.num_replicas(buf)
        rows, scale = (jax.lax.all_gather(x, replica_axes).reshape(-1) for x in (rows, scale))
        bag = (
            jax.lax.all_gather(bag, replica_axes) + (jnp.arange(n_r, dtype=jnp.int32) * nb)[:, None]
        ).reshape(-1)
        bag_grads = jax.lax.all_gather(bag_grads, replica_axes).reshape(n_r * nb, buf.width)
    return rows, bag, scale, bag_grads, buf.rows_per_device


def update_local(
    static: ShardedStatic, rule: RowRule, params, state, count, local: LocalBatches, grad
):
    """The fused update of my shards from my samples' pooled gradient `grad` `[B_l, sum of
    dims]`: `(new params, new per-buffer state, step)`. Row-wise Adagrad on column-split
    tables takes each row's statistic over the whole table row (`_row_stat`)."""
    step = count + 1
    new_params, new_states = {}, {}
    space = _row_stat.row_space(static) if rule.native == "rowwise_adagrad" else None
    split = {}
    if space is not None and space.size:
        stat = jnp.zeros((space.size,), jnp.float32)
        for buf in static.buffers:
            if space.splits(buf):
                stat, split[buf.name] = _row_stat.partial_sums(
                    space, static, buf, _buffer_stream(static, buf, local, grad), stat
                )
        stat = jax.lax.psum(stat, static.all_axes)
    for buf in static.buffers:
        if buf.name in split:
            new_params[buf.name], new_states[buf.name] = _row_stat.apply_rowwise_split(
                rule, params[buf.name], state[buf.name], split[buf.name], stat, step
            )
            continue
        rows, bag, scale, bag_grads, _ = _buffer_stream(static, buf, local, grad)
        new_params[buf.name], new_states[buf.name] = update_rows(
            rule,
            params[buf.name],
            state[buf.name],
            step,
            rows,
            bag,
            scale,
            bag_grads,
            kernel=static.kernel,
        )
    return new_params, new_states, _guard.next_count(count)
