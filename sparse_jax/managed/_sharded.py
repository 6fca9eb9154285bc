"""`ShardedManagedCollisionModule`: managed-collision tables on a mesh.

A managed table stored row-wise over mesh axes (`row_wise`: the plan's row blocks, `ceil(E /
S)` rows each over S shards, the trailing ones smaller or empty, as for any row-wise table)
is managed per shard, as TorchRec's sharded managed collision does: shard s runs its own
`MCHManagedCollisionModule` of its own block's rows (`TableSplit.sizes[s]`; its last row is
its default row) over the rows it stores (`offset_s + slot`). An id's owner shard is decided
by a hash of the id, `hashed_slots(id, K)` over the K shards of at least 2 rows (all S when
the rows split evenly; a trailing block of one row or none holds no map and gets no ids:
with ceil blocks these are the last shards). TorchRec does the same: its sharded managed
collision (`torchrec/distributed/mc_modules.py`) rebuilds each rank's module over that
rank's row-wise shard (`rebuild_with_output_id_range(shard_offset, shard_offset +
shard_size)`, the shard sizes of `_calculate_rw_shard_sizes_and_offsets`: `ceil(E / S)`
rows a rank, e.g. 10 over 4 as 3, 3, 3, 1), so each rank's zch size is its shard's rows; it
routes ids by their value's range in the input hash space, uniformly over the ranks, where
this module hashes them uniformly over the shards holding a map. A table of no more rows
than shards (no block of 2 rows) keeps one map, as any other placement (data-parallel,
table-wise, column-wise, ...) does: one id map for the whole table, replicated on every
device. Either way the id maps live on the devices that hold the table, and replicas of a
shard compute the same map from the same ids.

Per-shard maps are stacked `[S, rows]` (`rows`: the largest block's); a smaller shard's map
uses its first `sizes[s]` entries, the rest stays as `init` left it (empty ids). When the
blocks differ in size the step runs each distinct size's map on every device and keeps the
one of the device's own block (a select: no data-dependent control flow on a GPU), so an
uneven split costs one remap per distinct size (two at most under ceil blocks).

The step, as unsharded (`sparse_jax.ManagedCollisionSparseModule`): `prepare` does host
work only (checks, the collection's own prepare with a placeholder at managed positions,
and per managed table the raw id words of each device's part of the batch with their
positions, placed batch-sharded); `remap` runs in the step right before the lookup, one
jitted program: inside `shard_map` every device all-gathers the table's raw ids (as the
all-gather input dist does), each shard profiles and maps the ids it owns, a `psum` over
the shard axes gives every position its row, and each device keeps its own part; then the
rows given to new ids are reset in the donated shard buffers and optimizer state.

Several processes (`jax.distributed`, bag collections; a sequence collection is refused, as
`ShardedEmbeddingCollection` itself refuses them): each prepares only its own samples, as the sharded
collection does, and the processes agree on each managed table's id capacity through the
same host key-value store (`ProcessAgreement`), so every process places arrays of one shape;
the id maps are global arrays, gathered to the host only for checkpoints and export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparse_jax._embedding import SequenceBatch
from sparse_jax.managed._base import ManagedModuleBase, profile_counted
from sparse_jax.managed._batch import ManagedBatch, raw_words_into, split_managed
from sparse_jax.managed._collection import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from sparse_jax.managed._frozen import frozen_map
from sparse_jax.managed._id_map import (
    MCHManagedCollisionModule,
    MCHState,
    RawIds,
    hashed_slots,
    host_hashed_slots,
)
from sparse_jax.managed._programs import Program, ProgramCache
from sparse_jax.managed._reset import RowBlock, reset_rows
from sparse_jax.plan._layout import row_block_sizes
from sparse_jax.sharding import _placement
from sparse_jax.sharding._agree import ProcessAgreement
from sparse_jax.sharding._local_batch import LocalBatches, split_batch
from sparse_jax.sharding._sequence import ShardedEmbeddingCollection
from sparse_jax.sharding._sharded import ShardedEmbeddingBagCollection

__all__ = ["ShardedManagedCollisionModule"]


class TableSplit(NamedTuple):
    """How a managed table's slots are split: `shards` id maps stacked, one per coordinate
    of `axes` (1 and `()`: one map for the whole table, replicated), `rows` entries each
    (the largest block's), shard s using the first `sizes[s]` (its block's rows; a block
    of fewer than 2 rows holds no map)."""

    shards: int
    axes: tuple[str, ...]
    rows: int
    sizes: tuple[int, ...] = ()

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Rows of each shard's block (`sizes`, or `rows` each when left out)."""
        return self.sizes or (self.rows,) * self.shards

    @property
    def offsets(self) -> tuple[int, ...]:
        """The first table row of each shard's block."""
        out, at = [], 0
        for size in self.block_sizes:
            out.append(at)
            at += size
        return tuple(out)

    @property
    def mapped(self) -> int:
        """Shards holding an id map (at least 2 rows; with ceil blocks the first ones): an
        id's shard is `hashed_slots(id, mapped)`."""
        return sum(size >= 2 for size in self.block_sizes)

    @property
    def even(self) -> bool:
        return all(size == self.rows for size in self.block_sizes)

    def map_sizes(self) -> tuple[int, ...]:
        """The distinct slot counts of the shards' maps, largest first."""
        return tuple(sorted({z for z in self.block_sizes if z >= 2}, reverse=True))


