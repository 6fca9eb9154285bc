"""`ParameterConstraints` (TorchRec's name) and `PlannerError`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from sparse_jax.plan import ShardingType

__all__ = ["DEFAULT_MIN_PARTITION", "ParameterConstraints", "PlannerError"]

DEFAULT_MIN_PARTITION = 128  # TorchRec's MIN_CW_DIM: narrowest column block


class PlannerError(ValueError):
    """No plan satisfies the request; the message names the table and what would fit it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParameterConstraints:
    """What the planner may do with one table.

    Args:
        sharding_types: the allowed types (default: all seven).
        min_partition: narrowest column block for column_wise / table_column_wise /
            grid_shard (default 128, TorchRec's); a dim narrower than twice this gets no
            column split.
        pooling_factors: average ids per sample, one per feature of the table (TorchRec's
            meaning); their sum is the table's pooling factor. Default 1.0 per feature.
        axes: shard only over exactly these mesh axes (data_parallel, which uses none,
            stays allowed unless `sharding_types` excludes it).
        pin: mesh axis -> index: every shard must live only on devices with that index
            along that axis (e.g. `{"model": 2}` keeps the table on model=2).
        group: tables with the same group name get the same sharding type, axes and
            devices ("keep these tables together").
    """

    sharding_types: Sequence[ShardingType | str] | None = None
    min_partition: int | None = None
    pooling_factors: Sequence[float] | None = None
    axes: Sequence[str] | None = None
    pin: Mapping[str, int] | None = None
    group: str | None = None

    def __post_init__(self) -> None:
        if self.sharding_types is not None:
            if isinstance(self.sharding_types, str | ShardingType):
                raise ValueError(
                    f"sharding_types must be a list, got {self.sharding_types!r}; write [{self.sharding_types!r}]"
                )
            types = tuple(ShardingType.coerce(t) for t in self.sharding_types)
            if not types:
                raise ValueError(
                    "sharding_types=[] allows nothing; leave it None to allow every type"
                )
            object.__setattr__(self, "sharding_types", tuple(dict.fromkeys(types)))
        mp = self.min_partition
        if mp is not None and (isinstance(mp, bool) or not isinstance(mp, int) or mp < 1):
            raise ValueError(f"min_partition must be an integer >= 1, got {mp!r}")
        if self.pooling_factors is not None:
            pf = self.pooling_factors
            if isinstance(pf, int | float) or not all(
                isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in pf
            ):
                raise ValueError(
                    f"pooling_factors must be a list of numbers >= 0, one per feature, got {pf!r}"
                )
            object.__setattr__(self, "pooling_factors", tuple(float(x) for x in pf))
        if self.axes is not None:
            if isinstance(self.axes, str):
                raise ValueError(
                    f"axes must be a list of mesh axis names, got the string {self.axes!r}"
                )
            object.__setattr__(self, "axes", tuple(self.axes))
        if self.pin is not None:
            if not isinstance(self.pin, Mapping) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in self.pin.values()
            ):
                raise ValueError(f"pin must map mesh axis names to indices >= 0, got {self.pin!r}")
            object.__setattr__(self, "pin", dict(self.pin))
        if self.group is not None and (not isinstance(self.group, str) or not self.group):
            raise ValueError(f"group must be a non-empty string, got {self.group!r}")

    __hash__ = None  # type: ignore[assignment]

    def check_against(self, table, mesh_axes: Mapping[str, int]) -> None:
        """Raise PlannerError if this constraint names axes or features the setup lacks."""
        name = table.name
        for what, axes in (("axes", self.axes or ()), ("pin", list(self.pin or {}))):
            unknown = [a for a in axes if a not in mesh_axes]
            if unknown:
                raise PlannerError(
                    f"table {name!r}: constraint {what} names {unknown}, which are not mesh axes {list(mesh_axes)}"
                )
        for axis, index in (self.pin or {}).items():
            if index >= mesh_axes[axis]:
                raise PlannerError(
                    f"table {name!r}: pin {axis}={index} is out of range; axis {axis!r} has size {mesh_axes[axis]}"
                )
        if self.pooling_factors is not None and len(self.pooling_factors) != len(
            table.feature_names
        ):
            raise PlannerError(
                f"table {name!r}: pooling_factors has {len(self.pooling_factors)} values for the table's "
                f"{len(table.feature_names)} features {list(table.feature_names)}; give one per feature"
            )
