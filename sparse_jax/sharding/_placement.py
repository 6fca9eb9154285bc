"""Placement: host values put on the mesh, and whole tables assembled back from the shards.

Each shard buffer is one global `[group_size * rows_per_device, width]` array, sharded on
rows over the buffer's axes and replicated over the other mesh axes; coordinate `c`'s
blocks start at row `c * rows_per_device` (see `_work.py`). Prepared batches and pooled
gradients are split over every mesh axis (`batch_sharding`).

Everything here is multi-controller safe: placing transfers only each process's
addressable shards; reading back gathers the shards other processes hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparse_jax._uniform_init import draws_rows_alone, uniform_rows
from sparse_jax.optim._base import SparseOptState, is_row_leaf
from sparse_jax.sharding._work import ShardBuffer

__all__ = [
    "batch_sharded",
    "batch_sharding",
    "init_placed",
    "param_specs",
    "place",
    "place_batch",
    "place_rows",
    "spec",
    "state_specs",
    "table_state",
    "table_weights",
    "with_table_weights",
]


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


# -- partition specs ----------------------------------------------------------------------
def spec(buf: ShardBuffer) -> P:
    """A shard buffer's rows over its axes (replicated when it has none)."""
    return P(buf.axes) if buf.axes else P()


def param_specs(buffers: Sequence[ShardBuffer]) -> dict[str, P]:
    return {b.name: spec(b) for b in buffers}


