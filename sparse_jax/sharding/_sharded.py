"""`shard(ebc, mesh, plan)`: an EmbeddingBagCollection sharded over a device mesh.

Same functional API as the unsharded collection (`init`, `apply`, `table_weights`,
`with_table_weights`, and `make_update`), run inside `jax.shard_map`, the batch split
over every device. One scheme serves every ShardingType, because every plan is a set of
blocks (see `_work.py`). For each shard buffer, sharded over axes A and replicated over
the other axes R:

forward   input dist: the local KJT is all-gathered over A (each device of a group sees
          the group's ids; ids are 4 bytes, the cheap side). Each device pools, for its
          work items, the ids that fall in its shard's rows for the whole group batch
          (fused per-position gather+add). Output dist: one all_to_all over A returns to
          every device its samples' partial blocks; row-wise partials are summed and
          column blocks placed at their columns (a reduce-scatter for row_wise, an
          all_to_all for table/column-wise, in bytes).
backward  the mirror all_to_all brings each shard owner the pooled gradient of its items
          for the group batch; the per-id stream (row, bag, scale) and bag gradients are
          all-gathered over R so every replica applies the identical fused update
          (TorchRec's 2D parallel: replicas stay in sync); then `apply_row_rule`.
`collective_bytes(local)` counts the bytes these collectives bring each device per step.

Row-wise adagrad on a column-wise sharded table keeps one state value per row *per
column block* (mean over the block's columns), as TorchRec does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparse_jax import _lookup
from sparse_jax._capacity import capacity_for
from sparse_jax._keyed_tensor import KeyedTensor
from sparse_jax._module import StoredBlock
from sparse_jax._validate import is_concrete
from sparse_jax.optim._apply import apply_row_rule
from sparse_jax.optim._base import RowRule, SparseOptState, is_row_leaf
from sparse_jax.sharding._local_batch import LocalBatches, route_need, split_batch
from sparse_jax.sharding._plan import ShardingPlan
from sparse_jax.sharding._work import ShardBuffer, build_buffers

if TYPE_CHECKING:
    from sparse_jax.sharding._sequence import ShardedEmbeddingCollection

__all__ = ["INPUT_DISTS", "ShardedEmbeddingBagCollection", "shard"]

log = logging.getLogger("hybridrec.sharding")
INPUT_DISTS = ("all_gather", "all_to_all")


def _global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from the same host value on every process (multi-controller safe:
    each process transfers only its addressable shards)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _host(array: jax.Array) -> np.ndarray:
    """The whole value on the host, also when other processes hold some shards."""
    if array.is_fully_addressable:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _resolve_plan(plan, tables, mesh_axes) -> ShardingPlan:
    if isinstance(plan, ShardingPlan):
        if dict(plan.mesh_axes) != dict(mesh_axes):
            raise ValueError(f"the plan was made for mesh {dict(plan.mesh_axes)} but the mesh is {dict(mesh_axes)}; re-plan")
        plan.validate(tables)
        return plan
    if plan is None:
        from sparse_jax.planner import Planner, Topology

        return Planner(Topology(axes=dict(mesh_axes))).plan(tables, batch_size=1024)
    if isinstance(plan, Mapping):
        return ShardingPlan.from_types(tables, mesh_axes, plan)
    raise ValueError(f"plan must be a ShardingPlan, a {{table: sharding type}} dict or None, got {type(plan).__name__}")


class ShardedEmbeddingBagCollection:
    """An EBC whose tables live on `mesh` as `plan` says. Build with `shard(ebc, mesh, plan)`."""

    def __init__(
        self,
        ebc,
        mesh: jax.sharding.Mesh,
        plan=None,
        *,
        ladder: Sequence[int] | None = None,
        input_dist: str = "all_gather",
        max_route_capacity: int | None = None,
    ):
        if input_dist not in INPUT_DISTS:
            raise ValueError(f"input_dist={input_dist!r} is not one of {INPUT_DISTS}")
        self.ebc, self.mesh, self.ladder = ebc, mesh, ladder
        self.input_dist, self.max_route_capacity = input_dist, max_route_capacity
        self._route_high_water = 0
        self.prepare_count = 0
        self.layout = ebc.layout
        self.is_weighted, self.bounds_check = ebc.is_weighted, ebc.bounds_check
        self.mesh_axes = {a: int(s) for a, s in mesh.shape.items()}
        self.plan = _resolve_plan(plan, self.layout.tables, self.mesh_axes)
        self.buffers: list[ShardBuffer] = build_buffers(self.layout, self.plan, self.mesh_axes)
        self.num_devices = math.prod(self.mesh_axes.values())
        self._all_axes = tuple(self.mesh_axes)
        self._apply_jit = jax.jit(self._apply)
        self._high_water = (0, 1)  # (capacity, length cap) seen so far: shapes only grow

    @property
    def tables(self):
        return self.layout.tables

    @property
    def feature_names(self) -> list[str]:
        return self.layout.feature_names

    @property
    def output_dims(self) -> list[int]:
        return self.layout.output_dims

    def stored_blocks(self):
        """Every shard block: where it sits in its shard buffer (rows of all coordinates
        stacked) and which rows and columns of its table it holds."""
        for buf in self.buffers:
            for table, c, local, r0, rn, c0, cn in buf.blocks:
                yield StoredBlock(buf.name, table, c * buf.rows_per_device + local, r0, rn, c0, cn)

    def lookup_compile_count(self) -> int:
        return self._apply_jit._cache_size()

    # -- placement --------------------------------------------------------------------
    def _spec(self, buf: ShardBuffer) -> P:
        return P(buf.axes) if buf.axes else P()

    def _param_specs(self):
        return {b.name: self._spec(b) for b in self.buffers}

    def _place(self, weights: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        out = {}
        for buf in self.buffers:
            host = np.zeros((buf.group_size * buf.rows_per_device, buf.width), buf.data_type.numpy_dtype)
            for table, c, local, r0, rn, c0, cn in buf.blocks:
                start = c * buf.rows_per_device + local
                host[start : start + rn] = np.asarray(weights[table])[r0 : r0 + rn, c0 : c0 + cn]
            out[buf.name] = _global_array(host, NamedSharding(self.mesh, self._spec(buf)))
        return out

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """The same weights as `ebc.init(key)`, placed on the mesh."""
        return self._place({k: np.asarray(v) for k, v in self.ebc.table_weights(self.ebc.init(key)).items()})

    def table_weights(self, params) -> dict[str, np.ndarray]:
        """Full `[num_embeddings, dim]` weights per table, assembled from the shards (host copies)."""
        out = {t.name: np.zeros((t.num_embeddings, t.embedding_dim), t.data_type.numpy_dtype) for t in self.tables}
        for buf in self.buffers:
            host = _host(params[buf.name])
            for table, c, local, r0, rn, c0, cn in buf.blocks:
                start = c * buf.rows_per_device + local
                out[table][r0 : r0 + rn, c0 : c0 + cn] = host[start : start + rn]
        return out

    def with_table_weights(self, params, weights: Mapping) -> dict[str, jax.Array]:
        """New params with the named tables replaced; weights are resharded on load."""
        current = self.table_weights(params)
        for name, w in weights.items():
            if name not in current:
                raise ValueError(f"with_table_weights: no table named {name!r} (tables: {list(current)})")
            if tuple(np.shape(w)) != current[name].shape:
                raise ValueError(f"with_table_weights: table {name!r} is {list(current[name].shape)}, got {np.shape(w)}")
            current[name] = np.asarray(w)
        return self._place(current)

    def table_state(self, opt_state: SparseOptState, key: str) -> dict[str, np.ndarray]:
        """One per-row state leaf (e.g. "momentum1") assembled per table: `[rows, dim]` for
        elementwise state; for one-value-per-row state `{(col_offset, col_size): [rows]}`
        (one entry per column block, a single entry unless the table is column-sharded)."""
        out = {}
        for buf in self.buffers:
            host = _host(opt_state.tables[buf.name][key])
            for table, c, local, r0, rn, c0, cn in buf.blocks:
                start = c * buf.rows_per_device + local
                block = host[start : start + rn]
                if block.ndim == 1:  # one value per row of each column block
                    per_block = out.setdefault(table, {})
                    per_block.setdefault((c0, cn), np.zeros(self._rows(table), np.float32))[r0 : r0 + rn] = block
                    continue
                full = out.setdefault(table, np.zeros((self._rows(table), self._dim(table)), np.float32))
                full[r0 : r0 + rn, c0 : c0 + cn] = block
        return out

    def _rows(self, table):
        return next(t.num_embeddings for t in self.tables if t.name == table)

    def _dim(self, table):
        return next(t.embedding_dim for t in self.tables if t.name == table)

    def prepare(self, kjt, *, device=None) -> LocalBatches:  # noqa: ARG002 (placed on the mesh)
        """The global KJT checked on the host, split per device, padded once and placed on
        the mesh (once per batch; see `SparseModule`).

        Capacity and length cap never shrink below the largest seen so far, so a steady
        loop compiles once per high-water mark instead of flipping between rungs. With
        `input_dist="all_to_all"` the route capacity is counted here, on the host copy of
        the ids (exact, so no id can overflow and no device value is read)."""
        host = self.ebc.check_host(kjt)
        parts = split_batch(host, self.num_devices, self.ladder, min_capacity=self._high_water[0],
                            min_length_cap=self._high_water[1])
        self._high_water = (parts["values"].shape[1], parts["length_cap"])
        route_capacity = 0
        if self.input_dist == "all_to_all" and any(b.axes for b in self.buffers):
            route_capacity = self._route_capacity(parts)
        sharding = NamedSharding(self.mesh, P(self._all_axes))
        arrays = {k: _global_array(parts[k], sharding) for k in ("values", "lengths", "weights")}
        self.prepare_count += 1
        return LocalBatches(**arrays, keys=parts["keys"], local_batch=parts["local_batch"],
                            length_cap=parts["length_cap"], route_capacity=route_capacity)

    def _route_capacity(self, parts: dict) -> int:
        """The all_to_all buffer size for this batch: the most ids any device sends to any
        peer (counted on the host), raised to a ladder rung and never below the last one.
        Above `max_route_capacity` it raises. No id is ever dropped."""
        need = route_need(self.buffers, self.layout, parts, clamp=self.bounds_check == "clamp")
        current = self._route_high_water
        if need > current:
            rung = capacity_for(need, self.ladder, what="all_to_all input dist")
            if self.max_route_capacity is not None and rung > self.max_route_capacity:
                raise ValueError(
                    f"a device must send {need} ids to one peer, above max_route_capacity="
                    f"{self.max_route_capacity}; raise it, use a smaller batch, or input_dist='all_gather'"
                )
            if current:
                log.info("all_to_all input dist: %d ids to one peer exceed capacity %d; now %d", need, current, rung)
            self._route_high_water = rung
        return self._route_high_water

    # -- per-device pieces (inside shard_map) -----------------------------------------------
    def _positions(self, buf: ShardBuffer, local: LocalBatches):
        """Local rows and weights of my work items for the group batch: `[M, n_A, B_l, L]`."""
        values, lengths, weights = local.values[0], local.lengths[0], local.weights[0]
        if buf.axes:
            values, lengths, weights = (jax.lax.all_gather(x, buf.axes) for x in (values, lengths, weights))
            c = jax.lax.axis_index(buf.axes)
        else:
            values, lengths, weights = values[None], lengths[None], weights[None]
            c = 0
        it = {k: jnp.asarray(v)[c] for k, v in buf.item_table().items()}
        key_of_feature = jnp.asarray(self.layout.key_indices(local.keys), jnp.int32)
        b_l, cap_l = local.local_batch, values.shape[1]
        n_a = values.shape[0]
        src = jnp.arange(n_a)[None, :, None]
        bag = key_of_feature[it["feature"]][:, None, None] * b_l + jnp.arange(b_l)[None, None, :]
        offsets = jnp.concatenate([jnp.zeros((n_a, 1), lengths.dtype), jnp.cumsum(lengths, axis=1)], axis=1)
        start, length = offsets[src, bag], lengths[src, bag]  # [M, n_A, B_l]
        pos = jnp.arange(local.length_cap)
        idx = jnp.minimum(start[..., None] + pos, cap_l - 1)
        raw_w = weights[src[..., None], idx] if self.is_weighted else None
        rows, w, valid = self._in_shard(it, values[src[..., None], idx], raw_w, length, pos)
        return jnp.where(valid, rows, buf.rows_per_device), w

    def _in_shard(self, it, ids, raw_w, length, pos):
        """Which positions of `ids` (`[..., B_l, L]`, bag lengths `[..., B_l]`) hit each work
        item's shard rows, their local rows there, and their weights (0 elsewhere; divided by
        the bag length for MEAN). `it` holds the work-item fields, broadcast over the rest."""

        def field(name):
            x = it[name]
            return x.reshape(x.shape + (1,) * (ids.ndim - x.ndim))

        valid = (pos < length[..., None]) & (field("valid") > 0)
        if self.bounds_check == "clamp":
            ids = jnp.clip(ids, 0, field("num_rows") - 1)
        r0 = field("row_offset")
        valid = valid & (ids >= r0) & (ids < r0 + field("row_size")) & (ids < field("num_rows"))
        w = jnp.where(valid, jnp.ones(ids.shape, jnp.float32) if raw_w is None else raw_w, 0.0)
        w = jnp.where(field("mean") > 0, w / jnp.maximum(length, 1)[..., None].astype(jnp.float32), w)
        return ids - r0 + field("local_offset"), w, valid

    def _send_positions(self, buf: ShardBuffer, local: LocalBatches):
        """Sender side of the all_to_all input dist: for every destination j of the group and
        each of its work items, my local ids in j's shard rows: `[n_A, M, B_l, L]` local rows
        (at j), weights and validity."""
        values, lengths, weights = local.values[0], local.lengths[0], local.weights[0]
        it = {k: jnp.asarray(v) for k, v in buf.item_table().items()}  # [n_A, M], static
        key_of_feature = jnp.asarray(self.layout.key_indices(local.keys), jnp.int32)
        b_l, cap_l = local.local_batch, values.shape[0]
        offsets = jnp.concatenate([jnp.zeros(1, lengths.dtype), jnp.cumsum(lengths)])
        seg = key_of_feature[it["feature"]][..., None] * b_l + jnp.arange(b_l)  # [n_A, M, B_l]
        start, length = offsets[seg], lengths[seg]
        pos = jnp.arange(local.length_cap)
        idx = jnp.minimum(start[..., None] + pos, cap_l - 1)
        return self._in_shard(it, values[idx], weights[idx] if self.is_weighted else None, length, pos)

    def _routed_stream(self, buf: ShardBuffer, local: LocalBatches):
        """(rows, bag, scale) of my work items for the group batch, routed by one all_to_all
        of `[n_A, route_capacity]` (bag, row, weight) triples instead of all-gathering ids."""
        rows, w, valid = self._send_positions(buf, local)
        n_a, b_l, cap = buf.group_size, local.local_batch, local.route_capacity
        per_dest = valid.reshape(n_a, -1)
        slot = jnp.where(per_dest, jnp.cumsum(per_dest, axis=1) - 1, cap)  # cap: dropped (never, see batch)
        dest = jnp.arange(n_a)[:, None]
        item_bag = jnp.broadcast_to(
            jnp.arange(rows.shape[1] * b_l, dtype=jnp.int32).reshape(1, -1, b_l, 1), rows.shape
        ).reshape(n_a, -1)

        def pack(x, fill):
            return jnp.full((n_a, cap + 1), fill, x.dtype).at[dest, slot].set(x.reshape(n_a, -1))[:, :cap]

        # padding entries: an out-of-range row and bag (dropped by every scatter and segment sum)
        send = (pack(rows, buf.rows_per_device), pack(item_bag, rows.shape[1] * b_l), pack(w, 0.0))
        recv = [jax.lax.all_to_all(x, buf.axes, 0, 0) for x in send]  # [n_A sources, cap]
        r, ib, sc = recv
        src = jnp.arange(n_a, dtype=jnp.int32)[:, None]
        bag = (ib // b_l) * (n_a * b_l) + src * b_l + ib % b_l
        return r.reshape(-1), bag.reshape(-1), sc.reshape(-1)

    def _stream(self, buf: ShardBuffer, local: LocalBatches):
        """Flat (rows, bag, scale) for my items over the group batch; bag = (m, source, b)."""
        if local.route_capacity and buf.axes:
            return self._routed_stream(buf, local)
        rows, w = self._positions(buf, local)
        m, n_a, b_l = rows.shape[:3]
        bag = jnp.broadcast_to(jnp.arange(m * n_a * b_l, dtype=jnp.int32).reshape(m, n_a, b_l, 1), rows.shape)
        return rows.reshape(-1), bag.reshape(-1), w.reshape(-1)

    def _item_columns(self, buf: ShardBuffer, c: int, m: int) -> int | None:
        items = buf.items[c]
        if m >= len(items):
            return None
        return self.layout.features[items[m].feature].out_offset + items[m].col_offset

    def _forward_local(self, params, local: LocalBatches):
        b_l = local.local_batch
        out = jnp.zeros((b_l, sum(self.layout.output_dims)), jnp.float32)
        for buf in self.buffers:
            m, n_a = buf.max_items, buf.group_size
            if local.route_capacity and buf.axes:
                rows, bag, scale = self._routed_stream(buf, local)
                gathered = params[buf.name].at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)
                pooled = jax.ops.segment_sum(gathered * scale[:, None], bag, num_segments=m * n_a * b_l)
            else:
                rows, w = self._positions(buf, local)
                flat_rows = jnp.minimum(rows, buf.rows_per_device - 1).reshape(-1, rows.shape[-1])
                pooled = _lookup.sum_positions(params[buf.name], flat_rows, w.reshape(-1, w.shape[-1]), self.ebc.kernel)
            pooled = pooled.reshape(m, n_a, b_l, buf.width)
            if buf.axes:
                pooled = jax.lax.all_to_all(pooled, buf.axes, 1, 1)
            for j in range(buf.group_size):
                for k in range(m):
                    col = self._item_columns(buf, j, k)
                    if col is not None:
                        out = out.at[:, col : col + buf.width].add(pooled[k, j])
        return out

    def _update_local(self, rule: RowRule, params, state, count, local: LocalBatches, grad):
        b_l = local.local_batch
        step = count + 1
        new_params, new_states = {}, {}
        for buf in self.buffers:
            rows, bag, scale = self._stream(buf, local)
            m, n_a = buf.max_items, buf.group_size
            send = jnp.stack(
                [
                    jnp.stack(
                        [
                            grad[:, col : col + buf.width] if (col := self._item_columns(buf, j, k)) is not None
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
            replica_axes = tuple(a for a in self._all_axes if a not in buf.axes)
            if replica_axes:
                n_r = math.prod(self.mesh_axes[a] for a in replica_axes)
                rows, scale = (jax.lax.all_gather(x, replica_axes).reshape(-1) for x in (rows, scale))
                bag = (jax.lax.all_gather(bag, replica_axes) + (jnp.arange(n_r, dtype=jnp.int32) * nb)[:, None]).reshape(-1)
                bag_grads = jax.lax.all_gather(bag_grads, replica_axes).reshape(n_r * nb, buf.width)
            new_params[buf.name], new_states[buf.name] = apply_row_rule(
                rule, params[buf.name], state[buf.name], step, rows, bag, scale, bag_grads, kernel=self.ebc.kernel
            )
        return new_params, new_states, step

    # -- accounting -------------------------------------------------------------------------
    def collective_bytes(self, local: LocalBatches) -> dict[str, dict[str, int]]:
        """Bytes each device receives through collectives per training step for `local`.

        Returns `{buffer name: {"input_dist", "output_dist", "backward"}, ..., "total": {...}}`,
        computed from the static shapes the programs use (the same M, capacity and length cap
        as `_positions`). Every device receives the same bytes (one SPMD program). For a
        buffer over axes A (a group of n_A devices) replicated over the other axes R (n_R
        copies), B_l the local batch, cap_l the local capacity, K the KJT's keys, M the
        buffer's work items per coordinate, W its width, L the length cap, N = M*n_A*B_l*L:

            input_dist  = (n_A - 1) * (cap_l * 4 + K * B_l * 4 [+ cap_l * 4])
                          all_gather over A of values, lengths [and weights: weighted only]
            output_dist = (n_A - 1) * M * B_l * W * 4     all_to_all over A of fp32 [M, n_A, B_l, W]
            backward    = input_dist                      the update re-gathers the KJT
                        + output_dist                     mirror all_to_all of the pooled gradient
                        + (n_R - 1) * (N * 12 + M * n_A * B_l * W * 4)
                          all_gather over R of rows, bag (int32), scale (fp32) and bag grads

        With `input_dist="all_to_all"` a buffer over axes receives instead
        input_dist = (n_A - 1) * route_capacity * 12 (row, bag, weight triples), and its
        replica stream has N = n_A * route_capacity entries (the routing's capacity count is
        one scalar all-reduce per batch, not counted).

        `apply` moves input_dist + output_dist; the step from `make_update` moves backward
        (a separate program: it recomputes the positions, so it all-gathers the KJT again).
        Counted as the compiled programs move them: XLA merges identical collectives, so an
        all-gather of a value an earlier buffer already gathered (the KJT over the same axes,
        an identical id stream over the same replica axes) counts once, on the first buffer;
        the weights are gathered only by a weighted collection (otherwise the compiler drops
        them). Without axes (data_parallel) there is no forward communication.
        """
        if not isinstance(local, LocalBatches):
            raise ValueError(
                f"collective_bytes takes the LocalBatches of `sharded.batch(kjt)`, got {type(local).__name__}"
            )
        seen: set = set()

        def gathered(key, n: int, per_device: int) -> int:
            """Bytes an all_gather over n devices brings in; once per distinct gathered value."""
            if n <= 1 or key in seen:
                return 0
            seen.add(key)
            return (n - 1) * per_device

        def nbytes(*shape, dtype=np.float32) -> int:
            return math.prod(shape) * np.dtype(dtype).itemsize

        b_l, length_cap = local.local_batch, local.length_cap
        kjt = [("values", local.values), ("lengths", local.lengths)]
        if self.is_weighted:
            kjt.append(("weights", local.weights))
        out: dict[str, dict[str, int]] = {}
        for buf in self.buffers:
            n_a, m, w = buf.group_size, buf.max_items, buf.width
            replica_axes = tuple(a for a in self._all_axes if a not in buf.axes)
            n_r = math.prod(self.mesh_axes[a] for a in replica_axes)
            input_dist = output_dist = 0
            routed = bool(local.route_capacity and buf.axes)
            if routed:  # all_to_all of (row, bag, weight) int32/int32/fp32 triples
                input_dist = (n_a - 1) * local.route_capacity * 12
            elif buf.axes:
                input_dist = sum(
                    gathered(("kjt", buf.axes, name), n_a, nbytes(x.shape[-1], dtype=x.dtype)) for name, x in kjt
                )
            if buf.axes:
                output_dist = (n_a - 1) * nbytes(m, b_l, w)
            stream = (n_a, local.route_capacity, buf.name) if routed else (m, n_a, b_l, length_cap)
            n_ids = math.prod(stream[:2]) if routed else math.prod(stream)
            items = tuple(sorted((k, v.tobytes()) for k, v in buf.item_table().items()))
            replicas = (
                gathered(("rows", buf.axes, stream, buf.rows_per_device, items), n_r, nbytes(n_ids, dtype=np.int32))
                + gathered(("bag", replica_axes, stream), n_r, nbytes(n_ids, dtype=np.int32))
                + gathered(("scale", buf.axes, stream, items), n_r, nbytes(n_ids))
                + gathered(("bag_grads", buf.name), n_r, nbytes(m * n_a * b_l, w))
            )
            out[buf.name] = {
                "input_dist": input_dist,
                "output_dist": output_dist,
                "backward": input_dist + output_dist + replicas,
            }
        out["total"] = {k: sum(v[k] for v in out.values()) for k in ("input_dist", "output_dist", "backward")}
        return out

    # -- public, jitted --------------------------------------------------------------------
    def _apply(self, params, local: LocalBatches):
        specs = jax.tree_util.tree_map(lambda _: P(self._all_axes), local)
        fn = jax.shard_map(self._forward_local, mesh=self.mesh, in_specs=(self._param_specs(), specs),
                           out_specs=P(self._all_axes), check_vma=False)
        return fn(params, local)

    def apply(self, params, batch) -> KeyedTensor:
        """Pooled embeddings `[B, sum of dims]`, batch-sharded over every device. `batch`:
        `prepare(kjt)`'s result (or a KJT, prepared here)."""
        local = batch if isinstance(batch, LocalBatches) else self.prepare(batch)
        values = self._apply_jit(params, local) if is_concrete(*jax.tree_util.tree_leaves(params)) else self._apply(params, local)
        return KeyedTensor(self.layout.feature_names, self.layout.output_dims, values)

    def _state_specs(self, opt_state: SparseOptState):
        tables = {
            b.name: jax.tree_util.tree_map(
                lambda x, b=b: self._spec(b) if is_row_leaf(x, b.group_size * b.rows_per_device) else P(),
                opt_state.tables[b.name],
            )
            for b in self.buffers
        }
        return SparseOptState(count=P(), tables=tables)

    def update_operands(self, local: LocalBatches, grad):
        """(the prepared batch, the pooled gradient batch-sharded on the mesh)."""
        if isinstance(grad, KeyedTensor):
            grad = grad.values()
        want = (local.local_batch * self.num_devices, sum(self.layout.output_dims))
        if tuple(grad.shape) != want:
            raise ValueError(f"pooled_grad has shape {tuple(grad.shape)}; expected [batch, sum of dims] = {list(want)}")
        return local, batch_sharded(self.mesh, grad)

    def update_step(self, rule: RowRule):
        """The traceable fused update `(params, opt_state, (LocalBatches, grad)) -> (params, opt_state)`."""

        def step(params, opt_state, operands):
            local, grad = operands
            specs = jax.tree_util.tree_map(lambda _: P(self._all_axes), local)
            state_specs = self._state_specs(opt_state)

            def body(p, tables, count, loc, g):
                return self._update_local(rule, p, tables, count, loc, g)

            fn = jax.shard_map(
                body, mesh=self.mesh,
                in_specs=(self._param_specs(), state_specs.tables, P(), specs, P(self._all_axes)),
                out_specs=(self._param_specs(), state_specs.tables, P()), check_vma=False,
            )
            new_params, tables, count = fn(params, opt_state.tables, opt_state.count, local, grad)
            return new_params, SparseOptState(count=count, tables=tables)

        return step