def table_split(sharded: ShardedEmbeddingBagCollection, table) -> TableSplit:
    """Per shard maps for a table stored in the plan's row-wise blocks (full width, one per
    coordinate of a buffer's axes, in order, `row_block_sizes`: the blocks plain row-wise
    tables use, even or not) when the first has at least 2 rows; one replicated map
    otherwise."""
    for buf in sharded.buffers:
        blocks = sorted(
            (c, r0, rn, c0, cn) for name, c, _, r0, rn, c0, cn in buf.blocks if name == table.name
        )
        if not blocks:
            continue
        s = buf.group_size
        sizes = tuple(row_block_sizes(table.num_embeddings, s))
        split = TableSplit(s, tuple(buf.axes), sizes[0], sizes)
        expected = [
            (c, r0, rn, 0, table.embedding_dim)
            for c, (r0, rn) in enumerate(zip(split.offsets, sizes, strict=True))
            if rn
        ]
        if s > 1 and sizes[0] >= 2 and blocks == expected:
            return split
    return TableSplit(1, (), table.num_embeddings, (table.num_embeddings,))


def shard_of(split: TableSplit, ids: RawIds) -> jax.Array | int:
    """The shard each id belongs to (traced; 0 for one map)."""
    return hashed_slots(ids, split.mapped) if split.mapped > 1 else 0


def host_shard_of(split: TableSplit, raw: np.ndarray) -> np.ndarray:
    """`shard_of` of int64 ids on the host."""
    if split.mapped > 1:
        return host_hashed_slots(raw, split.mapped)
    return np.zeros(np.shape(raw), np.int32)


def _check_routable(
    sharded: ShardedEmbeddingBagCollection, configs, split: Mapping[str, TableSplit]
) -> None:
    """The all_to_all input dist counts each device's sends on the host, from the rows a
    batch reads, before a managed id has its row. A table managed per shard sends each id to
    the shard its hash names (its placeholder row is that shard's first: the count is
    exact), and a whole-table map under a placement that does not split rows sends every id
    alike; a whole-table map over split rows would send an id where its row, unknown on the
    host, lives: refused."""
    for name, parts in split.items():
        rows = {
            (r0, rn)
            for buf in sharded.buffers
            for table, _, _, r0, rn, _, _ in buf.blocks
            if table == name
        }
        if parts.shards == 1 and rows != {(0, configs[name].num_embeddings)}:
            kind = sharded.plan[name].sharding_type.value
            shards = max(
                b.group_size for b in sharded.buffers if any(x[0] == name for x in b.blocks)
            )
            why = (
                f"a map per row block needs at least 2 rows in each of the first blocks: its "
                f"num_embeddings={configs[name].num_embeddings} must exceed its {shards} shards; give "
                "it more rows or shard it over fewer devices"
                if kind == "row_wise"
                else f"maps per block are kept for row_wise tables, not {kind}; use row_wise"
            )
            raise ValueError(
                f"managed table {name!r} splits its rows into blocks {sorted(rows)} without an id map per "
                f"block ({why}); with input_dist='all_to_all' the host cannot count where its ids go. "
                "Or use a placement that does not split rows, or input_dist='all_gather'"
            )


