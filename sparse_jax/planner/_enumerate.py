"""Enumerate each table's candidate layouts: sharding type x mesh axes x shard sizes x placement.

Deterministic order: types in `ShardingType` order, axis sets by size then mesh order,
then placements in coordinate order. Options that repeat another (an axis of size 1 adds
nothing) are left out. Per type:

- data_parallel: one option.
- table_wise: every non-empty set of mesh axes (of size > 1) x every coordinate.
- row_wise: every non-empty axis set (one option each: the layout is fixed).
- column_wise: every axis set x column counts k in 2..n dividing the dim with blocks of
  at least `min_partition` columns x n rotations (block i at coordinate (start + i) % n).
- table_row_wise: every (inter-host, intra-host) axis pair in mesh order, both of size > 1,
  x every host.
- table_column_wise: every such pair x column counts k in 2..m x host x m rotations.
- grid_shard: every such pair x column counts k in 2..hosts (block c on host c % hosts).

`ParameterConstraints` filter the result: allowed types, exact axes, pins.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable

from sparse_jax.plan import ParameterSharding, ShardingType
from sparse_jax.plan import _layout as L

from ._constraints import DEFAULT_MIN_PARTITION, ParameterConstraints
from ._topology import Topology

ST = ShardingType


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One concrete layout of one table; `key` = (type, axes, placement) without column
    counts, so grouped tables can be matched to the same devices."""

    sharding: ParameterSharding
    key: Hashable


def _axis_sets(topology: Topology, exact) -> list[tuple[str, ...]]:
    if exact is not None:
        return [tuple(a for a in topology.axes if a in exact)] if exact else []
    order = [a for a in topology.axes if topology.axes[a] > 1]
    if not order:
        return [(next(iter(topology.axes)),)]
    return [c for k in range(1, len(order) + 1) for c in itertools.combinations(order, k)]


def _two_level_pairs(topology: Topology, exact) -> list[tuple[str, str]]:
    order = list(topology.axes)
    pairs = [
        (i, j)
        for i, j in itertools.combinations(order, 2)
        if i in topology.inter_host_axes
        and j in topology.intra_host_axes
        and topology.axes[i] > 1
        and topology.axes[j] > 1
    ]
    if exact is not None:
        pairs = [p for p in pairs if set(p) == set(exact)]
    return pairs


def _column_counts(dim: int, min_partition: int, at_most: int) -> list[int]:
    return [k for k in range(2, at_most + 1) if dim % k == 0 and dim // k >= min_partition]


def _pinned_ok(ps: ParameterSharding, pin, mesh) -> bool:
    for axis, index in pin.items():
        if axis not in ps.axes:
            if mesh[axis] > 1:
                return False
            continue
        k = ps.axes.index(axis)
        if any(s.device[k] != index for s in ps.shards if s.num_elements):
            return False
    return True


def _all_candidates(table, topology: Topology, exact_axes, min_partition: int):
    rows, dim, mesh = table.num_embeddings, table.embedding_dim, topology.axes
    yield Candidate(L.data_parallel(rows, dim), (ST.DATA_PARALLEL, (), None))
    sets = _axis_sets(topology, exact_axes)
    for axes in sets:
        for dev in L.axis_coords(axes, mesh):
            yield Candidate(L.table_wise(rows, dim, axes, dev), (ST.TABLE_WISE, axes, dev))
    for axes in sets:
        yield Candidate(L.row_wise(rows, dim, axes, mesh), (ST.ROW_WISE, axes, None))
    pairs = _two_level_pairs(topology, exact_axes)
    for axes in pairs:
        for host in range(mesh[axes[0]]):
            yield Candidate(
                L.table_row_wise(rows, dim, axes, host, mesh), (ST.TABLE_ROW_WISE, axes, host)
            )
    for axes in sets:
        coords = L.axis_coords(axes, mesh)
        for k in _column_counts(dim, min_partition, len(coords)):
            for start in range(len(coords)):
                devs = [coords[(start + i) % len(coords)] for i in range(k)]
                yield Candidate(
                    L.column_wise(rows, [dim // k] * k, axes, devs), (ST.COLUMN_WISE, axes, start)
                )
    for axes in pairs:
        hosts, m = mesh[axes[0]], mesh[axes[1]]
        for k in _column_counts(dim, min_partition, m):
            for host in range(hosts):
                for start in range(m):
                    intra = [(start + i) % m for i in range(k)]
                    ps = L.table_column_wise(rows, [dim // k] * k, axes, host, intra)
                    yield Candidate(ps, (ST.TABLE_COLUMN_WISE, axes, (host, start)))
    for axes in pairs:
        for k in _column_counts(dim, min_partition, mesh[axes[0]]):
            yield Candidate(
                L.grid_shard(rows, [dim // k] * k, axes, mesh), (ST.GRID_SHARD, axes, None)
            )


def enumerate_candidates(
    table, topology: Topology, constraints: ParameterConstraints | None
) -> list[Candidate]:
    """The table's candidate layouts allowed by `constraints`, in a fixed order."""
    c = constraints or ParameterConstraints()
    allowed = set(c.sharding_types or ST)
    min_partition = DEFAULT_MIN_PARTITION if c.min_partition is None else c.min_partition
    out = []
    for cand in _all_candidates(table, topology, c.axes, min_partition):
        ps = cand.sharding
        if ps.sharding_type not in allowed:
            continue
        if c.pin and not _pinned_ok(ps, c.pin, topology.axes):
            continue
        out.append(cand)
    return out