def batch_sharded(mesh, grad) -> jax.Array:
    """`grad` placed batch-sharded over every axis of `mesh` (explicit-axis meshes from
    `jax.make_mesh` do not reshard inputs implicitly). An array already laid out so is
    returned as it is; a host value (the same on every process) is placed shard by shard."""
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    if isinstance(grad, jax.Array):
        if grad.sharding.is_equivalent_to(sharding, grad.ndim):
            return grad
        return jax.device_put(grad, sharding)
    host = np.asarray(grad)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard(
    ebc,
    mesh: jax.sharding.Mesh,
    plan=None,
    *,
    ladder: Sequence[int] | None = None,
    input_dist: str = "all_gather",
    max_route_capacity: int | None = None,
) -> ShardedEmbeddingBagCollection | ShardedEmbeddingCollection:
    """Shard `ebc` over `mesh`. `plan`: a `ShardingPlan`, `{table: "row_wise", ...}` (defaults
    filled in by `ShardingPlan.from_types`), or None (the planner decides).

    `input_dist`: "all_gather" (default: every device of a shard group sees the group's ids)
    or "all_to_all" (each id goes only to the devices whose shards hold its row, bucketized
    by row block, in `[devices, capacity]` buffers sized from a ladder; a batch that needs
    more is routed at the next rung, logged, or raises above `max_route_capacity`).

    An `EmbeddingCollection` gives a `ShardedEmbeddingCollection` (rows per id)."""
    kw = dict(ladder=ladder, input_dist=input_dist, max_route_capacity=max_route_capacity)
    from sparse_jax._embedding import EmbeddingCollection

    if isinstance(ebc, EmbeddingCollection):
        from sparse_jax.sharding._sequence import ShardedEmbeddingCollection

        return ShardedEmbeddingCollection(ebc, mesh, plan, **kw)
    return ShardedEmbeddingBagCollection(ebc, mesh, plan, **kw)