class ShardedManagedCollisionModule(ManagedModuleBase):
    """`sharded` (a `ShardedEmbeddingBagCollection`, or a `ShardedEmbeddingCollection`) with
    a managed-collision module per table in `managed_collision_modules` (`zch_size ==
    num_embeddings`), as a `SparseModule` (see the module docstring). A sharded sequence
    collection looks its ids up as one-id bags of the bag collection it keeps
    (`ShardedEmbeddingCollection.bags`), so its managed tables are that collection's."""

    def __init__(
        self,
        sharded: ShardedEmbeddingBagCollection | ShardedEmbeddingCollection,
        managed_collision_modules: Mapping[str, MCHManagedCollisionModule],
    ):
        self.sequence = isinstance(sharded, ShardedEmbeddingCollection)
        if self.sequence:
            # the sequence collection's own checks (need_indices, features of their own) and
            # its feature names, for the raw batch; the bags' for the per-id batch
            self._front_mc = ManagedCollisionEmbeddingCollection(
                sharded.ec, managed_collision_modules
            )
            front, sharded = sharded, sharded.bags
            if len(sharded._local_rows) < sharded.num_devices:
                raise NotImplementedError(
                    "managed tables of a sharded EmbeddingCollection across several processes are not supported "
                    "(as the sharded EmbeddingCollection itself: each process's share of ids gives a different "
                    "per-id batch); use one process, or an EmbeddingBagCollection"
                )
        if not isinstance(sharded, ShardedEmbeddingBagCollection):
            raise TypeError(
                f"ShardedManagedCollisionModule wraps a ShardedEmbeddingBagCollection or a "
                f"ShardedEmbeddingCollection, got {type(sharded).__name__}"
            )
        mc = ManagedCollisionEmbeddingBagCollection(sharded.ebc, managed_collision_modules)
        configs = {t.name: t for t in sharded.tables}
        self.split = {name: table_split(sharded, configs[name]) for name in mc.modules}
        self.shard_modules = {
            name: dataclasses.replace(module, zch_size=self.split[name].rows)
            for name, module in mc.modules.items()
        }
        if sharded.input_dist == "all_to_all":
            _check_routable(sharded, configs, self.split)
        self.sharded, self.mesh = sharded, sharded.mesh
        super().__init__(mc, sharded)
        if self.sequence:  # the forward and the update take the sequence collection's batches
            self.front = self.inner = front
            self.layout = front.layout
        self.plan = sharded.plan
        self._programs: dict = {}
        self._agree = (
            ProcessAgreement()
        )  # id capacities agreed between processes (same order on each)

    @property
    def mesh_axes(self):
        return self.sharded.mesh_axes

    # -- the id maps ----------------------------------------------------------------------------
    def _place_key(self, key):
        """`key` replicated on the mesh (from its host value: every process holds the same)."""
        data = np.asarray(jax.random.key_data(key))
        return jax.random.wrap_key_data(
            _placement._global_array(data, NamedSharding(self.mesh, P())),
            impl=jax.random.key_impl(key),
        )

    def _spec(self, name: str) -> NamedSharding:
        axes = self.split[name].axes
        return NamedSharding(self.mesh, P(axes) if axes else P())

    def _placed(self, name: str, x) -> jax.Array:
        """`x` (one id map per shard, stacked) on the mesh with the sharding the remap's
        outputs carry (the spec spelled out to the array's rank: an equal but shorter spec
        would be a new signature, and compile the remap again on the second step)."""
        spec = self._spec(name).spec
        sharding = NamedSharding(self.mesh, P(*spec, *[None] * (x.ndim - len(spec))))
        return _placement._global_array(np.asarray(x), sharding)

    def _fresh_maps(self):
        def stacked(name):
            shards = self.split[name].shards
            state = self.shard_modules[name].init()
            return jax.tree.map(
                lambda x: self._placed(name, jnp.broadcast_to(x, (shards, *x.shape))), state
            )

        states = {name: stacked(name) for name in self.managed_tables}
        counters = {
            name: self._placed(name, jnp.zeros((self.split[name].shards, 3), jnp.int32))
            for name in self.managed_tables
        }
        return states, counters

    def stats(self) -> dict[str, jax.Array]:
        """{managed table: int32[3] device array (slots in use, ids admitted so far, resident
        ids evicted so far), summed over the table's id maps}: read them when you log."""
        return {name: jnp.sum(c, axis=0) for name, c in self.mc_counters.items()}

    def frozen_maps(self):
        """{managed table: its id maps frozen on the host (`FrozenIdMap`; a collective on a
        multi-process mesh)}. A table split unevenly freezes each shard's map with its own
        block's default row (e.g. 18 rows over 4 shards: blocks of 5, 5, 5 and 3, default rows
        4, 9, 14 and 17; 10 over 4: 3, 3, 3 and a row that holds no map, default rows 2, 5
        and 8)."""
        states = self.host_state()[0]
        return {
            name: frozen_map(
                states[name], self.split[name].block_sizes if self.split[name].shards > 1 else None
            )
            for name in self.managed_tables
        }

    def host_state(self):
        """(`{table: MCHState}`, `{table: counters}`, draw key data) as host arrays, gathered
        from every process (a collective: every process calls it)."""
        states = {
            name: MCHState(*(_placement._host(leaf) for leaf in state))
            for name, state in self.mc_state.items()
        }
        counters = {name: _placement._host(c) for name, c in self.mc_counters.items()}
        return states, counters, _placement._host(jax.random.key_data(self._key))

    # -- the batch ------------------------------------------------------------------------------
    def prepare(self, kjt, *, device=None):  # noqa: ARG002 (placed on the mesh)
        """Host work only: checks, the sharded collection's prepare with a placeholder at
        managed positions, and the raw id words of each device's part, placed beside it (a
        `ManagedBatch`; for a sequence collection, a `SequenceBatch` whose rows are one)."""
        if not self.sequence:
            return self._prepare_bags(kjt)
        split = split_managed(kjt, self._front_mc)
        host = self.front.ec.check_host(split.ids)  # unmanaged ids against their tables
        values = np.where(split.code >= 0, split.raw, np.asarray(host.values(), np.int64))
        per_id, lengths = self.front._per_id(host._replace(values=values))
        return SequenceBatch(rows=self._prepare_bags(per_id), lengths=lengths, stride=host.stride())

    def _prepare_bags(self, kjt) -> ManagedBatch:
        """This process's part of a bag batch (one process: all of it): the collection's
        prepare (each id of a table managed per shard held by its shard's first row, so the
        all_to_all input dist counts its sends exactly), then per managed table the raw id
        words of each local device's ids and their positions, at a capacity every process
        agrees on."""
        split = split_managed(kjt, self.mc)
        ids, raw = split.ids, split.raw
        placeholder = np.array(ids.values())
        for name in self.managed_tables:
            parts = self.split[name]
            if parts.shards > 1:
                mine = split.positions(name)
                offsets = np.asarray(parts.offsets, np.int64)
                placeholder[mine] = offsets[host_shard_of(parts, split.raw_of(name))]
        local = self.sharded.prepare(ids._replace(values=placeholder.astype(np.int32)))
        rows = self.sharded._local_rows
        capacity = local.values.shape[1]
        index = ids._replace(
            values=np.arange(1, raw.shape[0] + 1, dtype=np.int32)
        )  # where each id lands
        where = (
            split_batch(index, len(rows), (capacity,), min_capacity=capacity)["values"].astype(
                np.int64
            )
            - 1
        )
        code = np.append(split.code, -1)  # position -1 (padding) owns nothing
        tables = self.managed_tables
        mine = {  # [local devices, capacity]
            name: code[where] == (split.tables.index(name) if name in split.tables else -2)
            for name in tables
        }
        counts = [int(mine[name].sum(axis=1).max(initial=0)) for name in tables]
        if len(rows) < self.sharded.num_devices:
            counts = self._agree.max(counts)
        words, positions = {}, {}
        for name, count in zip(tables, counts, strict=True):
            cap = self._capacity(name, count, devices=self.sharded.num_devices)
            pos = np.full((len(rows), cap), capacity, np.int32)
            w = np.zeros((len(rows), cap, 2), np.int32)
            for d in range(len(rows)):
                (js,) = np.nonzero(mine[name][d])
                pos[d, : len(js)] = js
                raw_words_into(w[d], raw[where[d, js]])
            positions[name] = _placement.place_rows(self.mesh, pos, rows)
            words[name] = _placement.place_rows(self.mesh, w, rows)
        self.prepare_count += 1
        return ManagedBatch(local, words, positions)

    def needs_remap(self, batch) -> bool:
        if self.sequence:
            return isinstance(batch, SequenceBatch) and isinstance(batch.rows, ManagedBatch)
        return isinstance(batch, ManagedBatch)

    def remap_compile_count(self) -> int:
        """Programs the remap has compiled (constant in a steady loop)."""
        return sum(program.compile_count() for program in set(self._programs.values()))

    # -- in the step ----------------------------------------------------------------------------
    def _program(self, training: bool, opt_state=None) -> Program:
        """The remap program for this module's configuration (shared by every module of an
        equal one), looked up once per optimizer state structure."""
        key = (training, None if opt_state is None else jax.tree.structure(opt_state))
        program = self._programs.get(key)
        if program is None:
            opt_specs = None
            if training:
                specs = _placement.state_specs(self.sharded.buffers, opt_state).tables
                leaves, tree = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, P))
                opt_specs = (tree, tuple(leaves))
            configs = {t.name: t for t in self.tables}
            spec = ShardedRemapSpec(
                training,
                self.mesh,
                tuple(
                    (name, self.split[name], self.shard_modules[name], configs[name])
                    for name in self.managed_tables
                ),
                tuple(self.sharded.buffers),
                opt_specs,
            )
            program = self._programs[key] = _PROGRAMS.get(spec)
        return program

    def remap(self, params, opt_state, batch):
        """A training batch's remap: `(params, opt_state, LocalBatches of table rows)` (a
        sequence collection's: its `SequenceBatch` with those rows)."""
        if self.sequence:
            params, opt_state, rows = self._remap_bags(params, opt_state, self._bags_batch(batch))
            return params, opt_state, dataclasses.replace(batch, rows=rows)
        return self._remap_bags(params, opt_state, batch)

    def _remap_bags(self, params, opt_state, batch: ManagedBatch):
        program = self._program(True, opt_state).remap
        (params, tables, self.mc_state, self.mc_counters, self._key, values) = program(
            params,
            opt_state.tables,
            self.mc_state,
            self.mc_counters,
            self._key,
            batch.inner.values,
            batch.words,
            batch.positions,
        )
        return (
            params,
            opt_state._replace(tables=tables),
            dataclasses.replace(batch.inner, values=values),
        )

    def remap_eval(self, batch):
        if self.sequence:
            return dataclasses.replace(batch, rows=self._remap_eval_bags(self._bags_batch(batch)))
        return self._remap_eval_bags(batch)

    def _remap_eval_bags(self, batch: ManagedBatch) -> LocalBatches:
        values = self._program(False).remap(
            self.mc_state, batch.inner.values, batch.words, batch.positions
        )
        return dataclasses.replace(batch.inner, values=values)

    def _bags_batch(self, batch) -> ManagedBatch:
        if not self.needs_remap(batch):
            raise TypeError(
                f"remap takes this module's prepared batch (prepare(kjt)), got {type(batch).__name__}"
            )
        return batch.rows


