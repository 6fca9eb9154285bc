"""Sharding: plan data types (`ShardingType`, `Shard`, `ParameterSharding`, `ShardingPlan`)."""

from ._plan import ShardingPlan
from ._types import ParameterSharding, Shard, ShardingEstimate, ShardingType

__all__ = [
    "ParameterSharding",
    "Shard",
    "ShardingEstimate",
    "ShardingPlan",
    "ShardingType",
]
