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
    table row of each (int32), and the default row, the row of the last slot of a shard of
    `default_row + 1` rows. With `shards > 1` (a row-wise table managed per shard) an id
    not resident reads the default row of the shard it hashes to (`hashed_slots(id,
    shards)`), as the training module reads it."""

    ids: np.ndarray
    rows: np.ndarray
    default_row: int
    shards: int = 1


def frozen_map(states: MCHState, sizes=None) -> FrozenIdMap:
    """The `FrozenIdMap` of a table's id map (host arrays, `[rows]`: one map for the whole
    table) or id maps stacked one per shard (`[shards, rows]`: shard s owns table rows
    `s * rows` on; with `sizes`, the rows of each shard's block, shard s owns `sizes[s]` rows
    from `sum(sizes[:s])` on, its map in its first `sizes[s]` entries, a block of fewer than 2
    rows none). Each id is resident in one shard at most. Blocks of unequal sizes freeze
    only when every block holding a map has the same rows (the trailing block of an uneven
    row-wise split has one row or none): a server finds an id's default row as
    `hashed_slots(id, shards) * (default_row + 1) + default_row`."""
    shard_rows = np.shape(states.sorted_hi)[-1]  # a map holds one entry per slot of its shard
    raw = (
        RawIds(np.asarray(states.sorted_hi), np.asarray(states.sorted_lo))
        .to_int64()
        .reshape(-1, shard_rows)
    )
    sizes = [shard_rows] * raw.shape[0] if sizes is None else list(sizes)
    maps = [z for z in sizes if z >= 2]
    if len(set(maps)) > 1:
        raise ValueError(
            f"id maps over row blocks of {sizes} rows cannot be frozen: a frozen map's shards hold one "
            "number of rows each"
        )
    offsets = np.cumsum([0, *sizes[:-1]])
    slots = np.asarray(states.slots, np.int64).reshape(-1, shard_rows)
    rows = slots + offsets[:, None]
    resident = (raw != np.iinfo(np.int64).max) & (
        np.arange(shard_rows)[None, :] < np.asarray(sizes)[:, None]
    )
    ids, rows = raw[resident], rows[resident]
    order = np.argsort(ids, kind="stable")
    return FrozenIdMap(ids[order], rows[order].astype(np.int32), maps[0] - 1, len(maps))