class ShardedRemapSpec(NamedTuple):
    """What a sharded remap program reads, static and hashable: whether it trains, the mesh,
    per managed table (sorted by name) its split, per-shard id map module and config, the
    collection's buffers, and the optimizer state's specs (`(treedef, leaves)`; None for eval)."""

    training: bool
    mesh: Mesh
    tables: tuple[tuple[str, TableSplit, MCHManagedCollisionModule, object], ...]
    buffers: tuple
    opt_specs: tuple | None


def _spec_of(mesh, split: TableSplit) -> P:
    return NamedSharding(mesh, P(split.axes) if split.axes else P()).spec


def _map_local(spec: ShardedRemapSpec):
    """The per-device body: (state, counters, values, words, positions) -> (state,
    counters, values, evicted); see the module docstring."""
    all_axes = tuple(spec.mesh.axis_names)
    training = spec.training

    def body(state, counters, values, words, positions):
        me = jax.lax.axis_index(all_axes)
        values = values[0]
        state, counters, evicted = dict(state), dict(counters), {}
        for name, split, module, _ in spec.tables:
            cap = positions[name].shape[1]
            ids = RawIds.from_words(jax.lax.all_gather(words[name][0], all_axes, tiled=True))
            pos = jax.lax.all_gather(positions[name][0], all_axes, tiled=True)
            s = jax.lax.axis_index(split.axes) if split.axes else 0
            owned = (pos < values.shape[0]) & (
                shard_of(split, ids) == s if split.shards > 1 else True
            )
            st = MCHState(*(x[0] for x in state[name]))
            if split.even:
                ev = None
                if training:
                    st, counted, ev = profile_counted(module, st, counters[name][0], ids, owned)
                slots = module.remap(st, ids)
                offset = s * module.zch_size
            else:
                st, counted, ev, slots = _uneven_map(
                    split, module, st, counters[name][0], ids, owned, s, training
                )
                offset = jnp.asarray(split.offsets, jnp.int32)[s]
            if training:
                counters[name] = counted[None]
                state[name] = MCHState(*(x[None] for x in st))
                evicted[name] = ev[None]
            rows = jnp.where(owned, offset + slots, 0)
            if split.axes:
                rows = jax.lax.psum(rows, split.axes)  # one owner per position
            mine = jax.lax.dynamic_slice(rows, (me * cap,), (cap,))
            values = values.at[positions[name][0]].set(mine, mode="drop")
        return state, counters, values[None], evicted

    return body


