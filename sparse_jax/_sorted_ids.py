"""The row-sorted id stream of a batch, built once on the host by `prepare`.

A fused update sums every id's gradient row into its table row. Sorting the ids by row turns
that into a sum over runs of equal rows (`segment_sum(..., indices_are_sorted=True)`) and a
write of unique rows (`unique_indices=True`): no sort inside the program, no `searchsorted`,
and `[unique, dim]` temporaries instead of `[ids, dim]`. The sort runs here, in numpy, when
the batch is prepared (off the critical path under `hybrid.TrainPipeline`, which prepares
the next batch while a step runs).

Per buffer (group) a `SortedIds`, padded to ladder rungs so a steady loop keeps one program
(the id stream to the module's ladder, unique rows and long runs to the finer `RUN_LADDER`):
  unique   `[U_cap]` int32: the rows the batch touches, ascending; padding is `num_rows`
           (out of range: gathers read 0, scatters drop it).
  offsets  `[U_cap + 1]` int32: run u is sorted positions `offsets[u] : offsets[u + 1]`
           (padding runs are empty).
  row      `[N_cap]` int32: per sorted position, its row (ascending); padding `num_rows`.
  bag      `[N_cap]` int32: per sorted position, its bag `j * B + b` (the group's j-th
           feature, sample b), as `sparse_jax._lookup.id_stream` numbers bags; padding `F_g * B`.
  scale    `[N_cap]` fp32: the id's weight (times 1 / length for MEAN); padding 0.
  buckets  one `RunBucket` per length class of `RUN_CLASSES` (cap c): the runs of at
           most c ids (and more than the class below), as `rows [R]` (padding `num_rows`),
           `bag [R, c]` and `scale [R, c]`: each run's ids in sorted order, padded with the
           bag `F_g * B` (the update's zero gradient row) and scale 0.
  long     `LongRuns` or None: the runs longer than the last class, cut into chunks of
           `CHUNK` ids (`bag`, `scale` `[K, CHUNK]`, padded as above) and each run's chunks
           `chunks [R_long, M]` (padding: the out-of-range chunk K); None while no batch of
           this buffer (under the collection's `BucketCaps`) had such a run.
  chunks   `[K_cap + 1]` int32 or None: when a run is longer than `LONG_RUN` ids, every run
           split into chunks of at most `chunk_size(longest run)` consecutive sorted
           positions: chunk c is positions `chunks[c] : chunks[c + 1]` (padding: empty
           chunks at `N`). The Pallas update sums each chunk in its own program, then each
           run's chunk sums (`_kernels._pallas.chunk_sums`): a hot row's thousands of ids
           are no longer one program's serial loop. None when every run is short.
  run_chunks `[U_cap + 1]` int32 or None: run u is chunks `run_chunks[u] : run_chunks[u + 1]`
           (padding runs: empty).
The pure-XLA update (`optim._apply.sum_runs`) sums each bucket's runs by gathering the
gradient rows of its `[R, c]` matrix and adding them position by position (one fused loop per
class; no scatter-add, no `[ids, dim]` temporary): padding work is under 2x the ids (W1:
1.04x uniform, 1.15x Zipf(1.15)). Within a run the ids keep their batch order (a stable
sort) and are added in that order, so a run of at most `CHUNK` ids is summed as the
in-program form (`optim._apply.dedup_row_grads`) sums it; a longer run adds its chunk sums.
The rungs of the buckets only grow (`BucketCaps`), so a steady loop keeps one program.
Ids the lookup skips (bounds_check="skip", outside their table) are left out.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from sparse_jax import _capacity
from sparse_jax._configs import PoolingType
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._layout import TableLayout

__all__ = [
    "CHUNK",
    "LONG_RUN",
    "RUN_CLASSES",
    "RUN_LADDER",
    "BucketCaps",
    "LongRuns",
    "RunBucket",
    "SortedIds",
    "chunk_size",
    "sort_group",
    "sort_host",
]


RUN_CLASSES = (1, 2, 4, 8, 16, 32, 64)  # run-length caps of the buckets (padding under 2x)
CHUNK = RUN_CLASSES[-1]  # a longer run is summed in chunks of this many ids
# rungs for the unique rows and the long runs' ids: 8 per octave (at most ~9% padding rows,
# each of which the update gathers, steps and drops); the id stream takes the module's ladder
RUN_LADDER = _capacity.make_ladder(smallest=8, steps_per_octave=8)
LONG_RUN = 64  # a batch with a longer run carries chunks for the Pallas update


def chunk_size(longest: int) -> int:
    """Ids per chunk for a batch whose longest run has `longest` ids: the power of two at
    or above its square root (at least 16), so neither a chunk's program nor its run's
    sum of chunk sums is long. A host layout choice only: the kernels read the offsets."""
    return max(16, 1 << max(0, int(np.ceil(np.sqrt(max(longest, 1)))) - 1).bit_length())


class RunBucket(NamedTuple):
    """The runs of one length class: their rows `[R]`, bags and scales `[R, cap]`."""

    rows: np.ndarray
    bag: np.ndarray
    scale: np.ndarray


class LongRuns(NamedTuple):
    """Runs longer than `CHUNK`: rows `[R]`, their chunks' bags and scales `[K, CHUNK]`,
    and each run's chunk indices `[R, M]` (padding K)."""

    rows: np.ndarray
    bag: np.ndarray
    scale: np.ndarray
    chunks: np.ndarray


