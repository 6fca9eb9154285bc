"""`Planner`: (tables, topology, batch size, pooling factors, constraints) -> `ShardingPlan`.

Steps: enumerate each table's candidate layouts (`_enumerate`), cost each one per device
(`_estimate.CostModel`), merge grouped tables into one item whose options put every
member on the same devices, then search (`_partition.search`) over proposals: two item
orders (largest tables first, as TorchRec's partitioner; most expensive first) times
type preferences (none, then each sharding type in turn, falling back to any option
where the preferred one does not fit); each proposal is placed greedily and improved
by single moves, the best one also by pair moves; the best objective (max device
ms/step, then the next largest, ...) wins. Tables are handled in name order, so the
plan does not depend on the order of `tables` (only its key order does). The planner
is pure: same input, same plan; nothing is mutated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from sparse_jax._configs import check_table_configs
from sparse_jax.plan import ShardingPlan, ShardingType

from . import _diagnose
from ._constraints import ParameterConstraints, PlannerError
from ._enumerate import enumerate_candidates
from ._estimate import CostModel
from ._partition import Failure, Item, search
from ._topology import Topology

__all__ = ["Planner"]


class Planner:
    """Plans where each embedding table lives on the mesh.

    Args:
        topology: the mesh, memory budget and bandwidths (`Topology`).
        constraints: table name -> `ParameterConstraints`.
        optimizer: the sparse optimizer whose state is counted: "sgd", "adagrad",
            "rowwise_adagrad" (default) or "adam", or (bytes per row, bytes per element).
        capacity_factor: headroom of the static id buffers over the expected ids.
        bwd_compute_multiplier: backward + update cost over forward lookup bytes (TorchRec: 2).
    """

    def __init__(
        self,
        topology: Topology,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        *,
        optimizer: str | tuple[int, int] = "rowwise_adagrad",
        capacity_factor: float = 1.0,
        bwd_compute_multiplier: float = 2.0,
    ) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(
                f"Planner needs a Topology, got {type(topology).__name__}; see Topology.from_mesh"
            )
        self.topology = topology
        self.constraints = dict(constraints or {})
        for name, c in self.constraints.items():
            if not isinstance(c, ParameterConstraints):
                raise TypeError(
                    f"constraints[{name!r}] must be ParameterConstraints, got {type(c).__name__}"
                )
        self._settings = dict(
            optimizer=optimizer,
            capacity_factor=capacity_factor,
            bwd_compute_multiplier=bwd_compute_multiplier,
        )
        CostModel(topology=topology, batch_size=1, **self._settings)  # check the settings now

    def _model(self, batch_size: int) -> CostModel:
        return CostModel(topology=self.topology, batch_size=batch_size, **self._settings)

    def _pooling(self, tables, pooling_factors: Mapping[str, float] | None) -> dict[str, float]:
        names = [t.name for t in tables]
        given = dict(pooling_factors or {})
        for what, keys in (("pooling_factors", given), ("constraints", self.constraints)):
            unknown = [k for k in keys if k not in names]
            if unknown:
                raise PlannerError(
                    f"{what} names table(s) {unknown} that are not among the tables {names}"
                )
        out = {}
        for t in tables:
            c = self.constraints.get(t.name)
            if c is not None:
                c.check_against(t, self.topology.axes)
            per_feature = c.pooling_factors if c is not None else None
            if t.name in given and per_feature is not None:
                raise PlannerError(
                    f"table {t.name!r}: pooling factors come from both pooling_factors and its "
                    "ParameterConstraints; give them in one place"
                )
            value = given[t.name] if t.name in given else sum(per_feature or [1.0] * t.num_features)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise PlannerError(
                    f"table {t.name!r}: pooling factor must be a number >= 0, got {value!r}"
                )
            out[t.name] = float(value)
        return out

    def _items(self, tables, model: CostModel, pooling) -> list[Item]:
        by_name = {t.name: t for t in tables}
        groups: dict[str, list[str]] = {}
        for t in tables:
            c = self.constraints.get(t.name)
            key = f"group:{c.group}" if c is not None and c.group else f"table:{t.name}"
            groups.setdefault(key, []).append(t.name)
        items = []
        for key in sorted(groups):
            names = tuple(sorted(groups[key]))
            per_table = {}
            for name in names:
                cands = enumerate_candidates(
                    by_name[name], self.topology, self.constraints.get(name)
                )
                if not cands:
                    raise PlannerError(
                        _diagnose.no_candidates(
                            by_name[name], self.topology, self.constraints.get(name)
                        )
                    )
                costs = [
                    model.device_vectors(by_name[name], c.sharding, pooling[name]) for c in cands
                ]
                per_table[name] = (cands, costs)
            items.append(_merge(names, per_table, self.constraints))
        return items

    def plan(
        self,
        tables: Sequence,
        *,
        batch_size: int,
        pooling_factors: Mapping[str, float] | None = None,
    ) -> ShardingPlan:
        """A validated plan placing every table once, within budget, at the least max cost.

        Args:
            tables: EmbeddingBagConfig / EmbeddingConfig list.
            batch_size: the global batch per step (split over every device).
            pooling_factors: table name -> average ids per sample (all its features);
                default: ParameterConstraints.pooling_factors, else 1.0 per feature.
        Raises:
            PlannerError: nothing fits; the message names the table and what would fit it.
        """
        tables = check_table_configs(tables)
        model = self._model(batch_size)
        pooling = self._pooling(tables, pooling_factors)
        items = self._items(tables, model, pooling)
        budget = float(self.topology.device_memory_bytes)
        by_size = sorted(
            range(len(items)), key=lambda i: (-_weight_bytes(items[i], tables), items[i].names)
        )
        by_cost = sorted(
            range(len(items)), key=lambda i: (-items[i].ms.max(axis=1).min(), items[i].names)
        )
        types = [t for t in ShardingType if any(t in _types(it) for it in items)]
        preferences = [None] + [
            [np.array([o[0].sharding_type is t for o in it.options]) for it in items] for t in types
        ]
        result = search(items, [by_size, by_cost], preferences, budget)
        if isinstance(result, Failure):
            raise PlannerError(
                _diagnose.infeasible(
                    items, result, tables, self.topology, self.constraints, model, pooling
                )
            )
        chosen = {}
        for i, (item, a) in enumerate(zip(items, result, strict=True)):
            notes = _diagnose.notes(items, result, i, budget, self.constraints)
            for name, ps in zip(item.names, item.options[a], strict=True):
                t = next(t for t in tables if t.name == name)
                chosen[name] = dataclasses.replace(
                    ps, estimate=model.estimate(t, ps, pooling[name], notes)
                )
        plan = ShardingPlan(
            {t.name: chosen[t.name] for t in tables},
            mesh_axes=self.topology.axes,
            device_memory_bytes=self.topology.device_memory_bytes,
        )
        plan.validate(tables)
        return plan

    def estimate(
        self,
        plan: ShardingPlan,
        tables: Sequence,
        *,
        batch_size: int,
        pooling_factors: Mapping[str, float] | None = None,
    ) -> ShardingPlan:
        """`plan` with this planner's estimates filled in (e.g. for a hand-written plan)."""
        tables = check_table_configs(tables)
        if plan.mesh_axes != self.topology.axes or list(plan.mesh_axes) != list(self.topology.axes):
            raise PlannerError(
                f"the plan is for mesh {plan.mesh_axes}, the topology is {self.topology.axes}"
            )
        plan.validate(tables)
        model, pooling = self._model(batch_size), self._pooling(tables, pooling_factors)
        out = {
            t.name: dataclasses.replace(
                plan[t.name], estimate=model.estimate(t, plan[t.name], pooling[t.name])
            )
            for t in tables
        }
        return ShardingPlan(
            out, mesh_axes=self.topology.axes, device_memory_bytes=self.topology.device_memory_bytes
        )


