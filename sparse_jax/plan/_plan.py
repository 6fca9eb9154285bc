"""`ShardingPlan`: table name -> `ParameterSharding` on a named mesh.

Built by the planner (`sparse_jax.planner.Planner.plan`), by hand from types
(`ShardingPlan.from_types`), or read back from JSON (`ShardingPlan.from_json`). A plan is
immutable; every constructor checks axes and device coordinates against the mesh, and
`validate(tables)` checks the shards against the tables themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence

from . import _json, _layout, _report
from ._types import TWO_LEVEL_TYPES, ParameterSharding, ShardingType

log = logging.getLogger("hybridrec.plan")

__all__ = ["ShardingPlan"]

ST = ShardingType


class ShardingPlan(Mapping[str, ParameterSharding]):
    """Per table a `ParameterSharding`; `plan[table_name]`, iteration in table order.

    Args:
        shardings: table name -> ParameterSharding.
        mesh_axes: mesh axis name -> size, in mesh order (e.g. `{"data": 2, "model": 4}`).
        device_memory_bytes: the per-device budget the plan was made for (shown by
            `stats_table`); None when unknown.
    """

    def __init__(
        self,
        shardings: Mapping[str, ParameterSharding],
        *,
        mesh_axes: Mapping[str, int],
        device_memory_bytes: int | None = None,
    ) -> None:
        self._mesh_axes = _layout.check_mesh_axes(mesh_axes)
        self._shardings: dict[str, ParameterSharding] = {}
        for name, ps in shardings.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"plan entries are keyed by table name, got {name!r}")
            if not isinstance(ps, ParameterSharding):
                raise ValueError(
                    f"table {name!r}: expected a ParameterSharding, got {type(ps).__name__}"
                )
            _layout.check_axes_and_devices(name, ps, self._mesh_axes)
            self._shardings[name] = ps
        if device_memory_bytes is not None and (
            isinstance(device_memory_bytes, bool)
            or not isinstance(device_memory_bytes, int)
            or device_memory_bytes < 1
        ):
            raise ValueError(
                f"device_memory_bytes must be a positive integer or None, got {device_memory_bytes!r}"
            )
        self._budget = device_memory_bytes

    # Mapping ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> ParameterSharding:
        try:
            return self._shardings[name]
        except KeyError:
            raise KeyError(
                f"the plan has no table {name!r}; it has {sorted(self._shardings)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._shardings)

    def __len__(self) -> int:
        return len(self._shardings)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardingPlan):
            return NotImplemented
        return (
            list(self._mesh_axes.items()) == list(other._mesh_axes.items())
            and self._budget == other._budget
            and list(self._shardings.items()) == list(other._shardings.items())
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        types = ", ".join(f"{n}: {ps.sharding_type.value}" for n, ps in self._shardings.items())
        return f"ShardingPlan(mesh_axes={self._mesh_axes}, {{{types}}})"

    @property
    def mesh_axes(self) -> dict[str, int]:
        """Mesh axis name -> size, in mesh order (a copy)."""
        return dict(self._mesh_axes)

    @property
    def device_memory_bytes(self) -> int | None:
        return self._budget

    @property
    def num_devices(self) -> int:
        return _layout.group_size(list(self._mesh_axes), self._mesh_axes)

    # Checks ----------------------------------------------------------------------------
    def validate(self, tables: Sequence) -> None:
        """Raise ValueError (naming the table) unless the plan places every table exactly once
        and each table's shards are a valid layout of it (see `_types.py` for the layouts)."""
        names = [t.name for t in tables]
        missing = [n for n in names if n not in self._shardings]
        extra = [n for n in self._shardings if n not in set(names)]
        if missing:
            raise ValueError(f"the plan has no entry for table(s) {missing}; add them or re-plan")
        if extra:
            raise ValueError(
                f"the plan names table(s) {extra} that are not among the tables {names}"
            )
        for t in tables:
            _layout.check_layout(
                t.name, self._shardings[t.name], t.num_embeddings, t.embedding_dim, self._mesh_axes
            )

    # Hand-written plans ------------------------------------------------------------------
    @classmethod
    def from_types(
        cls,
        tables: Sequence,
        mesh_axes: Mapping[str, int],
        types: Mapping[str, ShardingType | str | ParameterSharding],
    ) -> ShardingPlan:
        """A plan from a sharding type per table name, with default axes and shards.

        Rules: the *model axes* are the mesh axes other than one named "data" (all axes
        if that leaves none). table_wise, row_wise and column_wise shard over the model
        axes; the two-level types use (first mesh axis, last mesh axis) as (inter, intra).
        column_wise splits into the largest column count <= the devices it spans that
        divides the dim (table_column_wise: <= the intra size; grid_shard: <= the
        hosts), logged when that is fewer (TorchRec refuses such a split). Whole tables and
        column blocks go, in table order, to the coordinate holding the fewest bytes so far
        (ties: the lowest). A value may also be a ready `ParameterSharding`. Tables missing
        from `types` are data_parallel (use `Planner` with
        `ParameterConstraints(sharding_types=[...])` to let the planner place the rest). The result is validated against `tables`.
        """
        mesh = _layout.check_mesh_axes(mesh_axes)
        names = {t.name for t in tables}
        unknown = sorted(set(types) - names)
        if unknown:
            raise ValueError(
                f"types names table(s) {unknown} that are not among the tables {sorted(names)}"
            )
        order = list(mesh)
        model = tuple(a for a in order if a != "data") or tuple(order)
        load = [0] * _layout.group_size(order, mesh)
        out = {}
        for t in tables:
            value = types.get(t.name, ST.DATA_PARALLEL)
            if isinstance(value, ParameterSharding):
                out[t.name] = value
                continue
            kind = ST.coerce(value, table=t.name)
            if kind in TWO_LEVEL_TYPES and len(order) < 2:
                raise ValueError(
                    f"table {t.name!r}: {kind.value} needs a mesh with an inter-host and an intra-host "
                    f"axis, but the mesh has only {order}; use row_wise or column_wise"
                )
            out[t.name] = _default_layout(t, kind, model, (order[0], order[-1]), mesh, load)
        plan = cls(out, mesh_axes=mesh)
        plan.validate(tables)
        return plan

    # JSON and reports ------------------------------------------------------------------
    def to_json(self) -> str:
        """JSON text, one shard per line, readable and editable by hand."""
        return _json.dump(self._shardings, self._mesh_axes, self._budget)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        """The plan written by `to_json` (checked on load; errors say what to fix)."""
        shardings, mesh_axes, budget = _json.load(text)
        return cls(shardings, mesh_axes=mesh_axes, device_memory_bytes=budget)

    def device_totals(self) -> tuple[list[int | None], list[float | None]]:
        """Per device (row-major): estimated bytes and ms per step (None without estimates)."""
        return _report.device_totals(self)

    def stats_table(self) -> str:
        """Per device: memory used / budget, estimated ms per step, its tables and their types."""
        return _report.stats_table(self)

    def explain(self, table_name: str) -> str:
        """The chosen type, axes, shards, estimated bytes and time for one table, and why."""
        return _report.explain(self, table_name)


