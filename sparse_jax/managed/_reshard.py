"""A managed table's id maps moved onto another split of its rows (host, numpy).

A managed table keeps one id map (`MCHState`) per shard: one for an unsharded or replicated
table, one per row block for a row-wise table (the plan's blocks, `ceil(rows / shards)` rows
each, the trailing ones smaller: `row_block_sizes`; maps stacked `[shards, largest block]`,
a smaller block's map in its first entries; a block of fewer than 2 rows holds none), whose
ids go to shards by `hashed_slots(id, K)` over the K shards holding a map. A checkpoint saved with one split is loaded with another by
`reshard_id_maps`: every resident id moves to the shard it hashes to under the new split,
keeping its count and last access, and takes a slot there; `row_source` says which saved
table row each new row takes, so the rows (and their optimizer state) move with their ids.
Free slots keep whatever row they had (a slot's row is reset when an id is given it); each
new shard's default row is the saved default row of map `s % old maps` (a split into
more shards copies the default rows, a merge keeps the first shard's).

A shard with more resident ids than its slots (ids do not split evenly under a hash) keeps
the strongest by the eviction policy (LFU: count, LRU and TTL: last access, DistanceLFU: its
score at the saved step; then the smaller raw id); the others are dropped as an eviction would drop them (counted as evictions) and
start over if seen again. The eviction windows move too (their entries are ids with the
step they were seen at: each goes to its id's new shard), so a run resumed mid-window
evicts as it would have.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sparse_jax.managed._id_map import (
    _HI_MAX,
    _LO_MAX,
    MCHManagedCollisionModule,
    MCHState,
    RawIds,
    _split_int64,
    hashed_slots,
)
from sparse_jax.plan._layout import row_block_sizes

__all__ = ["ReshardedIdMaps", "reshard_id_maps"]

_EMPTY = np.iinfo(np.int64).max


class ReshardedIdMaps(NamedTuple):
    state: MCHState  # numpy leaves stacked one per new shard: [shards, ...]
    counters: (
        np.ndarray
    )  # int32 [shards, 3]: occupancy, admissions, evictions (totals kept on shard 0)
    row_source: np.ndarray  # int64 [num_embeddings]: the saved table row each new row takes
    dropped: int  # resident ids no new shard had a slot for


def _owners(raw: np.ndarray, maps: int) -> np.ndarray:
    """The map (0 .. maps - 1) each id belongs to."""
    if maps == 1 or raw.size == 0:
        return np.zeros(raw.shape, np.int64)
    return np.asarray(hashed_slots(RawIds.from_int64(raw), maps), np.int64)


def _blocks(z: int, shards: int) -> list[int]:
    """Rows of each shard's block: the whole table for one map, else the row-wise blocks."""
    return [z] if shards == 1 else row_block_sizes(z, shards)


