"""Planner: topology + tables + batch size + constraints -> `ShardingPlan` (pure Python).

`Planner(topology, constraints={...}).plan(tables, batch_size=...)`; the plan types are
re-exported here from `sparse_jax.plan`. `python -m sparse_jax.planner` prints the
plan of a 26-table Criteo-like model.
"""

from sparse_jax.plan import (
    ParameterSharding,
    Shard,
    ShardingEstimate,
    ShardingPlan,
    ShardingType,
)

from ._constraints import DEFAULT_MIN_PARTITION, ParameterConstraints, PlannerError
from ._estimate import OPTIMIZER_STATE_BYTES, CostModel, estimate_collective_bytes
from ._planner import Planner
from ._topology import Topology

__all__ = [
    "DEFAULT_MIN_PARTITION",
    "OPTIMIZER_STATE_BYTES",
    "CostModel",
    "ParameterConstraints",
    "ParameterSharding",
    "Planner",
    "PlannerError",
    "Shard",
    "ShardingEstimate",
    "ShardingPlan",
    "ShardingType",
    "Topology",
    "estimate_collective_bytes",
]
