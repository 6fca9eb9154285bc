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
batch's row streams at the table's row offset); what both forms share is in `_base`, and
the mesh form is `sparse_jax.sharding.ShardedManagedCollisionModule`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._module import PaddedBatch
from sparse_jax._prepare import aligned_zeros
from sparse_jax.managed import _hashed
from sparse_jax.managed._base import ManagedModuleBase, profile_counted_remap
from sparse_jax.managed._batch import ManagedBatch, raw_words_into, split_managed
from sparse_jax.managed._collection import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingCollection,
    ResetTable,
    reset_by_plan,
)
from sparse_jax.managed._id_map import MCHManagedCollisionModule, MCHState, RawIds
from sparse_jax.managed._programs import Program, ProgramCache, committed

__all__ = ["ManagedCollisionSparseModule"]


class ManagedCollisionSparseModule(ManagedModuleBase):
    """`mc` (a `ManagedCollisionEmbeddingBagCollection` or
    `ManagedCollisionEmbeddingCollection` over an unsharded collection) with its id maps, as
    a `SparseModule`.

    One step: `batch = prepare(kjt)` (host work, may run ahead), then `params, opt_state,
    slots = remap(params, opt_state, batch)` (training) or `slots = remap_eval(batch)`,
    then the collection's lookup and fused update on `slots`. `prepare` takes raw ids as
    `[N]` integers (int64, as a TorchRec KJT carries them) or `[N, 2]` int32 words
    (`RawIds.words()`, for a JAX KJT with x64 off); an unmanaged feature's ids are checked
    against its table as usual, a managed feature's may be any int64 but `2**63 - 1`.

    On CPU with the kernels built, the maps of the kernel's policies with at least
    `_hashed.HASHED_MIN_SLOTS` (2^20) slots train in the hashed form (`_hashed`: no moves of
    sorted entries at an eviction; the same slots bit for bit); `mc_state` is always the
    sorted form, read back from it once per training step that changed it. `hashed=True`
    trains every map it can run for hashed (any size), `False` keeps every map sorted.
    """

    def __init__(self, mc: ManagedCollisionCollection, *, hashed: bool | None = None):
        self._maps_lock = threading.RLock()  # `_maps` and `_sorted` change together
        if not isinstance(mc, ManagedCollisionCollection):
            raise TypeError(
                f"ManagedCollisionSparseModule wraps a ManagedCollisionEmbeddingBagCollection or a "
                f"ManagedCollisionEmbeddingCollection, got {type(mc).__name__}"
            )
        self.collection = mc.collection
        self.sequence = isinstance(mc, ManagedCollisionEmbeddingCollection)
        super().__init__(mc, mc.collection)
        # where each managed table's rows are written: (array of the prepared batch, row offset)
        self._target = {
            name: mc.collection.layout.table_group[name] if self.sequence else ("", 0)
            for name in mc.modules
        }
        # the programs, shared by every module of this configuration (`_programs`)
        spec = RemapSpec(
            tuple(
                (name, self.mc.modules[name], *self._target[name]) for name in self.managed_tables
            ),
            self.mc.reset_plan(self.managed_tables),
        )
        self._program = _PROGRAMS.get(spec)
        # the tables whose maps train in the hashed form
        self.hashed_tables = frozenset(
            name
            for name in self.managed_tables
            if hashed is not False and _hashed.hashes(self.mc.modules[name], forced=bool(hashed))
        )

    # -- the id maps: each table's map in its training form (`_maps`: sorted, or hashed once a
    # training step ran), and the sorted form read back from it (`mc_state`) ----------------
    @property
    def mc_state(self) -> dict[str, MCHState]:
        """{managed table: its id map (`MCHState`, the sorted form)}: what checkpoints,
        resharding, export and eval read. A map trained in the hashed form is converted back
        once after each training step that changed it. A new dict each read: replace the maps
        as a whole (`mc_state = maps`, or `load_mc_state`), not one entry of a read."""
        with self._maps_lock:
            if self._sorted is None:
                self._sorted = self._program.unhash(self._maps)
            return dict(self._sorted)

    @mc_state.setter
    def mc_state(self, maps) -> None:
        with self._maps_lock:
            self._maps = self._sorted = dict(maps)

    def _training_maps(self, params):
        """The maps in their training form: the hashed tables' converted once, on first use
        (and every map kept sorted when the tables are not on a CPU device)."""
        if self.hashed_tables and not all(
            d.platform == "cpu" for leaf in jax.tree.leaves(params) for d in leaf.devices()
        ):
            self.mc_state = self.mc_state  # (back to the sorted form, if it had been hashed)
            self.hashed_tables = frozenset()
        if any(isinstance(self._maps[name], MCHState) for name in self.hashed_tables):
            with self._maps_lock:
                self._maps = self._program.hash(self._maps, self.hashed_tables)
        return self._maps

    def _fresh_maps(self):
        return self.mc.init_state(), {name: jnp.zeros(3, jnp.int32) for name in self.mc.modules}

    def remap_compile_count(self) -> int:
        """Programs the remap has compiled (constant in a steady loop), shared by every
        module of this configuration."""
        return self._program.compile_count()

    def host_state(self):
        """(`{table: MCHState}`, `{table: counters}`, draw key data) as host arrays."""
        return (
            jax.tree.map(np.asarray, self.mc_state),
            jax.tree.map(np.asarray, self.mc_counters),
            np.asarray(jax.random.key_data(self._key)),
        )

    # -- the batch ------------------------------------------------------------------------------
    def prepare(self, kjt: KeyedJaggedTensor, *, device: jax.Device | None = None) -> ManagedBatch:
        """Check `kjt` on the host (raw ids as int64 or words; unmanaged features' ids
        against their tables), prepare the collection's batch with a placeholder where ids
        are managed, and place the raw id words beside it. Reads no id map."""
        split = split_managed(kjt, self.mc)
        # the placeholder ids are replaced in the step (`remap`), so no position matrices
        built = {} if self.sequence else dict(positions=False)
        inner = self.collection.prepare(split.ids, device=device, **built)
        arrays = self._targets(inner)
        where = self._stream_positions(split.ids) if self.sequence else None
        words, positions = {}, {}
        for name in self.managed_tables:
            mine = split.positions(name)
            cap = self._capacity(name, len(mine), devices=1)
            # (64-byte aligned: placed without a copy)
            positions[name], words[name] = aligned_zeros((cap, np.int32), ((cap, 2), np.int32))
            dropped = arrays[self._target[name][0]].shape[0]  # the padding's position
            positions[name][len(mine) :] = dropped
            positions[name][: len(mine)] = mine if where is None else where[mine]
            raw_words_into(words[name], split.raw_of(name))
        words, positions = jax.device_put((words, positions), device)
        self.prepare_count += 1
        return ManagedBatch(inner, words, positions)

    def _stream_positions(self, host: KeyedJaggedTensor) -> np.ndarray:
        """Per value of `host`, its position in its buffer's row stream (the order a
        sequence collection's prepare lays its features out in). A managed feature feeds one
        table, so its positions are its own."""
        where = np.zeros(np.asarray(host.values()).shape[0], np.int64)
        start = dict.fromkeys(self.layout.groups, 0)
        for slot, ki in zip(
            self.layout.features, self.layout.key_indices(host.keys()), strict=True
        ):
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
        arrays = self._targets(batch.inner)
        limits = {name: np.int32(arrays[at].shape[0]) for name, (at, _) in self._target.items()}
        params, opt_state = self._committed_beside(params, opt_state)
        maps = self._training_maps(params)
        with self._maps_lock:  # (a reader on another thread sees the maps before or after)
            (params, opt_state, self._maps, self.mc_counters, self._key, slots) = (
                self._program.train(
                    params,
                    opt_state,
                    maps,
                    self.mc_counters,
                    self._key,
                    batch.words,
                    batch.positions,
                    limits,
                )
            )
            self._sorted = None if self.hashed_tables else self._maps
        return (
            params,
            opt_state,
            self._with_targets(batch.inner, self._program.scatter(arrays, batch.positions, slots)),
        )

    def remap_eval(self, batch: ManagedBatch):
        """An eval batch's slot ids (ids not resident read the default row); nothing changes."""
        self._check_batch(batch)
        slots = self._program.eval(self._maps, batch.words)
        arrays = self._program.scatter(self._targets(batch.inner), batch.positions, slots)
        return self._with_targets(batch.inner, arrays)

    def _committed_beside(self, params, opt_state):
        """`params` and `opt_state` committed where they are, and the id maps, counters and
        key committed beside them: the training program's outputs are committed, and jit
        keys its cache on commitment, so fresh (uncommitted) inputs on the first step would
        compile the same program again on the second."""
        params, opt_state = committed((params, opt_state))
        maps = (self._maps, self.mc_counters, self._key)
        if not all(leaf.committed for leaf in jax.tree.leaves(maps)):
            where = jax.tree.leaves(params)[0].sharding
            self.mc_state, self.mc_counters, self._key = jax.tree.map(
                lambda x: x if x.committed else jax.device_put(x, where), (self.mc_state, *maps[1:])
            )
        return params, opt_state

    @staticmethod
    def _check_batch(batch) -> None:
        if not isinstance(batch, ManagedBatch):
            raise TypeError(
                f"remap takes this module's prepared batch (prepare(kjt)), got {type(batch).__name__}"
            )

    def stats(self) -> dict[str, jax.Array]:
        """{managed table: int32[3] device array (slots in use, ids admitted so far, resident
        ids evicted so far)}: read them when you log."""
        return dict(self.mc_counters)


