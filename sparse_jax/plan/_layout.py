"""Shard layouts: mesh coordinates, one builder per sharding type, and the layout check.

Devices are numbered row-major over the mesh axes (mesh order), as `jax.make_mesh` lays
out `mesh.devices`. The builders produce exactly the layouts documented in `_types.py`;
`check_layout` accepts exactly those (plus any tiling for column_wise blocks).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence

from ._types import TWO_LEVEL_TYPES, ParameterSharding, Shard, ShardingType

ST = ShardingType


def check_mesh_axes(mesh_axes: Mapping[str, int]) -> dict[str, int]:
    """A copy of `mesh_axes` (name -> size, mesh order) after checking names and sizes."""
    if not isinstance(mesh_axes, Mapping) or not mesh_axes:
        raise ValueError(
            f"mesh_axes must be a non-empty dict like {{'data': 2, 'model': 4}}, got {mesh_axes!r}"
        )
    out = {}
    for name, size in mesh_axes.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"mesh axis names must be non-empty strings, got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name!r} must have an integer size >= 1, got {size!r}")
        out[name] = size
    return out


def axis_coords(axes: Sequence[str], mesh_axes: Mapping[str, int]) -> list[tuple[int, ...]]:
    """All coordinates along `axes`, row-major (the last axis varies fastest)."""
    return list(itertools.product(*(range(mesh_axes[a]) for a in axes)))


def group_size(axes: Sequence[str], mesh_axes: Mapping[str, int]) -> int:
    return math.prod(mesh_axes[a] for a in axes)


def devices_holding(
    device: tuple[int, ...], axes: Sequence[str], mesh_axes: Mapping[str, int]
) -> list[int]:
    """Flat (row-major) indices of the mesh devices whose coordinates on `axes` are `device`."""
    return list(_holders(tuple(axes), tuple(mesh_axes.items())).get(tuple(device), ()))


@functools.lru_cache(maxsize=256)
def _holders(
    axes: tuple[str, ...], mesh_items: tuple[tuple[str, int], ...]
) -> dict[tuple[int, ...], tuple[int, ...]]:
    mesh = dict(mesh_items)
    pos = [list(mesh).index(a) for a in axes]
    out: dict[tuple[int, ...], list[int]] = {}
    for i, coord in enumerate(axis_coords(list(mesh), mesh)):
        out.setdefault(tuple(coord[p] for p in pos), []).append(i)
    return {k: tuple(v) for k, v in out.items()}


def row_block_sizes(num_rows: int, n: int) -> list[int]:
    """n blocks of `ceil(num_rows / n)` rows (TorchRec's block size); trailing ones may be 0."""
    block = -(-num_rows // n)
    return [max(0, min(block, num_rows - i * block)) for i in range(n)]


def _row_split(
    rows: int, col_offset: int, cols: int, devices: Sequence[tuple[int, ...]]
) -> list[Shard]:
    out, offset = [], 0
    for size, dev in zip(row_block_sizes(rows, len(devices)), devices, strict=True):
        out.append(
            Shard(
                row_offset=offset, row_size=size, col_offset=col_offset, col_size=cols, device=dev
            )
        )
        offset += size
    return out


def _col_offsets(col_sizes: Sequence[int]) -> list[int]:
    return [sum(col_sizes[:i]) for i in range(len(col_sizes))]


def data_parallel(rows: int, dim: int) -> ParameterSharding:
    shard = Shard(row_offset=0, row_size=rows, col_offset=0, col_size=dim, device=())
    return ParameterSharding(sharding_type=ST.DATA_PARALLEL, axes=(), shards=(shard,))


def table_wise(
    rows: int, dim: int, axes: Sequence[str], device: tuple[int, ...]
) -> ParameterSharding:
    shard = Shard(row_offset=0, row_size=rows, col_offset=0, col_size=dim, device=tuple(device))
    return ParameterSharding(sharding_type=ST.TABLE_WISE, axes=tuple(axes), shards=(shard,))


def row_wise(
    rows: int, dim: int, axes: Sequence[str], mesh_axes: Mapping[str, int]
) -> ParameterSharding:
    shards = _row_split(rows, 0, dim, axis_coords(axes, mesh_axes))
    return ParameterSharding(sharding_type=ST.ROW_WISE, axes=tuple(axes), shards=tuple(shards))


def column_wise(
    rows: int, col_sizes: Sequence[int], axes: Sequence[str], devices: Sequence[tuple[int, ...]]
) -> ParameterSharding:
    shards = [
        Shard(row_offset=0, row_size=rows, col_offset=off, col_size=size, device=tuple(dev))
        for off, size, dev in zip(_col_offsets(col_sizes), col_sizes, devices, strict=True)
    ]
    return ParameterSharding(sharding_type=ST.COLUMN_WISE, axes=tuple(axes), shards=tuple(shards))


def table_row_wise(
    rows: int, dim: int, axes: Sequence[str], host: int, mesh_axes: Mapping[str, int]
) -> ParameterSharding:
    devices = [(host, j) for j in range(mesh_axes[axes[1]])]
    shards = _row_split(rows, 0, dim, devices)
    return ParameterSharding(
        sharding_type=ST.TABLE_ROW_WISE, axes=tuple(axes), shards=tuple(shards)
    )


def table_column_wise(
    rows: int, col_sizes: Sequence[int], axes: Sequence[str], host: int, intra: Sequence[int]
) -> ParameterSharding:
    ps = column_wise(rows, col_sizes, axes, [(host, j) for j in intra])
    return ParameterSharding(sharding_type=ST.TABLE_COLUMN_WISE, axes=ps.axes, shards=ps.shards)


def grid_shard(
    rows: int, col_sizes: Sequence[int], axes: Sequence[str], mesh_axes: Mapping[str, int]
) -> ParameterSharding:
    hosts, local = mesh_axes[axes[0]], mesh_axes[axes[1]]
    shards = []
    for c, (off, size) in enumerate(zip(_col_offsets(col_sizes), col_sizes, strict=True)):
        shards += _row_split(rows, off, size, [(c % hosts, j) for j in range(local)])
    return ParameterSharding(sharding_type=ST.GRID_SHARD, axes=tuple(axes), shards=tuple(shards))


def check_axes_and_devices(name: str, ps: ParameterSharding, mesh_axes: Mapping[str, int]) -> None:
    """Axes are known mesh axes in mesh order; every shard's device is in range."""
    order = list(mesh_axes)
    unknown = [a for a in ps.axes if a not in mesh_axes]
    if unknown:
        raise ValueError(
            f"table {name!r}: axes {list(ps.axes)} name {unknown}, which the mesh {order} does not "
            "have; use mesh axis names"
        )
    if len(set(ps.axes)) != len(ps.axes) or list(ps.axes) != [a for a in order if a in ps.axes]:
        in_order = [a for a in order if a in ps.axes]
        raise ValueError(
            f"table {name!r}: axes {list(ps.axes)} must be distinct and in mesh order; write {in_order}"
        )
    sizes = [mesh_axes[a] for a in ps.axes]
    for i, s in enumerate(ps.shards):
        if len(s.device) != len(ps.axes) or any(
            c >= n for c, n in zip(s.device, sizes, strict=True)
        ):
            raise ValueError(
                f"table {name!r}: shard {i} is at device {list(s.device)}, which is not a coordinate "
                f"along axes {list(ps.axes)} of sizes {sizes}; give one index per axis, each below its size"
            )


def _check_tiling(name: str, ps: ParameterSharding, rows: int, dim: int) -> None:
    blocks = [s for s in ps.shards if s.num_elements]
    for i, s in enumerate(ps.shards):
        if s.row_offset + s.row_size > rows or s.col_offset + s.col_size > dim:
            raise ValueError(
                f"table {name!r}: shard {i} ({s.describe()}) reaches outside the {rows} x {dim} table"
            )
    for a, b in itertools.combinations(blocks, 2):
        if (
            a.row_offset < b.row_offset + b.row_size
            and b.row_offset < a.row_offset + a.row_size
            and a.col_offset < b.col_offset + b.col_size
            and b.col_offset < a.col_offset + a.col_size
        ):
            raise ValueError(f"table {name!r}: shards {a.describe()} and {b.describe()} overlap")
    covered = sum(s.num_elements for s in blocks)
    if covered != rows * dim:
        raise ValueError(
            f"table {name!r}: the shards cover {covered} of the table's {rows} x {dim} = "
            f"{rows * dim} elements; they must tile it with no gap"
        )


def check_layout(
    name: str, ps: ParameterSharding, rows: int, dim: int, mesh_axes: Mapping[str, int]
) -> None:
    """Raise ValueError (naming the table) unless `ps` is a valid layout of a rows x dim table."""
    check_axes_and_devices(name, ps, mesh_axes)
    _check_tiling(name, ps, rows, dim)
    t, axes, shards = ps.sharding_type, ps.axes, ps.shards
    rebuild = "; ShardingPlan.from_types builds this layout for you"
    if t is ST.DATA_PARALLEL and (axes or len(shards) != 1):
        raise ValueError(
            f"table {name!r}: data_parallel takes axes=() and one whole-table shard{rebuild}"
        )
    if t is not ST.DATA_PARALLEL and not axes:
        raise ValueError(
            f"table {name!r}: {t.value} needs at least one mesh axis in `axes`{rebuild}"
        )
    if t is ST.TABLE_WISE and len(shards) != 1:
        raise ValueError(
            f"table {name!r}: table_wise takes one whole-table shard, got {len(shards)}{rebuild}"
        )
    if t in TWO_LEVEL_TYPES and len(axes) != 2:
        raise ValueError(
            f"table {name!r}: {t.value} takes axes=(inter_host_axis, intra_host_axis), got {list(axes)}{rebuild}"
        )
    if t in (ST.COLUMN_WISE, ST.TABLE_COLUMN_WISE) and any(s.row_size != rows for s in shards):
        raise ValueError(
            f"table {name!r}: {t.value} shards must each hold all {rows} rows{rebuild}"
        )
    if t is ST.TABLE_COLUMN_WISE and len({s.device[0] for s in shards}) != 1:
        raise ValueError(
            f"table {name!r}: table_column_wise shards must all be on one host index{rebuild}"
        )
    expected = None
    if t is ST.ROW_WISE:
        expected = row_wise(rows, dim, axes, mesh_axes)
    elif t is ST.TABLE_ROW_WISE:
        expected = table_row_wise(rows, dim, axes, shards[0].device[0], mesh_axes)
    elif t is ST.GRID_SHARD:
        starts = sorted({s.col_offset for s in shards if s.col_size})
        sizes = [b - a for a, b in zip(starts, [*starts[1:], dim], strict=True)]
        expected = grid_shard(rows, sizes, axes, mesh_axes)
    if expected is not None and sorted(expected.shards, key=_key) != sorted(shards, key=_key):
        want = ", ".join(f"{s.describe()} at {list(s.device)}" for s in expected.shards)
        raise ValueError(
            f"table {name!r}: {t.value} over {list(axes)} must have the shards {want}{rebuild}"
        )


def _key(s: Shard) -> tuple:
    return (s.col_offset, s.row_offset, s.device, s.row_size, s.col_size)
