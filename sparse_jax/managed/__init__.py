"""Managed collision: raw 64-bit ids mapped to the rows of fixed-size tables, on the device.

TorchRec's managed-collision modules, functional. The concept in its files:

- `_id_map`: one table's id map (`MCHManagedCollisionModule` and its state `MCHState`;
  raw ids as two words, `RawIds`; the plain hashed mode, `hashed_slots`).
- `_hashed`: a map's hashed form (`MCHHashState`: an id-to-slot table, no sorted order),
  how the unsharded module trains its maps on CPU; the same decisions as the sorted form,
  converted back to it for everything else.
- `_collection`: managed-collision tables in front of a table collection
  (`ManagedCollisionEmbeddingBagCollection`, `ManagedCollisionEmbeddingCollection`).
- `_batch`: a managed module's prepared batch (`ManagedBatch`): raw ids checked on the
  host (`split_managed`; `split_raw_ids` adds per-position owner names) and placed as
  words beside the collection's own batch.
- `_base`: what the two managed modules share (the id maps on the device, their counters,
  the contract delegated to the wrapped collection).
- `_unsharded`: such a collection with its id maps as a `SparseModule`
  (`ManagedCollisionSparseModule`), the form a trainer drives.
- `_sharded`: the same on a mesh (`ShardedManagedCollisionModule`, exported from
  `sparse_jax.sharding`, which imports it: it is built on the mesh runtime, so import it
  from there).
- `_programs`: the remap programs, shared by every module of one static configuration
  (keyed by a hashable spec, never by a module) and freed once no module holds them.
- `_reset`: fresh rows and zero optimizer state for the slots given to new ids (one
  routine for the unsharded buffers and each device's blocks of a sharded table).
- `_frozen`: an id map frozen for serving (`FrozenIdMap`).
- `_reshard`: a table's id maps moved onto another split of its rows (`reshard_id_maps`).

The contract a trainer uses is `sparse_jax.ManagedSparseModule` (a Protocol, in
`sparse_jax/_module.py` beside `SparseModule`): every `SparseModule`'s `managed()` returns
the module as one, or None for a plain collection, so nothing outside this folder asks the
type of a module. Both managed modules share `_base.ManagedModuleBase`.

The public names are re-exported from `sparse_jax`.
"""

from sparse_jax.managed._batch import (
    ManagedBatch,
    RawIdSplit,
    managed_id_capacity,
    split_managed,
    split_raw_ids,
)
from sparse_jax.managed._collection import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from sparse_jax.managed._frozen import FrozenIdMap
from sparse_jax.managed._id_map import (
    MCH_STATE_FIELDS,
    MCHManagedCollisionModule,
    MCHState,
    RawIds,
    hashed_slots,
    host_hashed_slots,
)
from sparse_jax.managed._reshard import ReshardedIdMaps, reshard_id_maps
from sparse_jax.managed._unsharded import ManagedCollisionSparseModule

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
    "RawIdSplit",
    "RawIds",
    "ReshardedIdMaps",
    "hashed_slots",
    "host_hashed_slots",
    "managed_id_capacity",
    "reshard_id_maps",
    "split_managed",
    "split_raw_ids",
]
