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
  tail     `[T_cap]` int32: the sorted positions at rank `HEAD` or later in their run (the
           first `HEAD` of each run are read through `offsets`); padding `N_cap`.
  tail_run `[T_cap]` int32: the run of each tail position, non-decreasing; padding `U_cap`.
  chunks   `[K_cap + 1]` int32 or None: when a run is longer than `LONG_RUN` ids, every run
           split into chunks of at most `chunk_size(longest run)` consecutive sorted
           positions: chunk c is positions `chunks[c] : chunks[c + 1]` (padding: empty
           chunks at `N`). The Pallas update sums each chunk in its own program, then each
           run's chunk sums (`_kernels._pallas.chunk_sums`): a hot row's thousands of ids
           are no longer one program's serial loop. None when every run is short.
  run_chunks `[U_cap + 1]` int32 or None: run u is chunks `run_chunks[u] : run_chunks[u + 1]`
           (padding runs: empty).
The update sums the first `HEAD` ids of every run by gathers (one fused loop, no scatter) and
adds the few longer runs' remaining ids with a sorted segment sum: with uniform ids almost
every run is that short (W1: 7,576 tail ids of 327,680).
Within a run the ids keep their batch order (a stable sort), and the update adds them in
that order, so a run's gradient is summed as the in-program form
(`optim._apply.dedup_row_grads`) sums it.
Ids the lookup skips (bounds_check="skip", outside their table) are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from sparse_jax import _capacity
from sparse_jax._configs import PoolingType
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._layout import TableLayout

__all__ = ["HEAD", "LONG_RUN", "RUN_LADDER", "SortedIds", "chunk_size", "sort_group", "sort_host"]


HEAD = 2  # ids per run summed by gathers; the rest of a run goes through the segment sum
# rungs for the unique rows and the long runs' ids: 8 per octave (at most ~9% padding rows,
# each of which the update gathers, steps and drops); the id stream takes the module's ladder
RUN_LADDER = _capacity.make_ladder(smallest=8, steps_per_octave=8)
LONG_RUN = 64  # a batch with a longer run carries chunks for the Pallas update


def chunk_size(longest: int) -> int:
    """Ids per chunk for a batch whose longest run has `longest` ids: the power of two at
    or above its square root (at least 16), so neither a chunk's program nor its run's
    sum of chunk sums is long. A host layout choice only: the kernels read the offsets."""
    return max(16, 1 << max(0, int(np.ceil(np.sqrt(max(longest, 1)))) - 1).bit_length())


class SortedIds(NamedTuple):
    """One buffer's row-sorted id stream (see the module docstring for each field)."""

    unique: np.ndarray
    offsets: np.ndarray
    row: np.ndarray
    bag: np.ndarray
    scale: np.ndarray
    tail: np.ndarray
    tail_run: np.ndarray
    chunks: np.ndarray | None = None
    run_chunks: np.ndarray | None = None


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
) -> SortedIds:
    """`group`'s `SortedIds` from a host KJT (numpy leaves)."""
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
    run = np.repeat(np.arange(starts.size, dtype=np.int64), np.diff(np.append(starts, n)))
    tail = np.flatnonzero(np.arange(n) - starts[run] >= HEAD)
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
    t_cap = _capacity.capacity_for(max(tail.size, 1), RUN_LADDER, what=f"long runs of {what}")
    return SortedIds(
        unique=_capacity.pad_ids(rows_s[starts].astype(np.int32), u_cap, fill=num_rows),
        offsets=_capacity.pad_ids(np.append(starts, n).astype(np.int32), u_cap + 1, fill=n),
        row=_capacity.pad_ids(rows_s.astype(np.int32), n_cap, fill=num_rows),
        bag=_capacity.pad_ids(bags[order].astype(np.int32), n_cap, fill=n_features * kjt.stride()),
        scale=_capacity.pad_ids(scales[order], n_cap),
        tail=_capacity.pad_ids(tail.astype(np.int32), t_cap, fill=n_cap),
        tail_run=_capacity.pad_ids(run[tail].astype(np.int32), t_cap, fill=u_cap),
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
) -> dict[str, SortedIds]:
    """Every buffer's `SortedIds` (group name -> stream) from a host KJT."""
    return {
        g: sort_group(kjt, layout, g, weighted=weighted, bounds_check=bounds_check, ladder=ladder)
        for g in layout.groups
    }
