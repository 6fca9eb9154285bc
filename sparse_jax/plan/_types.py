"""Plan data types: `ShardingType`, `Shard`, `ShardingEstimate`, `ParameterSharding`.

A `ParameterSharding` says how one table lives on the mesh: its `sharding_type`, the mesh
`axes` it is sharded over (a subset of the mesh axes, in mesh order; `()` = replicated on
every device), and its `shards`, rectangular blocks that tile the table exactly. Each
shard's `device` is a coordinate along `axes`; the block is replicated over every mesh
axis not in `axes` (TorchRec's 2D parallelism: replicas keep their updates in sync).

Layout per type (checked by `check_layout` in `_layout.py`; the sharded implementation
may rely on it):

- data_parallel: `axes=()`, one shard = the whole table, `device=()`.
- table_wise: one shard = the whole table at one coordinate over `axes` (>= 1 axis).
- row_wise: n = prod(sizes of `axes`) full-width row blocks of `ceil(E / n)` rows, block
  i at the i-th coordinate of `axes` in row-major order. Always n shards: trailing blocks
  past the last row are kept with `row_size=0`, so every coordinate holds exactly one.
- column_wise: full-height column blocks, each at one coordinate over `axes`.
- table_row_wise: `axes=(inter, intra)`; the table on one host index h, row blocks of
  `ceil(E / m)` rows over the intra axis (size m): block j at `(h, j)`.
- table_column_wise: `axes=(inter, intra)`; full-height column blocks, all on one host h,
  at `(h, j)` for any j.
- grid_shard: `axes=(inter, intra)`; column block c (in column order) on host
  `c % hosts`, its rows split over the intra axis as in table_row_wise.

Estimates are optional: the planner fills them in (for `stats_table` / `explain`), a
hand-written plan may leave them out.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["ParameterSharding", "Shard", "ShardingEstimate", "ShardingType"]


class ShardingType(enum.StrEnum):
    """How a table is split over the mesh (TorchRec's names and string values)."""

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    TABLE_ROW_WISE = "table_row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_COLUMN_WISE = "table_column_wise"
    GRID_SHARD = "grid_shard"

    @classmethod
    def coerce(cls, value: ShardingType | str, *, table: str | None = None) -> ShardingType:
        """`ShardingType` from itself, its value ("row_wise") or its name ("ROW_WISE")."""
        if isinstance(value, cls):
            return value
        # another library's enum of the same name (TorchRec's ShardingType.ROW_WISE) by its name
        text = value.name if isinstance(value, enum.Enum) else value
        if isinstance(text, str):
            for member in cls:
                if text in (member.value, member.name):
                    return member
        where = f"table {table!r}: " if table is not None else ""
        choices = ", ".join(m.value for m in cls)
        if isinstance(getattr(value, "sharding_type", None), str):  # TorchRec's ParameterSharding
            raise ValueError(
                f"{where}a {type(value).__qualname__} (TorchRec's ranks and shard sizes) is not "
                f"read; give its sharding type, e.g. {{table: {value.sharding_type!r}}}, and the "
                "plan places the shards on the mesh"
            )
        shown = (
            repr(value)
            if len(repr(value)) <= 80
            else f"a {type(value).__module__}.{type(value).__qualname__}"
        )
        raise ValueError(f"{where}sharding type {shown} is not one of {choices}")


# Types whose axes are (inter-host axis, intra-host axis).
TWO_LEVEL_TYPES = frozenset(
    {ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE, ShardingType.GRID_SHARD}
)


def _check_count(value, field: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {field} must be an integer >= 0, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shard:
    """One rectangular block of a table: rows `[row_offset, row_offset + row_size)`,
    columns `[col_offset, col_offset + col_size)`, at mesh coordinate `device` along the
    owning `ParameterSharding.axes` (replicated over the other mesh axes)."""

    row_offset: int
    row_size: int
    col_offset: int
    col_size: int
    device: tuple[int, ...]

    def __post_init__(self) -> None:
        for field in ("row_offset", "row_size", "col_offset", "col_size"):
            _check_count(getattr(self, field), field, "a shard")
        if isinstance(self.device, int) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in self.device
        ):
            raise ValueError(
                f"a shard's device must be a tuple of mesh coordinates (ints), got {self.device!r}"
            )
        object.__setattr__(self, "device", tuple(self.device))
        _ = [_check_count(i, "each device coordinate", "a shard") for i in self.device]

    @property
    def num_elements(self) -> int:
        return self.row_size * self.col_size

    def describe(self) -> str:
        """`rows [a, b) cols [c, d)`."""
        rows = f"[{self.row_offset}, {self.row_offset + self.row_size})"
        cols = f"[{self.col_offset}, {self.col_offset + self.col_size})"
        return f"rows {rows} cols {cols}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingEstimate:
    """What the planner expects one table to cost (filled in by the planner).

    `shard_bytes[i]` / `shard_ms[i]`: memory (weights + optimizer state + buffers) and
    time per step that shard i costs every device holding it. The `*_dist_bytes` and
    `backward_bytes` are collective bytes per step on the table's busiest device (see
    `sparse_jax.planner.estimate_collective_bytes`). `notes`: why this layout won
    (runner-up options and their cost), one sentence each.
    """

    shard_bytes: tuple[int, ...]
    shard_ms: tuple[float, ...]
    input_dist_bytes: int = 0
    output_dist_bytes: int = 0
    backward_bytes: int = 0
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_bytes", tuple(int(b) for b in self.shard_bytes))
        object.__setattr__(self, "shard_ms", tuple(float(m) for m in self.shard_ms))
        object.__setattr__(self, "notes", tuple(str(n) for n in self.notes))
        if len(self.shard_bytes) != len(self.shard_ms):
            raise ValueError(
                f"an estimate needs one shard_ms per shard_bytes, got {len(self.shard_ms)} "
                f"and {len(self.shard_bytes)}"
            )
        for field in ("input_dist_bytes", "output_dist_bytes", "backward_bytes"):
            _check_count(getattr(self, field), field, "an estimate")
        if any(b < 0 for b in self.shard_bytes) or any(not m >= 0 for m in self.shard_ms):
            raise ValueError("an estimate's shard_bytes and shard_ms must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParameterSharding:
    """How one table is sharded: type, mesh axes, shards (and optional estimates).

    `sharding_type` may be given as a string ("row_wise"); `axes` and `shards` as lists.
    Structure against the mesh and the table is checked by `ShardingPlan` and
    `ShardingPlan.validate(tables)`.
    """

    sharding_type: ShardingType
    axes: tuple[str, ...]
    shards: tuple[Shard, ...]
    estimate: ShardingEstimate | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding_type", ShardingType.coerce(self.sharding_type))
        if isinstance(self.axes, str):
            raise ValueError(
                f"axes must be a tuple of mesh axis names, got the string {self.axes!r}; "
                f"write axes=({self.axes!r},)"
            )
        object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "shards", tuple(self.shards))
        if not self.shards:
            raise ValueError("a ParameterSharding needs at least one shard")
        if not all(isinstance(s, Shard) for s in self.shards):
            raise ValueError("ParameterSharding.shards must hold Shard objects")
        est = self.estimate
        if est is not None and len(est.shard_bytes) != len(self.shards):
            raise ValueError(
                f"the estimate has {len(est.shard_bytes)} shard_bytes for {len(self.shards)} shards"
            )

    def without_estimate(self) -> ParameterSharding:
        return dataclasses.replace(self, estimate=None)