class SortedIds(NamedTuple):
    """One buffer's row-sorted id stream (see the module docstring for each field)."""

    unique: np.ndarray
    offsets: np.ndarray
    row: np.ndarray
    bag: np.ndarray
    scale: np.ndarray
    buckets: tuple[RunBucket, ...]
    long: LongRuns | None = None
    chunks: np.ndarray | None = None
    run_chunks: np.ndarray | None = None


class BucketCaps:
    """Per buffer, the rungs of its buckets (runs per class; long runs, their chunks and the
    most chunks of one run), never below what an earlier batch needed, so a steady loop
    keeps one program (as `_prepare.LengthCaps` does for bag lengths). Thread-safe: a
    pipeline prepares batches on a background thread."""

    def __init__(self):
        self._seen: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def grow(self, group: str, need: Sequence[int]) -> tuple[int, ...]:
        with self._lock:
            old = self._seen.get(group, (0,) * len(need))
            got = tuple(max(a, int(b)) for a, b in zip(old, need, strict=True))
            self._seen[group] = got
        return got


def _positions(begin, end, width: int, cap: int, bag_s, scale_s, no_bag: int):
    """`[cap, width]` bags and scales of sorted positions `begin[i] + l` (< `end[i]`);
    the rest is padding (bag `no_bag`, scale 0)."""
    bag = np.full((cap, width), no_bag, np.int32)
    scale = np.zeros((cap, width), np.float32)
    if begin.size:
        pos = begin[:, None] + np.arange(width)[None, :]
        ok = pos < end[:, None]
        pos = np.where(ok, pos, 0)
        bag[: begin.size] = np.where(ok, bag_s[pos], no_bag)
        scale[: begin.size] = np.where(ok, scale_s[pos], 0)
    return bag, scale