def reshard_id_maps(
    state: MCHState, counters: np.ndarray, module: MCHManagedCollisionModule, shards: int
) -> ReshardedIdMaps:
    """The id maps `state` (numpy leaves stacked one per saved shard, `[S, ...]`; `module`
    is the whole table's, `zch_size` its rows) and their `counters` (`[S, 3]`) moved onto
    `shards` shards (module docstring)."""
    state = MCHState(*(np.asarray(leaf) for leaf in state))
    z = module.zch_size
    old = state.sorted_hi.shape[0]
    sizes_new = _blocks(z, shards)
    if sizes_new[0] < 2:
        raise ValueError(
            f"id maps of a table of {z} rows cannot move from {old} to {shards} shard(s): a map per "
            "row block needs at least 2 rows in the first block (one is its default row); give the "
            "table more rows than shards"
        )
    sizes_old = _blocks(z, old)  # a saved row-wise split is the plan's blocks of the same rows
    width, saved_window = state.sorted_hi.shape[1], state.window_hi.shape[1]
    if width != sizes_old[0] or saved_window != module.history_capacity:
        saved_rows = z if width == sizes_old[0] else old * width
        raise ValueError(
            f"the saved id maps hold {saved_rows} rows and windows of {saved_window} ids, this table "
            f"{z} rows and history_capacity={module.history_capacity}; load them with the saved "
            "zch_size and history_capacity (only the split may change)"
        )
    if len({int(x) for x in state.step}) != 1 or len({int(x) for x in state.last_eviction}) != 1:
        raise ValueError(
            "the saved id maps of one table disagree on their step or last eviction; the checkpoint "
            "is not of one run"
        )
    width_old, width_new = sizes_old[0], sizes_new[0]
    offsets_old = np.cumsum([0, *sizes_old[:-1]])
    offsets_new = np.cumsum([0, *sizes_new[:-1]])
    maps_old = [o for o in range(old) if sizes_old[o] >= 2]
    maps_new = [s for s in range(shards) if sizes_new[s] >= 2]
    raw = RawIds(state.sorted_hi, state.sorted_lo).to_int64()  # [old, width_old]
    in_map = np.arange(width_old)[None, :] < np.asarray(sizes_old)[:, None]
    resident = (raw != _EMPTY) & in_map
    shard_of = np.repeat(np.arange(old), width_old).reshape(old, width_old)
    ids = raw[resident]
    source = (offsets_old[shard_of] + state.slots)[resident]
    counts, lasts = state.counts[resident], state.last_access[resident]
    owner = _owners(ids, len(maps_new))
    score = _strength(module, counts, lasts, int(state.step[0]))

    out = {f: [] for f in MCHState._fields}
    row_source = np.arange(
        z, dtype=np.int64
    )  # free rows: whatever they hold (reset when given to an id)
    window = _moved_window(state, len(maps_new), module.history_capacity)
    fresh = MCHManagedCollisionModule(width_new, history_capacity=module.history_capacity).init()
    dropped = 0
    for s in range(shards):
        rows_new, first = sizes_new[s], int(offsets_new[s])
        pad = width_new - rows_new
        if rows_new < 2:  # no map: an empty one, its step the others'
            for field in ("sorted_hi", "sorted_lo", "slots", "counts", "last_access"):
                out[field].append(np.asarray(getattr(fresh, field)))
            for field in ("window_hi", "window_lo", "window_step"):
                out[field].append(np.zeros_like(np.asarray(getattr(fresh, field))))
            out["window_used"].append(np.int32(0))
            out["step"].append(state.step[0])
            out["last_eviction"].append(state.last_eviction[0])
            continue
        k_map = maps_new.index(s)
        mine = np.flatnonzero(owner == k_map)
        keep = mine[np.lexsort((ids[mine], -score[mine]))][
            : rows_new - 1
        ]  # strongest, then smaller id
        dropped += len(mine) - len(keep)
        keep = keep[np.argsort(ids[keep], kind="stable")]  # the map keeps its ids ascending
        k = len(keep)
        hi, lo = _split_int64(np.concatenate([ids[keep], np.full(width_new - k, _EMPTY)]))
        row_source[first : first + k] = source[keep]
        o = maps_old[k_map % len(maps_old)]
        row_source[first + rows_new - 1] = offsets_old[o] + sizes_old[o] - 1  # the default row
        tail = (o, sizes_old[o] - 1)  # the default entry's metadata (its map's last entry)
        out["sorted_hi"].append(hi)
        out["sorted_lo"].append(lo)
        out["slots"].append(np.arange(width_new, dtype=np.int32))
        out["counts"].append(
            np.concatenate(
                [counts[keep], np.zeros(rows_new - k - 1), [state.counts[tail]], np.zeros(pad)]
            )
        )
        out["last_access"].append(
            np.concatenate(
                [lasts[keep], np.zeros(rows_new - k - 1), [state.last_access[tail]], np.zeros(pad)]
            )
        )
        for field, leaf in zip(
            ("window_hi", "window_lo", "window_step", "window_used"), window[k_map], strict=True
        ):
            out[field].append(leaf)
        out["step"].append(state.step[0])
        out["last_eviction"].append(state.last_eviction[0])
    dtypes = {f: leaf.dtype for f, leaf in zip(MCHState._fields, state, strict=True)}
    new = MCHState(**{f: np.stack(v).astype(dtypes[f]) for f, v in out.items()})
    totals = np.asarray(counters, np.int64).sum(axis=0)
    new_counters = np.zeros((shards, 3), np.int64)
    new_counters[:, 0] = ((new.sorted_hi != _HI_MAX) | (new.sorted_lo != _LO_MAX)).sum(axis=1)
    new_counters[0, 1:] = totals[1:] + [0, dropped]
    return ReshardedIdMaps(
        new, np.minimum(new_counters, np.iinfo(np.int32).max).astype(np.int32), row_source, dropped
    )


def _strength(module: MCHManagedCollisionModule, counts, lasts, step: int) -> np.ndarray:
    """Which resident ids a shard keeps first (higher first), by the module's policy."""
    if module.eviction_policy == "lfu":
        return counts
    if module.eviction_policy == "distance_lfu":
        distance = (step - lasts.astype(np.int64) + 1).astype(np.float32)
        return counts.astype(np.float32) / np.power(distance, np.float32(module.decay_exponent))
    return lasts  # LRU and TTL: the most recently seen


def _moved_window(state: MCHState, shards: int, capacity: int) -> list[tuple]:
    """Per new map (window_hi, window_lo, window_step, window_used): the saved windows'
    entries whose ids it owns, in saved order."""
    used = np.arange(capacity)[None, :] < state.window_used[:, None]
    raw = RawIds(state.window_hi[used], state.window_lo[used]).to_int64()
    steps = state.window_step[used]
    owner = _owners(raw, shards)
    out = []
    for s in range(shards):
        mine = np.flatnonzero(owner == s)
        if len(mine) > capacity:
            raise ValueError(
                f"the saved eviction windows hold {len(mine)} ids for new shard {s}, more than its "
                f"history_capacity={capacity}; resume with the saved sharding until the next eviction"
            )
        hi, lo = _split_int64(np.concatenate([raw[mine], np.zeros(capacity - len(mine), np.int64)]))
        step = np.concatenate([steps[mine], np.zeros(capacity - len(mine), steps.dtype)])
        out.append((hi, lo, step, np.int32(len(mine))))
    return out
