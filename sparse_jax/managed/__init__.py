"""Managed collision: raw 64-bit ids mapped to the rows of fixed-size tables, on the device.

TorchRec's managed-collision modules, functional. The concept in its files:

- `_id_map`: one table's id map (`MCHManagedCollisionModule` and its state `MCHState`;
  raw ids as two words, `RawIds`; the plain hashed mode, `hashed_slots`).
- `_collection`: managed-collision tables in front of a table collection
  (`ManagedCollisionEmbeddingBagCollection`, `ManagedCollisionEmbeddingCollection`).
- `_unsharded`: such a collection with its id maps as a `SparseModule`
  (`ManagedCollisionSparseModule`), the form a trainer drives.
- `_sharded`: the same on a mesh (`ShardedManagedCollisionModule`, exported from
  `sparse_jax.sharding`: it is built on the mesh runtime).
- `_reshard`: a table's id maps moved onto another split of its rows (`reshard_id_maps`).

The public names are re-exported from `sparse_jax`.
"""

from sparse_jax.managed._collection import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from sparse_jax.managed._id_map import (
    MCH_STATE_FIELDS,
    MCHManagedCollisionModule,
    MCHState,
    RawIds,
    hashed_slots,
    host_hashed_slots,
)
from sparse_jax.managed._reshard import ReshardedIdMaps, reshard_id_maps
from sparse_jax.managed._unsharded import (
    FrozenIdMap,
    ManagedBatch,
    ManagedCollisionSparseModule,
    ManagedSparseModule,
    managed_id_capacity,
    split_raw_ids,
)

__all__ = [
    "FrozenIdMap",
    "MCH_STATE_FIELDS",
    "MCHManagedCollisionModule",
    "MCHState",
    "ManagedBatch",
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "ManagedCollisionSparseModule",
    "ManagedSparseModule",
    "RawIds",
    "ReshardedIdMaps",
    "hashed_slots",
    "host_hashed_slots",
    "managed_id_capacity",
    "reshard_id_maps",
    "split_raw_ids",
]
