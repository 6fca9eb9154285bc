"""sparse_jax: jagged features, embedding tables, fused sparse optimizers and their sharding, in JAX.

Never imports torch. Names follow TorchRec where the concept is the same.
"""

from sparse_jax._capacity import DEFAULT_LADDER, capacity_for, length_cap, length_caps, make_ladder
from sparse_jax._configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from sparse_jax._embedding import EmbeddingCollection
from sparse_jax._embedding_bag import EmbeddingBagCollection
from sparse_jax._jagged import JaggedTensor, KeyedJaggedTensor, jt_is_equal, kjt_is_equal
from sparse_jax._kernels import cpu_kernels_problem
from sparse_jax._keyed_tensor import KeyedTensor
from sparse_jax._module import (
    ManagedSparseModule,
    PaddedBatch,
    PreparedBatch,
    SparseModule,
    StoredBlock,
)
from sparse_jax._quant import (
    WEIGHT_TYPES,
    dequantize_rows,
    quantize_rows,
    quantized_pooled_lookup,
    row_bytes,
)
from sparse_jax._quant_collection import QuantEmbeddingBagCollection
from sparse_jax._update import make_update
from sparse_jax.managed import (
    MCH_STATE_FIELDS,
    FrozenIdMap,
    ManagedBatch,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    ManagedCollisionSparseModule,
    MCHManagedCollisionModule,
    MCHState,
    RawIds,
    RawIdSplit,
    ReshardedIdMaps,
    hashed_slots,
    host_hashed_slots,
    managed_id_capacity,
    reshard_id_maps,
    split_managed,
    split_raw_ids,
)

__all__ = [
    "BaseEmbeddingConfig",
    "DEFAULT_LADDER",
    "DataType",
    "EmbeddingBagConfig",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "FrozenIdMap",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "MCH_STATE_FIELDS",
    "MCHManagedCollisionModule",
    "ManagedBatch",
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "ManagedCollisionSparseModule",
    "ManagedSparseModule",
    "MCHState",
    "PaddedBatch",
    "RawIds",
    "RawIdSplit",
    "ReshardedIdMaps",
    "PreparedBatch",
    "QuantEmbeddingBagCollection",
    "SparseModule",
    "StoredBlock",
    "WEIGHT_TYPES",
    "PoolingType",
    "capacity_for",
    "cpu_kernels_problem",
    "dequantize_rows",
    "hashed_slots",
    "host_hashed_slots",
    "jt_is_equal",
    "kjt_is_equal",
    "length_cap",
    "length_caps",
    "make_ladder",
    "make_update",
    "managed_id_capacity",
    "reshard_id_maps",
    "split_managed",
    "split_raw_ids",
    "quantize_rows",
    "quantized_pooled_lookup",
    "row_bytes",
]
