"""Sharding: plan data types (`ShardingType`, `Shard`, `ParameterSharding`, `ShardingPlan`)."""

from ._plan import ShardingPlan
from ._sequence import ShardedEmbeddingCollection
from ._sharded import ShardedEmbeddingBagCollection, shard
from ._types import ParameterSharding, Shard, ShardingEstimate, ShardingType

__all__ = [
    "ParameterSharding",
    "Shard",
    "ShardingEstimate",
    "ShardingPlan",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardingType",
    "shard",
]
