"""The pooled lookup's position matrices, built on the host in `prepare`: the XLA form's
id arithmetic done once per batch, off the step.

The XLA form of a pooled lookup (`_lookup.pooled_group`) sums, for each position p below a
feature's length cap, `w * table[row]` over every bag at once. Per group of one buffer and
per class of its features that share a length cap, `position_rows` gives that loop its
operands ready-made:

    rows[p, b * n + k]     the buffer row of position p of sample b's bag of the class's
                           k-th feature (its table's row offset added); 0 past the bag's end
                           and for a skipped id (one cache-hot row that weighs nothing)
    weights[p, b * n + k]  the id's weight (1 unweighted) divided by the bag's length for
                           MEAN pooling; 0 past the bag's end and for a skipped id

Position-major (`[cap, B * n]`), so the loop reads one contiguous row of each per position,
and sample-major bags, so the loop's accumulator `[B * n, dim]` is the pooled output's
layout. Ids out of their table's range are clamped (`bounds_check="clamp"`) or skipped;
`"error"` has refused them before (`check_host`). The values are those the in-program form
computes (`_lookup._pool_bags`) from the padded KJT, bit for bit, so both forms pool to the
same floats.

Built only where the XLA form is the one that runs (`EmbeddingBagCollection(kernel="xla")`,
or "auto" on a backend without the C++ or Pallas kernels): the C++ and Pallas kernels read
the jagged ids themselves. Measured at W1 (8 tables, B 2048, bags of 20, Zipf ids): the
lookup took 0.57-0.81x the time of the in-program form, whose per-position id gathers
XLA:CPU runs as separate single passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sparse_jax._configs import PoolingType
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._layout import FeatureSlot, TableLayout

__all__ = ["cap_classes", "position_rows"]


def cap_classes(
    layout: TableLayout, group: str, caps: Sequence[int]
) -> list[tuple[int, list[int]]]:
    """The group's features (indices into `layout.features`) by length cap, in the order
    the caps first appear among them: `[(cap, [feature, ...]), ...]`. `caps`: per feature
    of the layout (output order)."""
    classes: dict[int, list[int]] = {}
    for i, slot in enumerate(layout.features):
        if slot.group == group:
            classes.setdefault(int(caps[i]), []).append(i)
    return list(classes.items())


def position_rows(
    kjt: KeyedJaggedTensor, layout: TableLayout, *, weighted: bool, bounds_check: str
) -> dict[str, tuple[tuple[np.ndarray, np.ndarray], ...]]:
    """{group: ((rows, weights) per class of `cap_classes`, in its order)} for a padded
    host KJT (numpy leaves, static length caps), each array `[cap, B * n]` (int32, float32)."""
    key_caps = kjt.length_caps()
    if key_caps is None:
        raise ValueError("position_rows takes a padded KJT (static length caps): pad it first")
    key_indices = layout.key_indices(kjt.keys())
    caps = [key_caps[ki] for ki in key_indices]
    values = np.asarray(kjt.values())
    offsets = np.asarray(kjt.offsets(), np.int64)
    lengths = np.asarray(kjt.lengths(), np.int64)
    per_id = np.asarray(kjt.weights(), np.float32) if weighted else None
    stride = kjt.stride()
    out = {}
    for group in layout.groups:
        out[group] = tuple(
            _class_rows(
                values,
                offsets,
                lengths,
                per_id,
                [key_indices[i] for i in members],
                [layout.features[i] for i in members],
                cap,
                stride,
                bounds_check,
            )
            for cap, members in cap_classes(layout, group, caps)
        )
    return out


def _class_rows(
    values, offsets, lengths, per_id, keys, slots: Sequence[FeatureSlot], cap, stride, bounds_check
):
    """(rows, weights) `[cap, B * n]` of the n features `keys` (KJT key indices; `slots`
    their layout facts), bag `b * n + k` being sample b of feature `keys[k]`."""
    bag = (np.asarray(keys, np.int64)[None, :] * stride + np.arange(stride)[:, None]).reshape(-1)
    start, length = offsets[bag], lengths[bag]  # [B * n], sample-major

    def per_bag(per_feature, dtype):
        return np.tile(np.asarray(per_feature, dtype), stride)

    num_rows = per_bag([s.num_rows for s in slots], np.int64)
    row_offset = per_bag([s.row_offset for s in slots], np.int64)
    mean = per_bag([s.pooling is PoolingType.MEAN for s in slots], bool)
    pos = np.arange(cap)[:, None]
    at = np.minimum(start[None, :] + pos, max(values.shape[0] - 1, 0))
    valid = pos < length[None, :]
    ids = values[at].astype(np.int64) if values.shape[0] else np.zeros(at.shape, np.int64)
    if bounds_check == "clamp":
        ids = np.clip(ids, 0, num_rows - 1)
    else:
        inside = (ids >= 0) & (ids < num_rows)
        ids, valid = np.where(inside, ids, 0), valid & inside
    one = per_id[at] if per_id is not None else np.float32(1.0)
    weights = np.where(valid, one, np.float32(0.0)).astype(np.float32)
    if mean.any():
        scale = np.maximum(length, 1).astype(np.float32)
        weights = np.where(mean, weights / scale, weights).astype(np.float32)
    rows = np.where(valid, ids + row_offset, 0).astype(np.int32)
    return rows, weights
