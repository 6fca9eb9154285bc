"""Raw ids through a managed table's frozen id map, on the host, with numpy only (serving
imports nothing of the training library).

The map (`sparse_jax.FrozenIdMap`, written by `hybrid.export`): resident raw ids ascending,
the row of each, and the default row of each shard holding a map (one for one map). An id
not resident reads its shard's default row; with several shards (a row-wise table managed
per shard, its blocks of one size or two) the shard is `sparse_jax.hashed_slots(id,
shards)`, which `hashed_slots` below computes bit for bit.
"""

from __future__ import annotations

import numpy as np

__all__ = ["frozen_rows", "hashed_slots"]

_GOLDEN = np.uint32(0x9E3779B9)


def _mix(h: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finalizer (sparse_jax.optim._rounding._mix), wrapping uint32."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def hashed_slots(values: np.ndarray, num_embeddings: int) -> np.ndarray:
    """int64 ids -> int64 slot in [0, num_embeddings): `sparse_jax.hashed_slots` (seed 0)."""
    values = np.asarray(values, np.int64)
    hi = (values >> 32).astype(np.uint32)  # the high word's bits (int32 in sparse_jax, same bits)
    lo = (values & 0xFFFFFFFF).astype(np.uint32)
    with np.errstate(over="ignore"):
        x = _mix(lo ^ _mix(hi + _GOLDEN))
    return (x % np.uint32(num_embeddings)).astype(np.int64)


def frozen_rows(id_map, values: np.ndarray) -> np.ndarray:
    """int64 table rows of int64 raw ids `values` through `id_map` (ids, rows, default rows:
    one per shard holding a map, int64): a resident id's row, else the default row of its
    shard (`hashed_slots(id, shards)` with several)."""
    ids, rows, default_rows = id_map
    values = np.asarray(values, np.int64)
    if len(default_rows) > 1:
        default = np.asarray(default_rows, np.int64)[hashed_slots(values, len(default_rows))]
    else:
        default = np.full(values.shape, default_rows[0], np.int64)
    at = np.minimum(np.searchsorted(ids, values), max(len(ids) - 1, 0))
    hit = (ids[at] == values) if len(ids) else np.zeros(values.shape, bool)
    return np.where(hit, rows[at] if len(ids) else 0, default).astype(np.int64)