def _types(item: Item) -> set:
    return {o[0].sharding_type for o in item.options}


def _weight_bytes(item: Item, tables) -> int:
    by_name = {t.name: t for t in tables}
    return sum(
        by_name[n].num_embeddings * by_name[n].embedding_dim * by_name[n].data_type.itemsize
        for n in item.names
    )


def _merge(names, per_table, constraints) -> Item:
    """One item for a group: for each placement key every member has, each member's
    cheapest candidate with that key (a single table is its own group)."""
    first = names[0]
    if len(names) == 1:
        cands, costs = per_table[first]
        return Item(
            names=names,
            options=tuple((c.sharding,) for c in cands),
            mem=np.array([m for m, _ in costs]),
            ms=np.array([t for _, t in costs]),
        )
    keys = [c.key for c in per_table[first][0]]
    keys = [k for i, k in enumerate(keys) if k not in keys[:i]]
    options, mem, ms = [], [], []
    for key in keys:
        picks = []
        for name in names:
            cands, costs = per_table[name]
            idx = [i for i, c in enumerate(cands) if c.key == key]
            if not idx:
                break
            picks.append(min(idx, key=lambda i: (costs[i][1].max(), i)))
        else:
            options.append(
                tuple(per_table[n][0][i].sharding for n, i in zip(names, picks, strict=True))
            )
            mem.append(sum(per_table[n][1][i][0] for n, i in zip(names, picks, strict=True)))
            ms.append(sum(per_table[n][1][i][1] for n, i in zip(names, picks, strict=True)))
    if not options:
        group = constraints[first].group
        raise PlannerError(
            f"tables {list(names)} (group {group!r}) have no sharding type, axes and devices in common; "
            "give them the same sharding_types / axes / pin constraints or different groups"
        )
    return Item(names=names, options=tuple(options), mem=np.array(mem), ms=np.array(ms))
