"""Plan data types: which table lives where on the mesh (pure Python, no JAX).

`ShardingType`, `Shard`, `ShardingEstimate`, `ParameterSharding` and `ShardingPlan`, with
their JSON form, reports and shard-geometry helpers. Both the planner
(`sparse_jax.planner`, which writes plans) and the sharded runtime (`sparse_jax.sharding`,
which runs them) import these; neither imports the other's side from here.
"""

from ._plan import ShardingPlan
from ._types import ParameterSharding, Shard, ShardingEstimate, ShardingType

__all__ = [
    "ParameterSharding",
    "Shard",
    "ShardingEstimate",
    "ShardingPlan",
    "ShardingType",
]