def _largest_divisor(dim: int, at_most: int, *, table: str = "", kind: str = "") -> int:
    """The most column blocks (<= `at_most`) that split `dim` evenly. Fewer than `at_most` is
    logged: TorchRec refuses such a column split, here the blocks are fewer (one block is
    the whole table on one device)."""
    k = max(k for k in range(1, max(1, at_most) + 1) if dim % k == 0)
    if k < at_most:
        log.warning(
            "table %r: %s splits its embedding_dim %d into %d block(s), not %d (the devices it "
            "spans): %d does not divide evenly. Give the table a dim divisible by %d, or a "
            "ParameterSharding with the blocks you want.",
            table,
            kind,
            dim,
            k,
            at_most,
            dim,
            at_most,
        )
    return k


def _least_loaded(candidates, axes, mesh, load) -> tuple[int, ...]:
    def held(dev):
        return sum(load[i] for i in _layout.devices_holding(dev, axes, mesh))

    return min(candidates, key=lambda dev: (held(dev), dev))


def _least_loaded_host(two_level, mesh, load) -> int:
    hosts = [(h,) for h in range(mesh[two_level[0]])]
    return _least_loaded(hosts, two_level[:1], mesh, load)[0]


def _add(load, ps: ParameterSharding, mesh, itemsize: int) -> None:
    for s in ps.shards:
        for i in _layout.devices_holding(s.device, ps.axes, mesh):
            load[i] += s.num_elements * itemsize


def _default_layout(t, kind: ShardingType, model, two_level, mesh, load) -> ParameterSharding:
    rows, dim, size = t.num_embeddings, t.embedding_dim, t.data_type.itemsize
    if kind is ST.DATA_PARALLEL:
        ps = _layout.data_parallel(rows, dim)
    elif kind is ST.ROW_WISE:
        ps = _layout.row_wise(rows, dim, model, mesh)
    elif kind is ST.GRID_SHARD:
        k = _largest_divisor(dim, mesh[two_level[0]], table=t.name, kind=kind.value)
        ps = _layout.grid_shard(rows, [dim // k] * k, two_level, mesh)
    elif kind is ST.TABLE_ROW_WISE:
        ps = _layout.table_row_wise(
            rows, dim, two_level, _least_loaded_host(two_level, mesh, load), mesh
        )
    else:  # whole tables or column blocks placed one at a time on the least loaded coordinate
        axes = two_level if kind is ST.TABLE_COLUMN_WISE else model
        coords = _layout.axis_coords(axes, mesh)
        if kind is ST.TABLE_COLUMN_WISE:
            host = _least_loaded_host(two_level, mesh, load)
            coords = [c for c in coords if c[0] == host]
        k = (
            1
            if kind is ST.TABLE_WISE
            else _largest_divisor(dim, len(coords), table=t.name, kind=kind.value)
        )
        devices = []
        for _ in range(k):
            dev = _least_loaded([c for c in coords if c not in devices], axes, mesh, load)
            devices.append(dev)
            for i in _layout.devices_holding(dev, axes, mesh):
                load[i] += rows * (dim // k) * size
        if kind is ST.TABLE_WISE:
            return _layout.table_wise(rows, dim, axes, devices[0])
        if kind is ST.COLUMN_WISE:
            return _layout.column_wise(rows, [dim // k] * k, axes, devices)
        return _layout.table_column_wise(rows, [dim // k] * k, axes, host, [d[1] for d in devices])
    _add(load, ps, mesh, size)
    return ps