def _uneven_map(split: TableSplit, module, st: MCHState, counters, ids: RawIds, owned, s, training):
    """One shard's map of a table whose blocks differ in size: each distinct size's module
    runs on the first `size` entries of the stacked map, and the device keeps the one of
    its own block (a shard with no map keeps the first size's, given no ids: its step
    advances as the others'). (state, counters, evicted over `split.rows` slots, slots)."""
    z_all = split.rows
    sizes = split.map_sizes()
    group = jnp.asarray([sizes.index(z) if z >= 2 else 0 for z in split.block_sizes], jnp.int32)[s]

    def pad(x, full):  # x's entries, then full's past them
        return jnp.concatenate([x, full[x.shape[0] :]]) if x.shape[0] < full.shape[0] else x

    choices = []
    for z in sizes:
        sub_module = module if z == z_all else dataclasses.replace(module, zch_size=z)
        sub = st._replace(**{f: getattr(st, f)[:z] for f in _SLOT_FIELDS})
        counted, ev = counters, jnp.zeros(z_all, bool)
        if training:
            sub, counted, ev_z = profile_counted(sub_module, sub, counters, ids, owned)
            ev = pad(ev_z, ev)
        full = st._replace(**{f: pad(getattr(sub, f), getattr(st, f)) for f in _SLOT_FIELDS})
        full = full._replace(
            **{f: getattr(sub, f) for f in MCHState._fields if f not in _SLOT_FIELDS}
        )
        choices.append((full, counted, ev, sub_module.remap(sub, ids)))
    out = choices[0]
    for g in range(1, len(choices)):
        out = jax.tree.map(lambda a, b, g=g: jnp.where(group == g, b, a), out, choices[g])
    return out


