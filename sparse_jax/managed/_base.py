"""What the unsharded and the sharded managed-collision modules share: the id maps on the
device, their counters and the draw key of fresh rows, and the `SparseModule` contract
delegated to the collection they wrap."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._module import LayoutFacts
from sparse_jax.managed import _hashed
from sparse_jax.managed._batch import ManagedBatch, managed_id_capacity
from sparse_jax.managed._collection import ManagedCollisionCollection
from sparse_jax.managed._frozen import FrozenIdMap, frozen_map
from sparse_jax.managed._id_map import MCHState, RawIds

__all__ = ["ManagedModuleBase", "profile_counted", "profile_counted_remap"]


def profile_counted(module, state: MCHState, counters: jax.Array, ids: RawIds, valid: jax.Array):
    """`module.profile` of one id map, with its counters advanced: (state, int32[3]
    (occupancy, admissions so far, resident ids evicted so far), bool mask of the slots
    given to new ids). A slot given to a new id either held an id (a displacement: the
    occupancy stays) or was empty (the occupancy grows by one), so the displaced count is
    read off the two occupancies, without a scatter over the slots."""
    # the counts are read by the profile call itself: the count before read apart, XLA would
    # keep a copy of the sorted ids (~16 MB at 2^20 slots) for it while the kernel updates
    # them in place
    state, evicted, counts = module.profile_occupied(state, ids, valid=valid)
    return state, _advanced(counters, counts), evicted


def profile_counted_remap(module, state: MCHState, counters: jax.Array, words, valid: jax.Array):
    """`profile_counted`, then the slot of each id (`words`: `[n, 2]`, `RawIds.words()`) on
    the new state (`module.remap`), in one call (`MCHManagedCollisionModule.profile_remap`,
    or `_hashed.profile_remap` for a map in the hashed form): (state, counters, evicted,
    slots)."""
    if isinstance(state, _hashed.MCHHashState):  # (the kernel reads the words as they are)
        state, evicted, counts, slots = _hashed.profile_remap(module, state, words, valid)
    else:
        ids = RawIds.from_words(words)
        state, evicted, counts, slots = module.profile_remap(state, ids, valid=valid)
    return state, _advanced(counters, counts), evicted, slots


def _advanced(counters, counts):
    """The counters after a profile call whose `counts` are (entries before, entries after,
    slots given to new ids)."""
    before, occupancy, admitted = counts[0], counts[1], counts[2]
    displaced = before + admitted - occupancy
    return jnp.stack([occupancy, counters[1] + admitted, counters[2] + displaced])


class ManagedModuleBase(LayoutFacts):
    """What the unsharded and the sharded managed-collision modules share: the id maps
    (`mc_state`, `mc_counters`, the draw key of fresh rows) and the `SparseModule`
    contract delegated to the collection they wrap (`inner`); both forms implement
    `sparse_jax.ManagedSparseModule` (the declared contract). A subclass provides
    `prepare`, `remap`, `remap_eval`, `remap_compile_count`, `stats`, `host_state` and
    `_fresh_maps`."""

    plan = None
    mesh_axes = None

    def __init__(self, mc: ManagedCollisionCollection, inner):
        self.mc, self.inner = mc, inner
        self.layout = inner.layout
        self.prepare_count = 0
        self._table_caps = {
            name: 0 for name in mc.modules
        }  # per managed table: id capacity, never shrinks
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
            self.mc_state, self.mc_counters, self._key = jax.device_put(
                (self.mc_state, self.mc_counters, self._key), device
            )

    @property
    def draw_key(self) -> jax.Array:
        """The key fresh rows are drawn from (advanced by every training remap)."""
        return self._key

    def managed(self) -> ManagedModuleBase:
        """This module: it manages raw ids (`SparseModule.managed`)."""
        return self

    def frozen_maps(self) -> dict[str, FrozenIdMap]:
        """{managed table: its id maps frozen on the host (`FrozenIdMap`), for serving: one
        map, or one per shard for a table managed per shard (an id not resident reads the
        default row of the shard it hashes to). Gathers `host_state()`: on a multi-process
        mesh every process calls it."""
        states = self.host_state()[0]
        return {name: frozen_map(states[name]) for name in self.managed_tables}

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
            raise TypeError(
                "the fused update of a managed-collision module runs on the table rows its training "
                "remap returned, not on the prepared batch"
            )
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

    def load_mc_state(
        self,
        state: Mapping[str, MCHState],
        counters: Mapping | None = None,
        key: jax.Array | None = None,
    ) -> None:
        """Replace the id maps (e.g. from a checkpoint): same tables, shapes and dtypes,
        placed as the current ones. The metadata each table's policy keeps and does not keep
        is settled by `MCHManagedCollisionModule.adopt_metadata` (a map saved under another
        policy, or before each policy kept only its own)."""
        if set(state) != set(self.mc.modules):
            raise ValueError(
                f"managed-collision state names tables {sorted(state)}; this model manages "
                f"{self.managed_tables}"
            )

        def placed(name, what, leaf, old):
            leaf = np.asarray(leaf)
            if leaf.shape != old.shape or leaf.dtype != old.dtype:
                raise ValueError(
                    f"table {name!r}: managed-collision {what} has {leaf.dtype}{list(leaf.shape)}, "
                    f"expected {old.dtype}{list(old.shape)} (zch_size, history_capacity or the "
                    "table's sharding changed?)"
                )
            return jax.make_array_from_callback(
                leaf.shape, old.sharding, lambda index: leaf[index]
            )  # any process

        new = {
            name: MCHState(
                *(
                    placed(name, f, leaf, old)
                    for f, leaf, old in zip(
                        MCHState._fields,
                        self.mc.modules[name].adopt_metadata(s),
                        self.mc_state[name],
                        strict=True,
                    )
                )
            )
            for name, s in state.items()
        }
        if counters is not None:
            self.mc_counters = {
                name: placed(name, "counters", counters[name], self.mc_counters[name])
                for name in self.managed_tables
            }
        self.mc_state = new
        if key is not None:
            self._key = self._place_key(key)
