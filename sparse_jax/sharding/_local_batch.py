"""Split a global KJT into one local KJT per device, stacked with static shapes.

The batch is split over every device (device `d` of the mesh, row-major, gets samples
`[d * B_l, (d + 1) * B_l)`). Each local KJT keeps the key-major layout; all are padded to
one capacity (a ladder rung) so the stacked arrays are `[devices, capacity]` and
`[devices, num_keys * B_l]`. Eager (host) work, like a per-process data loader's collate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from sparse_jax import _capacity
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._module import PreparedBatch

__all__ = ["LocalBatches", "split_batch"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LocalBatches(PreparedBatch):
    """A sharded collection's prepared batch (`prepare`): per device its part of the global
    batch, padded to one capacity, as `[devices, ...]` arrays placed batch-sharded."""

    values: jax.Array  # [devices, capacity] ids
    lengths: jax.Array  # [devices, num_keys * local_batch]
    weights: jax.Array  # [devices, capacity] (ones when the KJT has none)
    keys: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
    local_batch: int = dataclasses.field(metadata=dict(static=True))
    length_cap: int = dataclasses.field(
        metadata=dict(static=True)
    )  # max bag length, a `length_cap` rung
    # ids each device may send to each peer when ids are routed by all_to_all (0: all-gathered)
    route_capacity: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def stride(self) -> int:
        return self.local_batch * self.values.shape[0]


def split_batch(
    kjt: KeyedJaggedTensor,
    num_devices: int,
    ladder: Sequence[int] | None = None,
    *,
    min_capacity: int = 0,
    min_length_cap: int = 1,
) -> dict:
    """numpy arrays for `LocalBatches` (before placement on the mesh)."""
    stride, keys = kjt.stride(), kjt.keys()
    if stride % num_devices:
        raise ValueError(
            f"batch size {stride} is not divisible by the {num_devices} devices of the mesh; the batch "
            "is split over every device, so use a multiple of the device count"
        )
    b_local = stride // num_devices
    lengths = np.asarray(kjt.lengths()).reshape(len(keys), stride)
    offsets = np.asarray(kjt.offsets())
    values = np.asarray(kjt.values())
    w = kjt.weights_or_none()
    weights = None if w is None else np.asarray(w)
    per_dev = lengths.reshape(len(keys), num_devices, b_local).sum(
        axis=(0, 2)
    )  # [devices], never empty
    cap = _capacity.capacity_for(max(int(per_dev.max()), min_capacity), ladder, what="local batch")
    out_v = np.zeros((num_devices, cap), values.dtype)
    out_w = np.zeros((num_devices, cap), np.float32)
    out_l = np.zeros((num_devices, len(keys) * b_local), np.int32)
    for d in range(num_devices):
        pos = 0
        for k in range(len(keys)):
            a = int(offsets[k * stride + d * b_local])
            b = int(offsets[k * stride + (d + 1) * b_local])
            out_v[d, pos : pos + b - a] = values[a:b]
            out_w[d, pos : pos + b - a] = 1.0 if weights is None else weights[a:b]
            out_l[d, k * b_local : (k + 1) * b_local] = lengths[k, d * b_local : (d + 1) * b_local]
            pos += b - a
    # one position matrix per buffer: the largest of the features' caps (the one cap rule)
    cap_all = max(
        _capacity.length_caps(lengths, [min_length_cap] * len(keys)), default=min_length_cap
    )
    return dict(
        values=out_v,
        lengths=out_l,
        weights=out_w,
        keys=tuple(keys),
        local_batch=b_local,
        length_cap=cap_all,
    )


def pad_parts(parts: dict, capacity: int, length_cap: int) -> dict:
    """`split_batch`'s arrays with the id axis padded to `capacity` (padding: id 0, weight
    0, after the last bag) and the length cap raised to `length_cap`."""
    out = dict(parts, length_cap=max(parts["length_cap"], length_cap))
    for key in ("values", "weights"):
        out[key] = _capacity.pad_ids(parts[key], capacity)
    return out
