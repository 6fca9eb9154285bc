"""Static facts of a sharded collection: which shard buffers exist and who computes what.

Every shard of every table is a block `[row_size, col_size]` at a device coordinate over
its table's `axes` (replicated over the other mesh axes). Shards with the same
(axes, col_size, dtype) are stacked into one *shard buffer*: on each coordinate, the
blocks it holds are stacked row-wise, padded to the largest coordinate's row count, so
the global array is `[n_axes * rows_per_device, col_size]`, sharded over `axes` on rows.

A *work item* is one (shard, feature) pair: the device holding the shard pools that
feature's ids that fall into the shard's rows, for the whole batch of its group. Work
items are padded to the same count `M` per coordinate (padding items are invalid).

`ShardedStatic` bundles these with the rest of what the per-device code reads (the table
layout, the mesh axes, the collection's lookup flags): one frozen value that the placement,
input dist, local lookup and byte accounting functions take as their first argument.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping

import numpy as np

from sparse_jax._configs import DataType, PoolingType
from sparse_jax._layout import TableLayout
from sparse_jax._module import StoredBlock

__all__ = ["ShardBuffer", "ShardedStatic", "WorkItem", "build_buffers"]


@dataclasses.dataclass(frozen=True)
class WorkItem:
    feature: int  # index into layout.features (output order)
    table: str
    row_offset: int  # first table row of the shard
    row_size: int
    col_offset: int  # first column of the shard within the table
    local_offset: int  # first row of the shard inside the coordinate's block
    num_rows: int  # rows of the whole table (bounds)
    mean: bool


@dataclasses.dataclass(frozen=True)
class ShardBuffer:
    name: str
    axes: tuple[str, ...]
    group_size: int  # devices along `axes`
    width: int
    data_type: DataType
    rows_per_device: int
    items: tuple[tuple[WorkItem, ...], ...]  # per coordinate (linear over `axes`)
    blocks: tuple[tuple[str, int, int, int, int, int, int], ...]
    # (table, coordinate, local_offset, row_offset, row_size, col_offset, col_size)

    @property
    def max_items(self) -> int:
        return max(1, max(len(i) for i in self.items))

    def stored_blocks(self) -> Iterator[StoredBlock]:
        """Each block with the row of this buffer's global array it starts at (coordinate
        `c`'s blocks start at row `c * rows_per_device`)."""
        for table, c, local, r0, rn, c0, cn in self.blocks:
            yield StoredBlock(self.name, table, c * self.rows_per_device + local, r0, rn, c0, cn)

    def item_table(self) -> dict[str, np.ndarray]:
        """Per-field `[group_size, max_items]` int arrays; `valid` marks real items."""
        m = self.max_items
        fields = ("feature", "row_offset", "row_size", "local_offset", "num_rows", "mean")
        out = {f: np.zeros((self.group_size, m), np.int32) for f in (*fields, "valid")}
        for c, items in enumerate(self.items):
            for j, it in enumerate(items):
                for f in fields:
                    out[f][c, j] = int(getattr(it, f))
                out["valid"][c, j] = 1
        return out


@dataclasses.dataclass(frozen=True)
class ShardedStatic:
    """The static facts of a sharded collection (closed over under `jit`, never traced):
    its shard buffers, its table layout, the mesh axes `{axis: size}` (mesh order) and
    the collection's lookup flags."""

    layout: TableLayout
    buffers: tuple[ShardBuffer, ...]
    mesh_axes: Mapping[str, int]
    is_weighted: bool
    bounds_check: str  # "error", "clamp" or "skip"
    kernel: str  # the collection's lookup kernel ("auto", "xla", ...)

    @property
    def all_axes(self) -> tuple[str, ...]:
        """Every mesh axis, in mesh order (the batch is split over all of them)."""
        return tuple(self.mesh_axes)

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_axes.values())

    def replica_axes(self, buf: ShardBuffer) -> tuple[str, ...]:
        """The mesh axes `buf` is replicated over (those it is not sharded over)."""
        return tuple(a for a in self.all_axes if a not in buf.axes)

    def num_replicas(self, buf: ShardBuffer) -> int:
        return math.prod(self.mesh_axes[a] for a in self.replica_axes(buf))


def _linear(coord: tuple[int, ...], sizes: list[int]) -> int:
    idx = 0
    for c, s in zip(coord, sizes, strict=True):
        idx = idx * s + c
    return idx


def build_buffers(layout: TableLayout, plan, mesh_axes: dict[str, int]) -> list[ShardBuffer]:
    by_key: dict[tuple, dict] = {}
    for t in layout.tables:
        ps = plan[t.name]
        axes = tuple(ps.axes)
        sizes = [mesh_axes[a] for a in axes]
        n = int(np.prod(sizes)) if sizes else 1
        feats = [i for i, s in enumerate(layout.features) if s.table == t.name]
        for shard in ps.shards:
            if shard.row_size == 0:
                continue
            key = (axes, shard.col_size, t.data_type)
            buf = by_key.setdefault(
                key, {"used": [0] * n, "items": [[] for _ in range(n)], "blocks": []}
            )
            c = _linear(tuple(shard.device), sizes)
            local = buf["used"][c]
            buf["used"][c] += shard.row_size
            buf["blocks"].append(
                (
                    t.name,
                    c,
                    local,
                    shard.row_offset,
                    shard.row_size,
                    shard.col_offset,
                    shard.col_size,
                )
            )
            for f in feats:
                buf["items"][c].append(
                    WorkItem(
                        f,
                        t.name,
                        shard.row_offset,
                        shard.row_size,
                        shard.col_offset,
                        local,
                        t.num_embeddings,
                        layout.features[f].pooling is PoolingType.MEAN,
                    )
                )
    out = []
    for i, ((axes, width, dtype), buf) in enumerate(by_key.items()):
        out.append(
            ShardBuffer(
                name=f"s{i}_{'_'.join(axes) or 'replicated'}_w{width}_{dtype.value.lower()}",
                axes=axes,
                group_size=len(buf["used"]),
                width=width,
                data_type=dtype,
                rows_per_device=max(1, max(buf["used"])),
                items=tuple(tuple(x) for x in buf["items"]),
                blocks=tuple(buf["blocks"]),
            )
        )
    return out
