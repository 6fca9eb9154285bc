"""A managed table's id map frozen for serving (`FrozenIdMap`): what `hybrid.export` writes
and the server reads with numpy only."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sparse_jax.managed._id_map import MCHState, RawIds

__all__ = ["FrozenIdMap", "frozen_map"]


class FrozenIdMap(NamedTuple):
    """A managed table's id map frozen for serving (`hybrid.export` writes it; the server
    reads it with numpy only: `hybrid.serving`): the resident raw ids ascending (int64), the
    table row of each (int32), and the default row of each shard holding a map (int64,
    ascending: the last row of its block; one entry for one map). With several shards (a
    row-wise table managed per shard) an id not resident reads the default row of the
    shard it hashes to (`default_rows[hashed_slots(id, shards)]`), as the training module
    reads it; the shards' blocks may differ in size (18 rows over 4 shards: default rows 4,
    9, 14 and 17)."""

    ids: np.ndarray
    rows: np.ndarray
    default_rows: np.ndarray

    @property
    def shards(self) -> int:
        """The shards holding a map (ids hash over them)."""
        return len(self.default_rows)

    @property
    def default_row(self) -> int:
        """The first shard's default row (the last row of its block; with one map, the
        table's default row)."""
        return int(self.default_rows[0])


def frozen_map(states: MCHState, sizes=None) -> FrozenIdMap:
    """The `FrozenIdMap` of a table's id map (host arrays, `[rows]`: one map for the whole
    table) or id maps stacked one per shard (`[shards, rows]`: shard s owns table rows
    `s * rows` on; with `sizes`, the rows of each shard's block, shard s owns `sizes[s]` rows
    from `sum(sizes[:s])` on, its map in its first `sizes[s]` entries, a block of fewer than 2
    rows none). Each id is resident in one shard at most. The shards holding a map are the
    first ones (ceil blocks: the trailing blocks are the smaller), in order; each one's
    default row is its block's last row, whatever its size."""
    shard_rows = np.shape(states.sorted_hi)[-1]  # a map holds one entry per slot of its shard
    raw = (
        RawIds(np.asarray(states.sorted_hi), np.asarray(states.sorted_lo))
        .to_int64()
        .reshape(-1, shard_rows)
    )
    sizes = [shard_rows] * raw.shape[0] if sizes is None else list(sizes)
    offsets = np.cumsum([0, *sizes[:-1]])
    mapped = [s for s, z in enumerate(sizes) if z >= 2]
    slots = np.asarray(states.slots, np.int64).reshape(-1, shard_rows)
    rows = slots + offsets[:, None]
    resident = (raw != np.iinfo(np.int64).max) & (
        np.arange(shard_rows)[None, :] < np.asarray(sizes)[:, None]
    )
    ids, rows = raw[resident], rows[resident]
    order = np.argsort(ids, kind="stable")
    defaults = np.asarray([offsets[s] + sizes[s] - 1 for s in mapped], np.int64)
    return FrozenIdMap(ids[order], rows[order].astype(np.int32), defaults)
