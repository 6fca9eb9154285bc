"""Plain-loop oracles. Slow, obvious, and independent of the code they check.

Every fast path in the library is compared against one of these. They use Python lists
and numpy scalars only: no vectorized tricks.
"""

from __future__ import annotations

import math

import numpy as np

# ---------------------------------------------------------------- jagged data


def bags(keys, values, lengths, stride):
    """{key: [[ids of bag 0], [ids of bag 1], ...]} by walking key-major lengths."""
    out, pos = {}, 0
    for k_index, key in enumerate(keys):
        out[key] = []
        for b in range(stride):
            n = int(lengths[k_index * stride + b])
            out[key].append([int(v) for v in values[pos : pos + n]])
            pos += n
    return out


def padded_dense(bag_list, length, padding_value=0):
    rows = []
    for bag in bag_list:
        row = list(bag[:length]) + [padding_value] * max(0, length - len(bag))
        rows.append(row)
    return rows


def segment_ids(lengths, capacity):
    ids = []
    for bag_index, n in enumerate(lengths):
        ids.extend([bag_index] * int(n))
    ids.extend([len(lengths)] * (capacity - len(ids)))
    return ids
