"""Sharding: collections sharded over a device mesh (`shard`), and the plan types they run
(`ShardingType`, `Shard`, `ParameterSharding`, `ShardingPlan`, re-exported from `sparse_jax.plan`)."""

from sparse_jax.managed._sharded import ShardedManagedCollisionModule
from sparse_jax.plan import ParameterSharding, Shard, ShardingEstimate, ShardingPlan, ShardingType

from ._sequence import ShardedEmbeddingCollection
from ._sharded import ShardedEmbeddingBagCollection, shard

__all__ = [
    "ParameterSharding",
    "Shard",
    "ShardingEstimate",
    "ShardingPlan",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardedManagedCollisionModule",
    "ShardingType",
    "shard",
]