class RemapSpec(NamedTuple):
    """What the remap programs read, static and hashable: per managed table (sorted by
    name) its name, id map module, and the prepared-batch array and row offset its rows are
    written at; and the reset plan of its rows (`ManagedCollisionCollection.reset_plan`)."""

    tables: tuple[tuple[str, MCHManagedCollisionModule, str, int], ...]
    reset: tuple[ResetTable, ...]


def _build(spec: RemapSpec) -> Program:
    """The remap's programs for `spec`: `train` (profile, map and reset: the heavy one, whose
    shapes depend on the tables and each table's id capacity only), `eval` (map only), and
    `scatter` (the rows into the prepared batch's arrays, whose length follows the
    collection's capacity ladder: a new length compiles only this small program); `hash` and
    `unhash` convert maps between the sorted and the hashed form (`_hashed`). `train` and
    `eval` take each table's map in either form."""
    modules = {name: module for name, module, _, _ in spec.tables}

    def remap_eval(state, words):
        out = {}
        for name, module, _, offset in spec.tables:
            ids = RawIds.from_words(words[name])
            if isinstance(state[name], _hashed.MCHHashState):
                out[name] = _hashed.remap(module, state[name], ids) + offset
            else:
                out[name] = module.remap(state[name], ids) + offset
        return out

    def remap_train(params, opt_state, state, counters, key, words, positions, limits):
        state, counters, evicted, slots = dict(state), dict(counters), {}, {}
        for name, module, _, offset in spec.tables:
            valid = positions[name] < limits[name]
            state[name], counters[name], evicted[name], mapped = profile_counted_remap(
                module, state[name], counters[name], words[name], valid
            )
            slots[name] = mapped + offset
        key, draw = jax.random.split(key)
        params, opt_state = reset_by_plan(spec.reset, params, opt_state, evicted, draw)
        return params, opt_state, state, counters, key, slots

    def scatter(arrays, positions, slots):
        arrays = dict(arrays)
        for name, _, at, _ in spec.tables:
            arrays[at] = arrays[at].at[positions[name]].set(slots[name], mode="drop")
        return arrays

    def remap_to_hashed(state, names):
        return {
            name: _hashed.to_hashed(modules[name], m) if name in names else m
            for name, m in state.items()
        }

    def remap_to_sorted(state):
        return {
            name: _hashed.to_sorted(modules[name], m) if isinstance(m, _hashed.MCHHashState) else m
            for name, m in state.items()
        }

    return Program(
        train=jax.jit(remap_train, donate_argnums=(0, 1, 2, 3, 4)),
        eval=jax.jit(remap_eval),
        scatter=jax.jit(scatter),
        hash=jax.jit(remap_to_hashed, static_argnums=1),
        unhash=jax.jit(remap_to_sorted),
    )


_PROGRAMS = ProgramCache(_build)
