"""Managed-collision tables in front of a table collection (TorchRec's
`ManagedCollisionEmbeddingBagCollection` and `ManagedCollisionEmbeddingCollection`,
unsharded, functional).

Raw ids travel in the KJT as `[N, 2]` int32 words (`RawIds.words()`: the id's high word, then
its low word's bits), so 64-bit ids pass with jax x64 off. `remap` turns them into slot ids
(an ordinary `[N]` int32 KJT for the collection's lookup and fused update): per managed table
one `MCHManagedCollisionModule` sees all of that table's features as one stream, as
TorchRec's `ManagedCollisionCollection` does. `reset_evicted` gives the slots handed to new
ids fresh rows (the table's `init_fn`, else its uniform init, drawn for those rows only)
and zero optimizer state, so an id evicted and seen again starts over. The pooled and the
sequence form differ only in the collection they wrap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._embedding import EmbeddingCollection
from sparse_jax._embedding_bag import EmbeddingBagCollection
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax.managed._id_map import MCHManagedCollisionModule, MCHState, RawIds
from sparse_jax.managed._reset import RowBlock, reset_rows
from sparse_jax.optim import SparseOptState

__all__ = [
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
]


class ManagedCollisionCollection:
    """A table collection (`collection`) with a managed-collision module per table in
    `managed_collision_modules` ({table name: module}, `zch_size == num_embeddings`); tables
    without one read slot ids directly (their KJT features still arrive as words: the low
    word is the id). Build it through one of its two forms below."""

    kind = "ManagedCollisionCollection"

    def __init__(
        self, collection, managed_collision_modules: Mapping[str, MCHManagedCollisionModule]
    ):
        what = self.kind
        tables = {t.name: t for t in collection.layout.tables}
        for name, module in managed_collision_modules.items():
            if name not in tables:
                raise ValueError(
                    f"{what}: no table {name!r} in the collection (tables: {list(tables)})"
                )
            if module.zch_size != tables[name].num_embeddings:
                raise ValueError(
                    f"{what}: table {name!r} has {tables[name].num_embeddings} rows but its module's "
                    f"zch_size is {module.zch_size}; make them equal"
                )
        readers: dict[str, list[str]] = {}
        for slot in collection.layout.features:
            readers.setdefault(slot.feature, []).append(slot.table)
        for feature, names in readers.items():
            if len(names) > 1 and any(n in managed_collision_modules for n in names):
                raise ValueError(
                    f"{what}: feature {feature!r} feeds tables {names}; a managed table needs features "
                    "of its own (one slot per id and table)"
                )
        self.collection = collection
        self.modules = dict(managed_collision_modules)
        self._feature_table = {feature: names[0] for feature, names in readers.items()}

    def init_state(self) -> dict[str, MCHState]:
        return {name: m.init() for name, m in self.modules.items()}

    def remap(
        self, kjt: KeyedJaggedTensor, state: Mapping[str, MCHState], *, training: bool = True
    ):
        """(KJT of int32 slot ids, new state, {table: bool[rows] slots given to new ids}).
        `kjt`'s values are `[capacity, 2]` words; positions past its ids are padding."""
        words = kjt.values()
        if words.ndim != 2 or words.shape[1] != 2:
            raise ValueError(
                f"{self.kind}.remap: values must be [N, 2] raw id words (RawIds.words()), got shape "
                f"{tuple(words.shape)}"
            )
        ids = RawIds.from_words(words)
        keys, stride = kjt.keys(), kjt.stride()
        pos = jnp.arange(words.shape[0], dtype=jnp.int32)
        bounds = kjt.offsets()[np.arange(len(keys) + 1) * stride]
        key_of = jnp.searchsorted(bounds[1:], pos, side="right").astype(
            jnp.int32
        )  # len(keys): padding
        table_of = np.array([self._feature_table.get(k, "") for k in keys] + [""])
        slots = ids.lo.astype(jnp.int32)  # unmanaged tables: the low word is the row
        new_state, evicted = dict(state), {}
        for name, module in self.modules.items():
            mine = jnp.asarray(table_of == name)[key_of]
            if training:
                new_state[name], evicted[name] = module.profile(state[name], ids, valid=mine)
            else:
                evicted[name] = jnp.zeros(module.zch_size, bool)
            slots = jnp.where(mine, module.remap(new_state[name], ids), slots)
        return kjt._replace(values=slots), new_state, evicted

    def reset_evicted(
        self,
        params: Mapping[str, jax.Array],
        opt_state: SparseOptState,
        evicted: Mapping[str, jax.Array],
        key: jax.Array,
    ):
        """(params, opt_state) with every evicted slot's row drawn afresh and its per-row
        optimizer state zeroed. At most `min(zch_size, history_capacity)` slots change per
        call, so only that many rows are drawn."""
        return reset_by_plan(self.reset_plan(evicted), params, opt_state, evicted, key)

    def reset_plan(self, tables) -> tuple[ResetTable, ...]:
        """The static facts `reset_by_plan` reads for `tables` (names of managed tables): a
        hashable value, equal for equal collections."""
        layout = self.collection.layout
        configs = {t.name: t for t in layout.tables}
        return tuple(
            ResetTable(
                name,
                configs[name],
                *layout.table_group[name],
                min(self.modules[name].zch_size, self.modules[name].history_capacity),
            )
            for name in sorted(tables)
        )