_SLOT_FIELDS = ("sorted_hi", "sorted_lo", "slots", "counts", "last_access")  # [zch_size] leaves


def _reset_local(spec: ShardedRemapSpec, params, opt_tables, evicted, key):
    """On each device: fresh rows (the table's init, the same draw everywhere) and zero
    per-row state for every slot given to a new id, in the blocks this device stores."""
    configs = {name: config for name, _, _, config in spec.tables}
    masks, limits, blocks = {}, {}, {name: [] for name in evicted}
    for name, split, module, _ in spec.tables:
        mask = evicted[name]  # [1, rows]: this shard's map
        if split.axes:
            mask = jax.lax.all_gather(mask[0], split.axes, tiled=True)  # every shard's, in order
        if split.even:
            masks[name] = mask.reshape(-1)  # over the table's rows
        else:  # each shard's block: the first sizes[s] entries of its map's mask
            mask = mask.reshape(split.shards, split.rows)
            masks[name] = jnp.concatenate(
                [mask[c, :z] for c, z in enumerate(split.block_sizes) if z]
            )
        limits[name] = sum(min(z, module.history_capacity) for z in split.block_sizes if z >= 2)
    for buf in spec.buffers:
        c = jax.lax.axis_index(buf.axes) if buf.axes else 0
        for table, coord, local, r0, rn, c0, cn in buf.blocks:
            if table in blocks:
                blocks[table].append(RowBlock(buf.name, local, r0, rn, c0, cn, here=c == coord))
    return reset_rows(params, opt_tables, masks, key, configs=configs, limits=limits, blocks=blocks)