def _buckets(rows_u, starts, ends, bag_s, scale_s, *, no_bag, num_rows, group, caps):
    """(buckets, long runs) of the runs `starts[u] : ends[u]` (rows `rows_u`)."""
    lengths = ends - starts
    cls = np.searchsorted(np.asarray(RUN_CLASSES), lengths)  # first cap >= length
    top = len(RUN_CLASSES)
    long = np.flatnonzero(cls == top)
    per = -(-lengths[long] // CHUNK)

    def rung(n, what):
        return _capacity.capacity_for(
            max(int(n), 1), RUN_LADDER, what=f"{what} of buffer {group!r}"
        )

    counts = np.bincount(cls, minlength=top + 1)
    need = [
        rung(c, f"runs of at most {cap} ids")
        for c, cap in zip(counts[:-1], RUN_CLASSES, strict=True)
    ]
    if long.size:
        most = 1 << (int(per.max()) - 1).bit_length()
        need += [rung(long.size, "long runs"), rung(per.sum(), "long-run chunks"), most]
    else:
        need += [0, 0, 0]
    got = caps.grow(group, need) if caps is not None else tuple(need)

    def rows_of(sel, cap):
        return _capacity.pad_ids(rows_u[sel].astype(np.int32), cap, fill=num_rows)

    buckets = []
    for k, cap in enumerate(RUN_CLASSES):
        sel = np.flatnonzero(cls == k)
        bag, scale = _positions(starts[sel], ends[sel], cap, got[k], bag_s, scale_s, no_bag)
        buckets.append(RunBucket(rows_of(sel, got[k]), bag, scale))
    r_cap, k_cap, m_cap = got[top:]
    if not r_cap:
        return tuple(buckets), None
    first = np.cumsum(per) - per  # each long run's first chunk
    run = np.repeat(np.arange(long.size), per)
    begin = starts[long][run] + (np.arange(run.size) - first[run]) * CHUNK
    bag, scale = _positions(begin, ends[long][run], CHUNK, k_cap, bag_s, scale_s, no_bag)
    chunks = np.full((r_cap, m_cap), k_cap, np.int32)
    m = np.arange(m_cap)[None, :]
    chunks[: long.size] = np.where(m < per[:, None], first[:, None] + m, k_cap)
    return tuple(buckets), LongRuns(rows_of(long, r_cap), bag, scale, chunks)


def _group_stream(
    kjt: KeyedJaggedTensor, layout: TableLayout, group: str, *, weighted: bool, bounds_check: str
):
    """(rows, bags, scales) of the ids that contribute to `group`, in batch order (numpy)."""
    stride = kjt.stride()
    offsets = np.asarray(kjt.offsets(), np.int64)
    lengths = np.asarray(kjt.lengths(), np.int64)
    values = np.asarray(kjt.values())
    weights = np.asarray(kjt.weights(), np.float32) if weighted else None
    key_indices = layout.key_indices(kjt.keys())
    rows, bags, scales = [], [], []
    members = [i for i, s in enumerate(layout.features) if s.group == group]
    for j, i in enumerate(members):
        slot, ki = layout.features[i], key_indices[i]
        a, b = int(offsets[ki * stride]), int(offsets[(ki + 1) * stride])
        ids = values[a:b].astype(np.int64)
        bag_len = lengths[ki * stride : (ki + 1) * stride]
        bag = j * stride + np.repeat(np.arange(stride, dtype=np.int64), bag_len)
        scale = weights[a:b] if weights is not None else np.ones(b - a, np.float32)
        if slot.pooling is PoolingType.MEAN:
            scale = scale / np.repeat(np.maximum(bag_len, 1), bag_len).astype(np.float32)
        if bounds_check == "clamp":
            ids = np.clip(ids, 0, slot.num_rows - 1)
        else:  # "error" checked them already; "skip" drops them, as the lookup does
            keep = (ids >= 0) & (ids < slot.num_rows)
            ids, bag, scale = ids[keep], bag[keep], scale[keep]
        rows.append(ids + slot.row_offset)
        bags.append(bag)
        scales.append(scale.astype(np.float32))
    return np.concatenate(rows), np.concatenate(bags), np.concatenate(scales), len(members)


def sort_group(
    kjt: KeyedJaggedTensor,
    layout: TableLayout,
    group: str,
    *,
    weighted: bool,
    bounds_check: str,
    ladder: Sequence[int] | None,
    caps: BucketCaps | None = None,
) -> SortedIds:
    """`group`'s `SortedIds` from a host KJT (numpy leaves); `caps`: the collection's
    bucket rungs (None: each batch its own)."""
    num_rows = layout.groups[group][0]
    rows, bags, scales, n_features = _group_stream(
        kjt, layout, group, weighted=weighted, bounds_check=bounds_check
    )
    n = rows.size
    # one sort of (row, position) packed in an int64: stable by construction, and numpy's
    # vectorised sort of a plain int64 array beats a stable argsort of the rows
    keys = np.sort((rows << 32) | np.arange(n, dtype=np.int64))
    order = keys & 0xFFFFFFFF
    rows_s = keys >> 32
    first = np.ones(n, bool)
    first[1:] = rows_s[1:] != rows_s[:-1]
    starts = np.flatnonzero(first)
    what = f"buffer {group!r}"
    chunks = run_chunks = None
    lengths = np.diff(np.append(starts, n))
    if lengths.size and lengths.max() > LONG_RUN:
        size = chunk_size(int(lengths.max()))
        per_run = -(-lengths // size)
        chunk_run = np.repeat(np.arange(starts.size), per_run)
        first = np.cumsum(per_run) - per_run  # each run's first chunk
        begin = starts[chunk_run] + (np.arange(chunk_run.size) - first[chunk_run]) * size
        k_cap = _capacity.capacity_for(chunk_run.size, RUN_LADDER, what=f"chunks of {what}")
        chunks = _capacity.pad_ids(np.append(begin, n).astype(np.int32), k_cap + 1, fill=n)
        run_chunks = np.append(first, chunk_run.size).astype(np.int32)  # padded below
    n_cap = _capacity.capacity_for(max(n, 1), ladder, what=f"sorted ids of {what}")
    u_cap = _capacity.capacity_for(max(starts.size, 1), RUN_LADDER, what=f"unique rows of {what}")
    no_bag = n_features * kjt.stride()
    bag_s, scale_s = bags[order].astype(np.int32), scales[order]
    buckets, long = _buckets(
        rows_s[starts],
        starts,
        starts + lengths,
        bag_s,
        scale_s,
        no_bag=no_bag,
        num_rows=num_rows,
        group=group,
        caps=caps,
    )
    return SortedIds(
        unique=_capacity.pad_ids(rows_s[starts].astype(np.int32), u_cap, fill=num_rows),
        offsets=_capacity.pad_ids(np.append(starts, n).astype(np.int32), u_cap + 1, fill=n),
        row=_capacity.pad_ids(rows_s.astype(np.int32), n_cap, fill=num_rows),
        bag=_capacity.pad_ids(bag_s, n_cap, fill=no_bag),
        scale=_capacity.pad_ids(scale_s, n_cap),
        buckets=buckets,
        long=long,
        chunks=chunks,
        run_chunks=None
        if run_chunks is None
        else _capacity.pad_ids(run_chunks, u_cap + 1, fill=int(run_chunks[-1])),
    )


def sort_host(
    kjt: KeyedJaggedTensor,
    layout: TableLayout,
    *,
    weighted: bool,
    bounds_check: str,
    ladder: Sequence[int] | None,
    caps: BucketCaps | None = None,
) -> dict[str, SortedIds]:
    """Every buffer's `SortedIds` (group name -> stream) from a host KJT."""
    return {
        g: sort_group(
            kjt, layout, g, weighted=weighted, bounds_check=bounds_check, ladder=ladder, caps=caps
        )
        for g in layout.groups
    }
