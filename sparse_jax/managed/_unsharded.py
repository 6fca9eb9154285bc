"""`ManagedCollisionSparseModule`: a managed-collision collection as a `SparseModule`, the
form a trainer (`hybrid.Model`, `hybrid.TrainPipeline`) drives.

It holds the id maps (one `MCHState` per managed table) on the device, as TorchRec's
managed-collision modules hold theirs as buffers. `prepare` does the host work once per
batch (checks, padding, placement: what a pipeline runs one batch ahead): the raw ids are
placed as words beside the collection's prepared batch, whose managed positions hold a
placeholder. `remap` then runs in the step, right before the lookup, as one jitted
program: for a training batch it profiles the ids (the id maps advance), maps them to
slots, and resets the rows the maps gave to new ids (fresh rows, zero optimizer state,
donated buffers), so an id evicted and seen again starts over; for an eval batch it only
maps. The id maps therefore always match the batches whose steps ran (a checkpoint taken
between steps holds them exactly), and no device value is read on the host.

Per table, device counters (`stats()`: occupancy, admissions and evictions so far) are
updated in the same program; a log reads them when it logs, never per step.

This module is the unsharded form (an `EmbeddingBagCollection` or an `EmbeddingCollection`
on one device: the slots are written into the bag batch's values, or into the sequence
batch's row streams at the table's row offset) and the base both forms share; the mesh form
is `sparse_jax.sharding.ShardedManagedCollisionModule`. `FrozenIdMap` is a map frozen for
serving (`hybrid.export`, `hybrid.quantize`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import _validate
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._module import LayoutFacts, PaddedBatch, PreparedBatch
from sparse_jax._prepare import host_kjt
from sparse_jax.managed._collection import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingCollection,
)
from sparse_jax.managed._id_map import _HI_MAX, _LO_MAX, MCHState, RawIds

__all__ = ["FrozenIdMap", "ManagedBatch", "ManagedCollisionSparseModule", "ManagedSparseModule", "managed_id_capacity",
           "profile_counted", "split_raw_ids"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ManagedBatch(PreparedBatch):
    """A managed module's prepared batch, before `remap`: the wrapped collection's own
    prepared batch (`inner`: a `PaddedBatch`, or a sharded collection's `LocalBatches`, with
    a placeholder where ids are managed) and per managed table its raw ids as int32 words
    with their positions in `inner`'s values: `[cap, 2]` and `[cap]` unsharded, `[devices,
    cap, 2]` and `[devices, cap]` on a mesh (`cap`: the table's own capacity per device, a
    power of two; padding positions point past the values and are dropped)."""

    inner: PreparedBatch
    words: dict[str, jax.Array]
    positions: dict[str, jax.Array]

    @property
    def stride(self) -> int:
        return self.inner.stride


def _raw_ids(values: np.ndarray) -> np.ndarray:
    """int64 raw ids from a batch's values: `[N]` integers (int64 ids as TorchRec carries
    them) or `[N, 2]` int32 words (`RawIds.words()`, how a JAX KJT carries them with x64 off)."""
    if values.ndim == 2 and values.shape[1] == 2 and values.dtype == np.int32:
        return (values[:, 0].astype(np.int64) << 32) | values[:, 1].view(np.uint32).astype(np.int64)
    if values.ndim == 1 and values.dtype.kind in "iu":
        if values.dtype == np.uint64 and values.size and values.max() > np.iinfo(np.int64).max:
            raise ValueError("a managed-collision batch: uint64 ids above 2**63 - 1 do not fit int64")
        return values.astype(np.int64)
    raise ValueError(f"a managed-collision batch carries raw ids as [N] integers (int64 ids, as TorchRec) or [N, 2] "
                     f"int32 words (RawIds.words()), got {values.dtype} values of shape {tuple(values.shape)}")


def split_raw_ids(kjt: KeyedJaggedTensor, mc: ManagedCollisionCollection):
    """A batch of raw ids checked on the host: (the KJT with a placeholder 0 at every managed
    position and unmanaged ids as int32, for the collection's own checks and layout; the
    raw int64 id of every position; the managed table of every position, "" if none)."""
    host = host_kjt(kjt)
    if host.variable_stride_per_key():
        raise ValueError("a managed-collision batch needs one stride for every key; expand the KJT first "
                         "(KeyedJaggedTensor.expand_to_batch)")
    raw = _raw_ids(np.asarray(host.values()))
    keys, stride = host.keys(), host.stride()
    lengths = np.asarray(host.lengths(), np.int64).reshape(len(keys), stride) if keys else np.zeros((0, stride))
    per_key = lengths.sum(axis=1)
    n = int(per_key.sum())
    tables = np.array([mc._feature_table.get(k, "") if mc._feature_table.get(k) in mc.modules else ""
                       for k in keys] + [""], dtype=object)
    owner = tables[np.repeat(np.arange(len(keys)), per_key)]
    raw = raw[:n]
    reserved = (owner != "") & (raw == np.iinfo(np.int64).max)
    if reserved.any():
        where = _validate.locate(int(np.flatnonzero(reserved)[0]), np.asarray(host.lengths()), keys, stride)
        raise ValueError(f"id 2**63 - 1 at {where} is reserved (it marks an empty slot of a managed-collision "
                         "table); map it to another id")
    plain = np.where(owner != "", 0, raw)
    wide = (plain < np.iinfo(np.int32).min) | (plain > np.iinfo(np.int32).max)
    if wide.any():
        bad = int(np.flatnonzero(wide)[0])
        where = _validate.locate(bad, np.asarray(host.lengths()), keys, stride)
        raise ValueError(f"id {int(raw[bad])} at {where} is a raw 64-bit id but its table has no managed-collision "
                         "module; give the table one (managed_collision_modules) or map its ids into the table's "
                         "rows")
    return host._replace(values=plain.astype(np.int32)), raw, owner


class FrozenIdMap(NamedTuple):
    """A managed table's id map frozen for serving (`hybrid.export` writes it; the server
    reads it with numpy only: `hybrid.serving`): the resident raw ids ascending (int64), the
    table row of each (int32), and the default row, the row of the last slot of a shard of
    `default_row + 1` rows. With `shards > 1` (a row-wise table managed per shard) an id
    not resident reads the default row of the shard it hashes to (`hashed_slots(id,
    shards)`), as the training module reads it."""

    ids: np.ndarray
    rows: np.ndarray
    default_row: int
    shards: int = 1


def frozen_map(states: MCHState, shard_rows: int) -> FrozenIdMap:
    """The `FrozenIdMap` of a table's id maps stacked one per shard (`[shards, ...]` host
    arrays; shard s owns rows `s * shard_rows` on). Each id is resident in one shard at most."""
    raw = RawIds(np.asarray(states.sorted_hi), np.asarray(states.sorted_lo)).to_int64()
    rows = np.asarray(states.slots, np.int64) + np.arange(raw.shape[0])[:, None] * shard_rows
    resident = raw != np.iinfo(np.int64).max
    ids, rows = raw[resident], rows[resident]
    order = np.argsort(ids, kind="stable")
    return FrozenIdMap(ids[order], rows[order].astype(np.int32), shard_rows - 1, raw.shape[0])


def managed_id_capacity(count: int) -> int:
    """The id capacity a managed table's ids are padded to on a device holding `count` of
    them: a power of two, at least 8 (a window of `eviction_interval` batches holds that
    many per device)."""
    return max(8, 1 << max(0, count - 1).bit_length())


def _occupied(state: MCHState, zch_size: int) -> jax.Array:
    """bool[zch_size]: the slots an id holds (the reserved default slot never counts)."""
    empty = (state.sorted_hi == _HI_MAX) & (state.sorted_lo == _LO_MAX)
    return jnp.zeros(zch_size, bool).at[state.slots].set(~empty)


def profile_counted(module, state: MCHState, counters: jax.Array, ids: RawIds, valid: jax.Array):
    """`module.profile` of one id map, with its counters advanced: (state, int32[3]
    (occupancy, admissions so far, resident ids evicted so far), bool mask of the slots
    given to new ids)."""
    before = _occupied(state, module.zch_size)
    state, evicted = module.profile(state, ids, valid=valid)
    occupancy = jnp.sum(_occupied(state, module.zch_size).astype(jnp.int32))
    admitted = jnp.sum(evicted.astype(jnp.int32))
    displaced = jnp.sum((evicted & before).astype(jnp.int32))
    return state, jnp.stack([occupancy, counters[1] + admitted, counters[2] + displaced]), evicted


class ManagedSparseModule(LayoutFacts):
    """What the unsharded and the sharded managed-collision modules share: the id maps
    (`mc_state`, `mc_counters`, the draw key of fresh rows) and the `SparseModule`
    contract delegated to the collection they wrap (`inner`). A subclass provides
    `prepare`, `remap`, `remap_eval`, `remap_compile_count`, `stats`, `frozen_maps`,
    `host_state` and `_fresh_maps`."""

    plan = None
    mesh_axes = None

    def __init__(self, mc: ManagedCollisionCollection, inner):
        self.mc, self.inner = mc, inner
        self.layout = inner.layout
        self.prepare_count = 0
        self._table_caps = {name: 0 for name in mc.modules}  # per managed table: id capacity, never shrinks
        self.mc_state, self.mc_counters = self._fresh_maps()
        self._key = self._place_key(jax.random.key(0))

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """The collection's fresh tables; the id maps start empty and evicted rows are
        drawn from a key derived from `key`."""
        self._key = self._place_key(jax.random.fold_in(key, 0x4D43))
        self.mc_state, self.mc_counters = self._fresh_maps()
        return self.inner.init(key)

    def _capacity(self, name: str, count: int, *, devices: int) -> int:
        """Table `name`'s id capacity per device for a batch with at most `count` of its ids
        on a device: a power of two (>= 8) that never shrinks, so steady training compiles
        once, but whose high-water mark stays within what a training window holds (an eval
        batch larger than any training batch gets its own shape and leaves the training
        shape alone; a training batch that large is refused by the window)."""
        module = self.mc.modules[name]
        fits = max(8, module.history_capacity // (module.eviction_interval * devices))
        need = managed_id_capacity(count)
        high = max(self._table_caps[name], need)
        self._table_caps[name] = high
        return max(need, min(high, fits))

    def place_maps(self, device: jax.Device | None) -> None:
        """Commit the id maps, counters and draw key to `device` (where the tables are), so a
        map loaded before the first step lands there too."""
        if device is not None:
            self.mc_state, self.mc_counters, self._key = jax.device_put((self.mc_state, self.mc_counters, self._key),
                                                                        device)

    @property
    def draw_key(self) -> jax.Array:
        """The key fresh rows are drawn from (advanced by every training remap)."""
        return self._key

    def needs_remap(self, batch) -> bool:
        """Whether `batch` is this kind of module's prepared batch, not yet mapped to rows."""
        return isinstance(batch, ManagedBatch)

    def _place_key(self, key):
        return key  # where the tables are: one device unsharded (the sharded module replicates it)

    def apply(self, params, batch):
        """The forward on table rows (`remap`'s batch); a raw KJT or a prepared batch not
        yet remapped is mapped read-only first (as eval: the id maps do not change)."""
        if isinstance(batch, KeyedJaggedTensor):
            batch = self.prepare(batch)
        if self.needs_remap(batch):
            batch = self.remap_eval(batch)
        return self.inner.apply(params, batch)

    def update_operands(self, batch, grad):
        if self.needs_remap(batch):
            raise TypeError("the fused update of a managed-collision module runs on the table rows its training "
                            "remap returned, not on the prepared batch")
        return self.inner.update_operands(batch, grad)

    def update_step(self, rule):
        return self.inner.update_step(rule)

    def table_weights(self, params):
        return self.inner.table_weights(params)

    def with_table_weights(self, params, weights):
        return self.inner.with_table_weights(params, weights)

    def stored_blocks(self):
        return self.inner.stored_blocks()

    def lookup_compile_count(self) -> int:
        return self.inner.lookup_compile_count()

    def is_weighted(self) -> bool:
        return self.inner.is_weighted()

    @property
    def bounds_check(self) -> str:
        return self.inner.bounds_check

    @property
    def managed_tables(self) -> list[str]:
        return sorted(self.mc.modules)

    def load_mc_state(self, state: Mapping[str, MCHState], counters: Mapping | None = None,
                      key: jax.Array | None = None) -> None:
        """Replace the id maps (e.g. from a checkpoint): same tables, shapes and dtypes,
        placed as the current ones."""
        if set(state) != set(self.mc.modules):
            raise ValueError(f"managed-collision state names tables {sorted(state)}; this model manages "
                             f"{self.managed_tables}")

        def placed(name, what, leaf, old):
            leaf = np.asarray(leaf)
            if leaf.shape != old.shape or leaf.dtype != old.dtype:
                raise ValueError(f"table {name!r}: managed-collision {what} has {leaf.dtype}{list(leaf.shape)}, "
                                 f"expected {old.dtype}{list(old.shape)} (zch_size, history_capacity or the "
                                 "table's sharding changed?)")
            return jax.make_array_from_callback(leaf.shape, old.sharding, lambda index: leaf[index])  # any process

        new = {name: MCHState(*(placed(name, f, leaf, old) for f, leaf, old in
                                zip(MCHState._fields, s, self.mc_state[name], strict=True)))
               for name, s in state.items()}
        if counters is not None:
            self.mc_counters = {name: placed(name, "counters", counters[name], self.mc_counters[name])
                                for name in self.managed_tables}
        self.mc_state = new
        if key is not None:
            self._key = self._place_key(key)


class ManagedCollisionSparseModule(ManagedSparseModule):
    """`mc` (a `ManagedCollisionEmbeddingBagCollection` or
    `ManagedCollisionEmbeddingCollection` over an unsharded collection) with its id maps, as
    a `SparseModule`.

    One step: `batch = prepare(kjt)` (host work, may run ahead), then `params, opt_state,
    slots = remap(params, opt_state, batch)` (training) or `slots = remap_eval(batch)`,
    then the collection's lookup and fused update on `slots`. `prepare` takes raw ids as
    `[N]` integers (int64, as a TorchRec KJT carries them) or `[N, 2]` int32 words
    (`RawIds.words()`, for a JAX KJT with x64 off); an unmanaged feature's ids are checked
    against its table as usual, a managed feature's may be any int64 but `2**63 - 1`.
    """

    def __init__(self, mc: ManagedCollisionCollection):
        if not isinstance(mc, ManagedCollisionCollection):
            raise TypeError(f"ManagedCollisionSparseModule wraps a ManagedCollisionEmbeddingBagCollection or a "
                            f"ManagedCollisionEmbeddingCollection, got {type(mc).__name__}")
        self.collection = mc.collection
        self.sequence = isinstance(mc, ManagedCollisionEmbeddingCollection)
        super().__init__(mc, mc.collection)
        # where each managed table's rows are written: (array of the prepared batch, row offset)
        self._target = {name: mc.collection.layout.table_group[name] if self.sequence else ("", 0)
                        for name in mc.modules}
        self._remap_train = jax.jit(self._remap_program(training=True), donate_argnums=(0, 1, 2, 3, 4))
        self._remap_eval = jax.jit(self._remap_program(training=False))

    def _fresh_maps(self):
        return self.mc.init_state(), {name: jnp.zeros(3, jnp.int32) for name in self.mc.modules}

    def remap_compile_count(self) -> int:
        """Programs the remap has compiled (constant in a steady loop)."""
        return self._remap_train._cache_size() + self._remap_eval._cache_size()

    def frozen_maps(self) -> dict[str, FrozenIdMap]:
        """{managed table: its id map frozen on the host (`FrozenIdMap`), for serving}."""
        return {name: frozen_map(jax.tree.map(lambda x: np.asarray(x)[None], self.mc_state[name]),
                                 self.mc.modules[name].zch_size) for name in self.managed_tables}

    def host_state(self):
        """(`{table: MCHState}`, `{table: counters}`, draw key data) as host arrays."""
        return (jax.tree.map(np.asarray, self.mc_state), jax.tree.map(np.asarray, self.mc_counters),
                np.asarray(jax.random.key_data(self._key)))

    # -- the batch ------------------------------------------------------------------------------
    def prepare(self, kjt: KeyedJaggedTensor, *, device: jax.Device | None = None) -> ManagedBatch:
        """Check `kjt` on the host (raw ids as int64 or words; unmanaged features' ids
        against their tables), prepare the collection's batch with a placeholder where ids
        are managed, and place the raw id words beside it. Reads no id map."""
        ids, raw, owner = split_raw_ids(kjt, self.mc)
        inner = self.collection.prepare(ids, device=device)
        arrays = self._targets(inner)
        where = self._stream_positions(ids) if self.sequence else np.arange(raw.shape[0])
        words, positions = {}, {}
        for name in self.managed_tables:
            mine = np.flatnonzero(owner == name)
            cap = self._capacity(name, len(mine), devices=1)
            positions[name] = np.full(cap, arrays[self._target[name][0]].shape[0], np.int32)  # padding: dropped
            positions[name][: len(mine)] = where[mine]
            words[name] = np.zeros((cap, 2), np.int32)
            words[name][: len(mine)] = RawIds.from_int64(raw[mine]).words()
        words, positions = jax.device_put((words, positions), device)
        self.prepare_count += 1
        return ManagedBatch(inner, words, positions)

    def _stream_positions(self, host: KeyedJaggedTensor) -> np.ndarray:
        """Per value of `host`, its position in its buffer's row stream (the order a
        sequence collection's prepare lays its features out in). A managed feature feeds one
        table, so its positions are its own."""
        where = np.zeros(np.asarray(host.values()).shape[0], np.int64)
        start = dict.fromkeys(self.layout.groups, 0)
        for slot, ki in zip(self.layout.features, self.layout.key_indices(host.keys()), strict=True):
            a, b = host._key_slice(ki)
            where[a:b] = start[slot.group] + np.arange(b - a)
            start[slot.group] += b - a
        return where

    def _targets(self, inner) -> dict[str, jax.Array]:
        """The arrays of a prepared batch that hold row ids: a sequence collection's row
        stream per buffer, a bag collection's KJT values."""
        return dict(inner.rows) if self.sequence else {"": inner.kjt.values()}

    def _with_targets(self, inner, arrays):
        if self.sequence:
            return dataclasses.replace(inner, rows=arrays)
        return PaddedBatch(inner.kjt._replace(values=arrays[""]))

    # -- in the step ----------------------------------------------------------------------------
    def remap(self, params, opt_state, batch: ManagedBatch):
        """A training batch's remap: `(params, opt_state, slot batch)`. The id maps profile
        the batch and advance; the rows given to new ids are reset in the donated params
        and optimizer state; the slot batch is what the lookup and the fused update take."""
        self._check_batch(batch)
        (params, opt_state, self.mc_state, self.mc_counters, self._key, arrays) = self._remap_train(
            params, opt_state, self.mc_state, self.mc_counters, self._key, self._targets(batch.inner), batch.words,
            batch.positions)
        return params, opt_state, self._with_targets(batch.inner, arrays)

    def remap_eval(self, batch: ManagedBatch):
        """An eval batch's slot ids (ids not resident read the default row); nothing changes."""
        self._check_batch(batch)
        arrays = self._remap_eval(self.mc_state, self._targets(batch.inner), batch.words, batch.positions)
        return self._with_targets(batch.inner, arrays)

    @staticmethod
    def _check_batch(batch) -> None:
        if not isinstance(batch, ManagedBatch):
            raise TypeError(f"remap takes this module's prepared batch (prepare(kjt)), got {type(batch).__name__}")

    def _remap_program(self, *, training: bool):
        tables = self.managed_tables
        modules = [self.mc.modules[name] for name in tables]

        def remap_eval(state, arrays, words, positions):
            arrays = dict(arrays)
            for name, module in zip(tables, modules, strict=True):
                at, offset = self._target[name]
                slots = module.remap(state[name], RawIds.from_words(words[name]))
                arrays[at] = arrays[at].at[positions[name]].set(slots + offset, mode="drop")
            return arrays

        def remap_train(params, opt_state, state, counters, key, arrays, words, positions):
            state, counters, evicted, arrays = dict(state), dict(counters), {}, dict(arrays)
            for name, module in zip(tables, modules, strict=True):
                at, offset = self._target[name]
                ids, valid = RawIds.from_words(words[name]), positions[name] < arrays[at].shape[0]
                state[name], counters[name], evicted[name] = profile_counted(module, state[name], counters[name],
                                                                             ids, valid)
                slots = module.remap(state[name], ids)
                arrays[at] = arrays[at].at[positions[name]].set(slots + offset, mode="drop")
            key, draw = jax.random.split(key)
            params, opt_state = self.mc.reset_evicted(params, opt_state, evicted, draw)
            return params, opt_state, state, counters, key, arrays

        return remap_train if training else remap_eval

    def stats(self) -> dict[str, jax.Array]:
        """{managed table: int32[3] device array (slots in use, ids admitted so far, resident
        ids evicted so far)}: read them when you log."""
        return dict(self.mc_counters)
