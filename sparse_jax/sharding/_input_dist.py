"""Input dist: which ids reach which device, and what each contributes there.

Inside `shard_map` (per device, for one shard buffer over axes A):

- all_gather (default): `positions` all-gathers the local KJT over A, so each device sees
  its group's ids, and marks, for each of its work items, the positions whose ids fall in
  its shard's rows (`[M, n_A, B_l, L]` local rows and weights).
- all_to_all: `routed_stream` has each device mark, for every destination of its group, its
  own ids that fall in the destination's shard rows, and send them there as
  `[n_A, route_capacity]` (row, bag, weight) triples in one all_to_all.

`stream` gives either form as the flat (rows, bag, scale) id stream the fused update
consumes. On the host, `route_need` counts the route capacity a batch needs (the same
positions the devices mark) and `route_capacity` raises it to a ladder rung, so no id is
ever dropped and no device value is read.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._capacity import capacity_for
from sparse_jax.sharding._local_batch import LocalBatches
from sparse_jax.sharding._work import ShardBuffer, ShardedStatic

__all__ = ["positions", "route_capacity", "route_need", "routed_stream", "stream"]

log = logging.getLogger("hybridrec.sharding")


# -- inside shard_map -----------------------------------------------------------------------
def positions(static: ShardedStatic, buf: ShardBuffer, local: LocalBatches):
    """Local rows and weights of my work items for the group batch: `[M, n_A, B_l, L]`."""
    values, lengths, weights = local.values[0], local.lengths[0], local.weights[0]
    if buf.axes:
        values, lengths, weights = (
            jax.lax.all_gather(x, buf.axes) for x in (values, lengths, weights)
        )
        c = jax.lax.axis_index(buf.axes)
    else:
        values, lengths, weights = values[None], lengths[None], weights[None]
        c = 0
    it = {k: jnp.asarray(v)[c] for k, v in buf.item_table().items()}
    key_of_feature = jnp.asarray(static.layout.key_indices(local.keys), jnp.int32)
    b_l, cap_l = local.local_batch, values.shape[1]
    n_a = values.shape[0]
    src = jnp.arange(n_a)[None, :, None]
    bag = key_of_feature[it["feature"]][:, None, None] * b_l + jnp.arange(b_l)[None, None, :]
    offsets = jnp.concatenate(
        [jnp.zeros((n_a, 1), lengths.dtype), jnp.cumsum(lengths, axis=1)], axis=1
    )
    start, length = offsets[src, bag], lengths[src, bag]  # [M, n_A, B_l]
    pos = jnp.arange(local.length_cap)
    idx = jnp.minimum(start[..., None] + pos, cap_l - 1)
    raw_w = weights[src[..., None], idx] if static.is_weighted else None
    rows, w, valid = _in_shard(static, it, values[src[..., None], idx], raw_w, length, pos)
    return jnp.where(valid, rows, buf.rows_per_device), w


def _in_shard(static: ShardedStatic, it, ids, raw_w, length, pos):
    """Which positions of `ids` (`[..., B_l, L]`, bag lengths `[..., B_l]`) hit each work
    item's shard rows, their local rows there, and their weights (0 elsewhere; divided by
    the bag length for MEAN). `it` holds the work-item fields, broadcast over the rest."""

    def field(name):
        x = it[name]
        return x.reshape(x.shape + (1,) * (ids.ndim - x.ndim))

    valid = (pos < length[..., None]) & (field("valid") > 0)
    if static.bounds_check == "clamp":
        ids = jnp.clip(ids, 0, field("num_rows") - 1)
    r0 = field("row_offset")
    valid = valid & (ids >= r0) & (ids < r0 + field("row_size")) & (ids < field("num_rows"))
    w = jnp.where(valid, jnp.ones(ids.shape, jnp.float32) if raw_w is None else raw_w, 0.0)
    w = jnp.where(field("mean") > 0, w / jnp.maximum(length, 1)[..., None].astype(jnp.float32), w)
    return ids - r0 + field("local_offset"), w, valid


def _send_positions(static: ShardedStatic, buf: ShardBuffer, local: LocalBatches):
    """Sender side of the all_to_all input dist: for every destination j of the group and
    each of its work items, my local ids in j's shard rows: `[n_A, M, B_l, L]` local rows
    (at j), weights and validity."""
    values, lengths, weights = local.values[0], local.lengths[0], local.weights[0]
    it = {k: jnp.asarray(v) for k, v in buf.item_table().items()}  # [n_A, M], static
    key_of_feature = jnp.asarray(static.layout.key_indices(local.keys), jnp.int32)
    b_l, cap_l = local.local_batch, values.shape[0]
    offsets = jnp.concatenate([jnp.zeros(1, lengths.dtype), jnp.cumsum(lengths)])
    seg = key_of_feature[it["feature"]][..., None] * b_l + jnp.arange(b_l)  # [n_A, M, B_l]
    start, length = offsets[seg], lengths[seg]
    pos = jnp.arange(local.length_cap)
    idx = jnp.minimum(start[..., None] + pos, cap_l - 1)
    return _in_shard(
        static, it, values[idx], weights[idx] if static.is_weighted else None, length, pos
    )


def routed_stream(static: ShardedStatic, buf: ShardBuffer, local: LocalBatches):
    """(rows, bag, scale) of my work items for the group batch, routed by one all_to_all
    of `[n_A, route_capacity]` (bag, row, weight) triples instead of all-gathering ids."""
    rows, w, valid = _send_positions(static, buf, local)
    n_a, b_l, cap = buf.group_size, local.local_batch, local.route_capacity
    per_dest = valid.reshape(n_a, -1)
    slot = jnp.where(
        per_dest, jnp.cumsum(per_dest, axis=1) - 1, cap
    )  # cap: dropped (never, see batch)
    dest = jnp.arange(n_a)[:, None]
    item_bag = jnp.broadcast_to(
        jnp.arange(rows.shape[1] * b_l, dtype=jnp.int32).reshape(1, -1, b_l, 1), rows.shape
    ).reshape(n_a, -1)

    def pack(x, fill):
        return (
            jnp.full((n_a, cap + 1), fill, x.dtype).at[dest, slot].set(x.reshape(n_a, -1))[:, :cap]
        )

    # padding entries: an out-of-range row and bag (dropped by every scatter and segment sum)
    send = (pack(rows, buf.rows_per_device), pack(item_bag, rows.shape[1] * b_l), pack(w, 0.0))
    recv = [jax.lax.all_to_all(x, buf.axes, 0, 0) for x in send]  # [n_A sources, cap]
    r, ib, sc = recv
    src = jnp.arange(n_a, dtype=jnp.int32)[:, None]
    bag = (ib // b_l) * (n_a * b_l) + src * b_l + ib % b_l
    return r.reshape(-1), bag.reshape(-1), sc.reshape(-1)


def stream(static: ShardedStatic, buf: ShardBuffer, local: LocalBatches):
    """Flat (rows, bag, scale) for my items over the group batch; bag = (m, source, b)."""
    if local.route_capacity and buf.axes:
        return routed_stream(static, buf, local)
    rows, w = positions(static, buf, local)
    m, n_a, b_l = rows.shape[:3]
    bag = jnp.broadcast_to(
        jnp.arange(m * n_a * b_l, dtype=jnp.int32).reshape(m, n_a, b_l, 1), rows.shape
    )
    return rows.reshape(-1), bag.reshape(-1), w.reshape(-1)


# -- on the host ----------------------------------------------------------------------------
def route_need(buffers, layout, parts: dict, *, clamp: bool) -> int:
    """The most ids any device sends to one peer under the all_to_all input dist, counted
    on the host arrays of `split_batch` (the same positions `_send_positions` marks valid
    on the devices: an id is sent once per work item of the peer whose shard rows hold it)."""
    values, lengths = parts["values"], parts["lengths"]
    b_l, num_keys = parts["local_batch"], len(parts["keys"])
    key_of_feature = layout.key_indices(parts["keys"])
    need = 0
    for d in range(values.shape[0]):
        offsets = np.concatenate([[0], np.cumsum(lengths[d])])
        sorted_ids = {}
        for k in range(num_keys):
            sorted_ids[k] = np.sort(
                values[d, offsets[k * b_l] : offsets[(k + 1) * b_l]].astype(np.int64)
            )
        for buf in buffers:
            if not buf.axes:
                continue
            for items in buf.items:  # one destination coordinate of the group
                sent = 0
                for it in items:
                    ids = sorted_ids[key_of_feature[it.feature]]
                    if clamp:
                        ids = np.clip(ids, 0, it.num_rows - 1)  # stays sorted
                    lo, hi = it.row_offset, min(it.row_offset + it.row_size, it.num_rows)
                    sent += int(np.searchsorted(ids, hi, "left") - np.searchsorted(ids, lo, "left"))
                need = max(need, sent)
    return need


def route_capacity(need: int, current: int, ladder, max_route_capacity: int | None) -> int:
    """The all_to_all buffer size for a batch whose busiest sender sends `need` ids to one
    peer: `need` raised to a ladder rung and never below `current` (the last size, so a
    steady loop compiles once per high-water mark). Above `max_route_capacity` it raises.
    No id is ever dropped."""
    if need <= current:
        return current
    rung = capacity_for(need, ladder, what="all_to_all input dist")
    if max_route_capacity is not None and rung > max_route_capacity:
        raise ValueError(
            f"a device must send {need} ids to one peer, above max_route_capacity="
            f"{max_route_capacity}; raise it, use a smaller batch, or input_dist='all_gather'"
        )
    if current:
        log.info(
            "all_to_all input dist: %d ids to one peer exceed capacity %d; now %d",
            need,
            current,
            rung,
        )
    return rung