def state_specs(buffers: Sequence[ShardBuffer], opt_state: SparseOptState) -> SparseOptState:
    """Per-row state leaves are laid out as their buffer; the rest (scalars) replicated."""
    tables = {
        b.name: jax.tree_util.tree_map(
            lambda x, b=b: spec(b) if is_row_leaf(x, b.group_size * b.rows_per_device) else P(),
            opt_state.tables[b.name],
        )
        for b in buffers
    }
    return SparseOptState(count=P(), tables=tables)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Split over every axis of `mesh` (the prepared batch and the pooled output/gradient)."""
    return NamedSharding(mesh, P(tuple(mesh.axis_names)))


# -- tables -------------------------------------------------------------------------------
def place(
    mesh: jax.sharding.Mesh, buffers: Sequence[ShardBuffer], weights: Mapping[str, np.ndarray]
) -> dict[str, jax.Array]:
    """`{table: [num_embeddings, dim]}` host weights cut into blocks and placed as the
    shard buffers (every table of every buffer must be in `weights`)."""
    out = {}
    for buf in buffers:
        host = np.zeros(
            (buf.group_size * buf.rows_per_device, buf.width), buf.data_type.numpy_dtype
        )
        for _, table, start, r0, rn, c0, cn in buf.stored_blocks():
            host[start : start + rn] = np.asarray(weights[table])[r0 : r0 + rn, c0 : c0 + cn]
        # full rank, as the update's shard_map returns it: an equal but shorter spec is another
        # jit cache key (the second step compiled again)
        out[buf.name] = _global_array(host, NamedSharding(mesh, P(buf.axes or None, None)))
    return out


class _TableDraw:
    """A table's initial weights (`config.initial_weights(key)`), by row ranges: a uniform
    init drawn by the CPU kernel draws only the rows asked for (`uniform_rows`: the same
    numbers as the whole draw); any other init (and the uniform one elsewhere) is drawn whole
    once, and only if some rows are asked for. The last piece is kept: devices holding the
    same rows (a replicated table) share one draw."""

    def __init__(self, config, key: jax.Array, dtype):
        self.config, self.key, self.dtype, self._whole, self._last = config, key, dtype, None, None
        self._by_rows = config.init_fn is None and draws_rows_alone(key)

    def rows(self, first: int, last: int, c0: int, cn: int) -> jax.Array:
        t = self.config
        if self._by_rows:
            if self._last is None or self._last[0] != (first, last, c0, cn):
                w = uniform_rows(
                    self.key,
                    t.num_embeddings,
                    t.embedding_dim,
                    t.weight_init_min,
                    t.weight_init_max,
                    first,
                    last - first,
                ).astype(self.dtype)
                w = w if (c0, cn) == (0, t.embedding_dim) else w[:, c0 : c0 + cn]
                self._last = ((first, last, c0, cn), w)
            return self._last[1]
        if self._whole is None:
            self._whole = jnp.asarray(t.initial_weights(self.key)).astype(self.dtype)
        whole = (first, last, c0, cn) == (0, *self._whole.shape)
        return self._whole if whole else self._whole[first:last, c0 : c0 + cn]


def init_placed(
    mesh: jax.sharding.Mesh, buffers: Sequence[ShardBuffer], tables: Sequence, key: jax.Array
) -> dict[str, jax.Array]:
    """The weights `place(mesh, buffers, table_weights(ebc.init(key)))` gives (table i of
    `tables`, the collection's layout order, draws with `fold_in(key, i)`), built on the
    devices without whole-table host copies: each process draws, one table at a time, only
    the tables its devices hold some rows of, and moves just those rows to each device.
    Peak memory: the placed shards, one table, and one device's rows in pieces."""
    index = {t.name: i for i, t in enumerate(tables)}
    by_name = {t.name: t for t in tables}
    out = {}
    for buf in buffers:
        shape = (buf.group_size * buf.rows_per_device, buf.width)
        sharding = NamedSharding(mesh, P(buf.axes or None, None))
        dtype = buf.data_type.numpy_dtype
        spans = {
            d: (idx[0].start or 0, shape[0] if idx[0].stop is None else idx[0].stop)
            for d, idx in sharding.addressable_devices_indices_map(shape).items()
        }
        pieces: dict = {d: [] for d in spans}  # device -> [(first row, rows on the device)]
        blocks: dict[str, list] = {}
        for block in buf.stored_blocks():
            blocks.setdefault(block[1], []).append(block)
        for table, parts in blocks.items():
            draw = _TableDraw(by_name[table], jax.random.fold_in(key, index[table]), dtype)
            for _, _, start, r0, rn, c0, cn in parts:
                for d, (a, b) in spans.items():
                    lo, hi = max(a, start), min(b, start + rn)
                    if lo >= hi:
                        continue
                    rows = draw.rows(r0 + lo - start, r0 + hi - start, c0, cn)
                    pieces[d].append((lo, jax.device_put(rows, d)))
                    del rows
            del draw
        shards = []
        for d, (a, b) in spans.items():
            parts, at = [], a
            for lo, rows in sorted(pieces.pop(d), key=lambda x: x[0]):
                if lo > at:  # rows no block fills (a device's padding)
                    parts.append(jax.device_put(np.zeros((lo - at, buf.width), dtype), d))
                parts.append(rows)
                at = lo + rows.shape[0]
            if b > at:
                parts.append(jax.device_put(np.zeros((b - at, buf.width), dtype), d))
            shards.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
            del parts
        out[buf.name] = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    return out


def table_weights(
    buffers: Sequence[ShardBuffer], tables: Sequence, params
) -> dict[str, np.ndarray]:
    """Full `[num_embeddings, dim]` weights per table, assembled from the shards (host copies)."""
    out = {
        t.name: np.zeros((t.num_embeddings, t.embedding_dim), t.data_type.numpy_dtype)
        for t in tables
    }
    for buf in buffers:
        host = _host(params[buf.name])
        for _, table, start, r0, rn, c0, cn in buf.stored_blocks():
            out[table][r0 : r0 + rn, c0 : c0 + cn] = host[start : start + rn]
    return out


def with_table_weights(
    mesh: jax.sharding.Mesh,
    buffers: Sequence[ShardBuffer],
    tables: Sequence,
    params,
    weights: Mapping,
) -> dict[str, jax.Array]:
    """New params with the named tables replaced; weights are resharded on load."""
    current = table_weights(buffers, tables, params)
    for name, w in weights.items():
        if name not in current:
            raise ValueError(
                f"with_table_weights: no table named {name!r} (tables: {list(current)})"
            )
        if tuple(np.shape(w)) != current[name].shape:
            raise ValueError(
                f"with_table_weights: table {name!r} is {list(current[name].shape)}, got {np.shape(w)}"
            )
        current[name] = np.asarray(w)
    return place(mesh, buffers, current)


def table_state(
    buffers: Sequence[ShardBuffer], tables: Sequence, opt_state: SparseOptState, key: str
) -> dict:
    """One per-row state leaf (e.g. "momentum1") assembled per table: `[rows, dim]` for
    elementwise state; for one-value-per-row state `{(col_offset, col_size): [rows]}`
    (one entry per column block, a single entry unless the table is column-sharded)."""
    config = {t.name: t for t in tables}
    out = {}
    for buf in buffers:
        host = _host(opt_state.tables[buf.name][key])
        for _, table, start, r0, rn, c0, cn in buf.stored_blocks():
            block = host[start : start + rn]
            rows = config[table].num_embeddings
            if block.ndim == 1:  # one value per row of each column block
                per_block = out.setdefault(table, {})
                per_block.setdefault((c0, cn), np.zeros(rows, np.float32))[r0 : r0 + rn] = block
                continue
            full = out.setdefault(table, np.zeros((rows, config[table].embedding_dim), np.float32))
            full[r0 : r0 + rn, c0 : c0 + cn] = block
    return out


# -- batches ------------------------------------------------------------------------------
def place_batch(
    mesh: jax.sharding.Mesh, parts: Mapping[str, np.ndarray], rows: Sequence[int] | None = None
) -> dict[str, jax.Array]:
    """The host arrays of `split_batch` ("values", "lengths", "weights") placed
    batch-sharded (`place_rows`)."""
    return {k: place_rows(mesh, parts[k], rows) for k in ("values", "lengths", "weights")}


def place_rows(
    mesh: jax.sharding.Mesh, host: np.ndarray, rows: Sequence[int] | None = None
) -> jax.Array:
    """`host` (`[len(rows), ...]`) placed batch-sharded: the device at mesh position
    `rows[i]` gets row i (`rows`: this process's positions; default every position, one
    process). Each process uploads only its rows."""
    sharding = batch_sharding(mesh)
    n = mesh.devices.size
    rows = tuple(range(n)) if rows is None else tuple(rows)
    where = {r: i for i, r in enumerate(rows)}

    def block(index):
        first = index[0].start or 0
        stop = n if index[0].stop is None else index[0].stop
        return host[[where[r] for r in range(first, stop)]][(slice(None), *index[1:])]

    return jax.make_array_from_callback((n, *host.shape[1:]), sharding, block)


def batch_sharded(mesh, grad) -> jax.Array:
    """`grad` placed batch-sharded over every axis of `mesh` (explicit-axis meshes from
    `jax.make_mesh` do not reshard inputs implicitly). An array already laid out so is
    returned as it is; a host value (the same on every process) is placed shard by shard."""
    sharding = batch_sharding(mesh)
    if isinstance(grad, jax.Array):
        if grad.sharding.is_equivalent_to(sharding, grad.ndim):
            return grad
        return jax.device_put(grad, sharding)
    return _global_array(np.asarray(grad), sharding)
