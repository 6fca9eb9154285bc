"""`ManagedCollisionSparseModule`: a managed-collision collection as a `SparseModule`, the
form a trainer (`hybrid.Model`, `hybrid.TrainPipeline`) drives.

It holds the id maps (one `MCHState` per managed table) on the device, as TorchRec's
managed-collision modules hold theirs as buffers, and advances them in `prepare`: the
batch's raw id words are placed next to the collection's prepared batch and one jitted
program profiles (training) and remaps them into slot ids. So the remapping runs where
TorchRec's sharded MC-EBC runs it (in the input stage a pipeline runs one batch ahead),
on the device, and no device value is read on the host. The prepared batch carries the
slots each table gave to new ids; the trainer resets those rows and their optimizer
state (`reset_evicted_rows`) right before that batch's lookup, after the previous
batch's update, so an id evicted and seen again starts from a fresh row.

Per table, device counters (`stats()`: occupancy, admissions and evictions so far) are
updated in the same program; a log reads them when it logs, never per step.

Unsharded only (an `EmbeddingBagCollection` on one device): a sharded managed table is
not built yet (docs/torchrec_compat.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import _validate
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._managed_collision import _HI_MAX, _LO_MAX, MCHState, RawIds
from sparse_jax._mc_collection import ManagedCollisionEmbeddingBagCollection
from sparse_jax._module import LayoutFacts, PaddedBatch, PreparedBatch
from sparse_jax._prepare import host_kjt

__all__ = ["ManagedBatch", "ManagedCollisionSparseModule"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ManagedBatch(PreparedBatch):
    """A managed collection's prepared batch: slot ids in `padded` (the collection's own
    prepared batch), and per managed table the bool[zch_size] mask of slots this batch's
    profile gave to new ids (None when it was prepared for eval: nothing changed)."""

    padded: PaddedBatch
    evicted: dict[str, jax.Array] | None

    @property
    def stride(self) -> int:
        return self.padded.stride


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


def _occupied(state: MCHState, zch_size: int) -> jax.Array:
    """bool[zch_size]: the slots an id holds (the reserved default slot never counts)."""
    empty = (state.sorted_hi == _HI_MAX) & (state.sorted_lo == _LO_MAX)
    return jnp.zeros(zch_size, bool).at[state.slots].set(~empty)


class ManagedCollisionSparseModule(LayoutFacts):
    """`mc` (a `ManagedCollisionEmbeddingBagCollection` over an unsharded
    `EmbeddingBagCollection`) with its id maps, as a `SparseModule`.

    `prepare(kjt, training=True)` takes a KJT whose values are `[N, 2]` int32 raw id words
    (`RawIds.words()`; `hybrid` converts int64 ids itself); an unmanaged feature's ids are
    checked against its table as usual, a managed feature's ids may be any int64 except
    `2**63 - 1`.
    """

    plan = None
    mesh_axes = None

    def __init__(self, mc: ManagedCollisionEmbeddingBagCollection):
        if not isinstance(mc, ManagedCollisionEmbeddingBagCollection):
            raise TypeError(f"ManagedCollisionSparseModule wraps a ManagedCollisionEmbeddingBagCollection, got "
                            f"{type(mc).__name__}")
        self.mc, self.ebc = mc, mc.ebc
        self.layout = mc.ebc.layout
        self.prepare_count = 0
        self._unreset: dict[int, dict] = {}  # training batches whose evicted rows are not reset yet
        self._managed_features = {f for f, t in mc._feature_table.items() if t in mc.modules}
        self.mc_state: dict[str, MCHState] = mc.init_state()
        self._counters = {name: jnp.zeros(3, jnp.int32) for name in mc.modules}
        self._key = jax.random.key(0)
        self._remap_train = jax.jit(self._remap_program(training=True), donate_argnums=(0, 1))
        self._remap_eval = jax.jit(self._remap_program(training=False))
        self._reset = jax.jit(self._reset_program, donate_argnums=(0, 1, 3))

    # -- the contract, delegated ----------------------------------------------------------------
    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """The collection's fresh tables; the id maps start empty and evicted rows are
        drawn from a key derived from `key`."""
        self._key = jax.random.fold_in(key, 0x4D43)
        self.mc_state = self.mc.init_state()
        self._counters = {name: jnp.zeros(3, jnp.int32) for name in self.mc.modules}
        return self.ebc.init(key)

    def apply(self, params, batch):
        if not isinstance(batch, ManagedBatch):
            batch = self.prepare(batch, training=False)
        return self.ebc.apply(params, batch.padded)

    def update_operands(self, batch: ManagedBatch, grad):
        return self.ebc.update_operands(batch.padded, grad)

    def update_step(self, rule):
        return self.ebc.update_step(rule)

    def table_weights(self, params):
        return self.ebc.table_weights(params)

    def with_table_weights(self, params, weights):
        return self.ebc.with_table_weights(params, weights)

    def stored_blocks(self):
        return self.ebc.stored_blocks()

    def lookup_compile_count(self) -> int:
        return self.ebc.lookup_compile_count()

    @property
    def managed_tables(self) -> list[str]:
        return sorted(self.mc.modules)

    # -- the batch ------------------------------------------------------------------------------
    def prepare(self, kjt: KeyedJaggedTensor, *, device: jax.Device | None = None,
                training: bool = True) -> ManagedBatch:
        """Check `kjt` (raw id words) on the host, prepare the collection's batch with
        placeholder ids where ids are managed, place the words beside it and remap them on
        the device (profiling them first when `training`: the id maps advance)."""
        host = host_kjt(kjt)
        if host.variable_stride_per_key():
            raise ValueError("a managed-collision batch needs one stride for every key; expand the KJT first "
                             "(KeyedJaggedTensor.expand_to_batch)")
        raw = _raw_ids(np.asarray(host.values()))
        keys, stride = host.keys(), host.stride()
        lengths = np.asarray(host.lengths(), np.int64).reshape(len(keys), stride) if keys else np.zeros((0, stride))
        per_key = lengths.sum(axis=1)
        key_of = np.repeat(np.arange(len(keys)), per_key)
        n = int(per_key.sum())
        managed = np.isin(np.asarray(keys, dtype=object)[key_of], list(self._managed_features)) if n else \
            np.zeros(0, bool)
        raw = raw[:n]
        plain = np.where(managed, 0, raw)
        wide = ~managed & ((plain < np.iinfo(np.int32).min) | (plain > np.iinfo(np.int32).max))
        if wide.any():
            bad = int(np.flatnonzero(wide)[0])
            where = _validate.locate(bad, np.asarray(host.lengths()), keys, stride)
            raise ValueError(f"id {int(raw[bad])} at {where} is a raw 64-bit id but its table has no managed-collision "
                             "module; give the table one (managed_collision_modules) or map its ids into the table's "
                             "rows")
        ids = host._replace(values=plain.astype(np.int32))  # placeholder 0 where managed
        padded = self.ebc.prepare(ids, device=device)
        capacity = padded.kjt.values().shape[0]
        table_index = np.full(capacity, -1, np.int32)
        order = {name: i for i, name in enumerate(self.managed_tables)}
        feature_table = np.array([order.get(self.mc._feature_table.get(k, ""), -1) for k in keys] or [-1], np.int32)
        table_index[:n] = np.where(managed, feature_table[key_of] if n else 0, -1)
        padded_words = np.zeros((capacity, 2), np.int32)
        padded_words[:n] = RawIds.from_int64(np.where(managed, raw, 0)).words()
        placed = jax.device_put((padded_words, table_index), device)
        if training:
            self.mc_state, self._counters, values, evicted = self._remap_train(
                self.mc_state, self._counters, padded.kjt.values(), *placed)
            self._unreset[id(evicted)] = evicted
        else:
            values, evicted = self._remap_eval(self.mc_state, padded.kjt.values(), *placed), None
        self.prepare_count += 1
        return ManagedBatch(PaddedBatch(padded.kjt._replace(values=values)), evicted)

    def _remap_program(self, *, training: bool):
        tables = self.managed_tables
        modules = [self.mc.modules[name] for name in tables]

        def remap_eval(state, values, words, table_index):
            ids = RawIds.from_words(words)
            for i, (name, module) in enumerate(zip(tables, modules, strict=True)):
                values = jnp.where(table_index == i, module.remap(state[name], ids), values)
            return values

        def remap_train(state, counters, values, words, table_index):
            ids = RawIds.from_words(words)
            state, counters, evicted = dict(state), dict(counters), {}
            for i, (name, module) in enumerate(zip(tables, modules, strict=True)):
                before = _occupied(state[name], module.zch_size)
                state[name], evicted[name] = module.profile(state[name], ids, valid=table_index == i)
                occupancy = jnp.sum(_occupied(state[name], module.zch_size).astype(jnp.int32))
                admitted = jnp.sum(evicted[name].astype(jnp.int32))
                displaced = jnp.sum((evicted[name] & before).astype(jnp.int32))
                counters[name] = jnp.stack([occupancy, counters[name][1] + admitted, counters[name][2] + displaced])
                values = jnp.where(table_index == i, module.remap(state[name], ids), values)
            return state, counters, values, evicted

        return remap_train if training else remap_eval

    # -- what the trainer calls around the lookup -------------------------------------------------
    def _reset_program(self, params, opt_state, evicted, key):
        key, draw = jax.random.split(key)
        params, opt_state = self.mc.reset_evicted(params, opt_state, evicted, draw)
        return params, opt_state, key

    def reset_evicted_rows(self, params, opt_state, batch: ManagedBatch):
        """(params, opt_state) with the rows of the slots `batch`'s profile gave to new ids
        drawn afresh and their optimizer state zeroed (donated). Once per batch: a second
        lookup of the same batch, or an eval batch, changes nothing. A training batch that is
        prepared but never looked up leaves its new ids on their slots' old rows."""
        if not isinstance(batch, ManagedBatch) or self._unreset.pop(id(batch.evicted), None) is None:
            return params, opt_state  # an eval batch, or its rows were reset at its first lookup
        params, opt_state, self._key = self._reset(params, opt_state, batch.evicted, self._key)
        return params, opt_state

    def stats(self) -> dict[str, jax.Array]:
        """{managed table: int32[3] device array (slots in use, ids admitted so far, resident
        ids evicted so far)}: read them when you log."""
        return dict(self._counters)

    def load_mc_state(self, state: Mapping[str, MCHState], counters: Mapping | None = None,
                      key: jax.Array | None = None) -> None:
        """Replace the id maps (e.g. from a checkpoint): same tables, shapes and dtypes."""
        if set(state) != set(self.mc.modules):
            raise ValueError(f"managed-collision state names tables {sorted(state)}; this model manages "
                             f"{self.managed_tables}")
        new = {}
        for name, s in state.items():
            ref = self.mc_state[name]
            fields = {}
            for field, leaf in zip(MCHState._fields, s, strict=True):
                old = getattr(ref, field)
                leaf = np.asarray(leaf)
                if leaf.shape != old.shape or leaf.dtype != old.dtype:
                    raise ValueError(f"table {name!r}: managed-collision {field} has {leaf.dtype}{list(leaf.shape)}, "
                                     f"expected {old.dtype}{list(old.shape)} (zch_size or history_capacity changed?)")
                fields[field] = jax.device_put(leaf, old.sharding)
            new[name] = MCHState(**fields)
        self.mc_state = new
        if counters is not None:
            self._counters = {name: jnp.asarray(np.asarray(counters[name], np.int32)) for name in self.managed_tables}
        if key is not None:
            self._key = key