def _build(spec: ShardedRemapSpec) -> Program:
    """The remap program of `spec`: one jitted `shard_map` (training: profile, map, reset;
    eval: map only)."""
    mesh = spec.mesh
    all_axes = tuple(mesh.axis_names)
    state_specs = {
        name: MCHState(*([_spec_of(mesh, split)] * len(MCHState._fields)))
        for name, split, _, _ in spec.tables
    }
    counter_specs = {name: _spec_of(mesh, split) for name, split, _, _ in spec.tables}
    batch = P(all_axes)
    words_specs = {name: batch for name, _, _, _ in spec.tables}
    body = _map_local(spec)
    if not spec.training:

        def remap_eval(state, values, words, positions):
            counters = {name: jnp.zeros((1, 3), jnp.int32) for name, _, _, _ in spec.tables}
            return body(state, counters, values, words, positions)[2]

        return Program(
            remap=jax.jit(
                jax.shard_map(
                    remap_eval,
                    mesh=mesh,
                    in_specs=(state_specs, batch, words_specs, words_specs),
                    out_specs=batch,
                    check_vma=False,
                )
            )
        )
    param_specs = _placement.param_specs(spec.buffers)
    opt_specs = jax.tree.unflatten(*spec.opt_specs)

    def remap_train(params, opt_tables, state, counters, key, values, words, positions):
        state, counters, values, evicted = body(state, counters, values, words, positions)
        key, draw = jax.random.split(key)
        params, opt_tables = _reset_local(spec, params, opt_tables, evicted, draw)
        return params, opt_tables, state, counters, key, values

    return Program(
        remap=jax.jit(
            jax.shard_map(
                remap_train,
                mesh=mesh,
                in_specs=(
                    param_specs,
                    opt_specs,
                    state_specs,
                    counter_specs,
                    P(),
                    batch,
                    words_specs,
                    words_specs,
                ),
                out_specs=(param_specs, opt_specs, state_specs, counter_specs, P(), batch),
                check_vma=False,
            ),
            donate_argnums=(0, 1, 2, 3, 4),
        )
    )


_PROGRAMS = ProgramCache(_build)