class ResetTable(NamedTuple):
    """One managed table's reset: its config, the buffer and row its rows start at, and at
    most how many rows one call resets."""

    name: str
    config: object
    buffer: str
    buffer_row: int
    limit: int


def reset_by_plan(plan: tuple[ResetTable, ...], params, opt_state: SparseOptState, evicted, key):
    """`ManagedCollisionCollection.reset_evicted` from its static plan (no collection needed)."""
    configs = {t.name: t.config for t in plan}
    blocks = {
        t.name: [
            RowBlock(t.buffer, t.buffer_row, 0, t.config.num_embeddings, 0, t.config.embedding_dim)
        ]
        for t in plan
    }
    params, tables = reset_rows(
        params,
        opt_state.tables,
        evicted,
        key,
        configs=configs,
        limits={t.name: t.limit for t in plan},
        blocks=blocks,
    )
    return params, opt_state._replace(tables=tables)


class ManagedCollisionEmbeddingBagCollection(ManagedCollisionCollection):
    """`ebc` (an `EmbeddingBagCollection`: pooled tables) with managed-collision tables."""

    kind = "ManagedCollisionEmbeddingBagCollection"

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        managed_collision_modules: Mapping[str, MCHManagedCollisionModule],
    ):
        _check_wraps(
            self.kind,
            ebc,
            EmbeddingBagCollection,
            "sequence tables: ManagedCollisionEmbeddingCollection",
        )
        super().__init__(ebc, managed_collision_modules)
        self.ebc = ebc


class ManagedCollisionEmbeddingCollection(ManagedCollisionCollection):
    """`ec` (an `EmbeddingCollection`: one row per id) with managed-collision tables."""

    kind = "ManagedCollisionEmbeddingCollection"

    def __init__(
        self,
        ec: EmbeddingCollection,
        managed_collision_modules: Mapping[str, MCHManagedCollisionModule],
    ):
        _check_wraps(
            self.kind,
            ec,
            EmbeddingCollection,
            "pooled tables: ManagedCollisionEmbeddingBagCollection",
        )
        if ec.need_indices():
            raise ValueError(
                f"{self.kind}: the collection was built with need_indices=True; its outputs would carry "
                "the placeholder ids of the managed features, not their raw ids or slots. Build the "
                "EmbeddingCollection with need_indices=False"
            )
        super().__init__(ec, managed_collision_modules)
        self.ec = ec


def _check_wraps(kind: str, collection, wanted: type, other: str) -> None:
    if not isinstance(collection, wanted):
        raise TypeError(
            f"{kind} wraps an {wanted.__name__}, got {type(collection).__name__} ({other})"
        )
