"""Host-side batch preparation: a KJT read to numpy once, padded once, ready to place.

`prepare` (the sparse-module contract, `_module.py`) runs here before anything reaches a
device: the ids are checked on the host copy that the loader produced (so the check never
waits for a device), padded to a ladder rung with length caps (`length_cap`) that only grow
(`LengthCaps`), and placed with one `device_put`. A KJT built from numpy (as `hybrid`
builds it from torch tensors) is read without a copy; a KJT already on a device is read
back once (documented: feed host batches to keep the step free of device reads).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from sparse_jax import _capacity, _validate
from sparse_jax._jagged import KeyedJaggedTensor

__all__ = ["LengthCaps", "aligned_zeros", "host_kjt", "pad_host"]


ALIGN = 64  # bytes: XLA:CPU takes a host array this aligned without copying it


def aligned_zeros(*sizes: tuple[int | tuple[int, ...], np.dtype]) -> list[np.ndarray]:
    """`np.zeros(shape, dtype)` for each `(shape, dtype)`, carved from one allocation, each
    starting on a 64-byte boundary: `jax.device_put` on CPU then takes them without a copy
    (it copies a less aligned numpy array: ~0.15 ms for a 65,536-id batch's words and
    positions). They are the device arrays' memory from then on: fill them before placing
    them, never after. (The server's request packing has its own, `hybrid.serving._request
    ._zeros`: the server never imports jax.)"""
    shapes = [
        ((shape,) if isinstance(shape, int) else tuple(shape), np.dtype(dtype))
        for shape, dtype in sizes
    ]
    nbytes = [int(np.prod(shape)) * dtype.itemsize for shape, dtype in shapes]
    spans = [-(-n // ALIGN) * ALIGN for n in nbytes]
    buffer = np.zeros(sum(spans) + ALIGN, np.uint8)
    start = -buffer.ctypes.data % ALIGN
    out = []
    for (shape, dtype), n, span in zip(shapes, nbytes, spans, strict=True):
        out.append(buffer[start : start + n].view(dtype).reshape(shape))
        start += span
    return out


def host_kjt(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """`kjt` with numpy leaves (no copy for numpy leaves; one read for device arrays)."""
    children, aux = kjt.tree_flatten()
    return KeyedJaggedTensor.tree_unflatten(
        aux, tuple(None if c is None else np.asarray(c) for c in children)
    )


def pad_host(
    kjt: KeyedJaggedTensor, ladder: Sequence[int] | None, caps: Sequence[int]
) -> KeyedJaggedTensor:
    """A host KJT padded to `ladder`'s rung (padding ids 0, weight 0, after the last bag),
    with the given static length caps (one per key)."""
    offsets = np.asarray(kjt.offsets(), np.int32)
    n = int(offsets[-1]) if offsets.size else 0
    cap = _capacity.capacity_for(max(n, 1), ladder, what="sparse batch")
    lengths = np.asarray(kjt.lengths(), np.int32)
    ids = _validate.as_id_array(
        np.asarray(kjt.values())[:n],
        what="sparse batch",
        where=lambda i: _validate.locate(i, lengths, kjt.keys(), kjt.stride()),
    )  # int32 (x64 off): an id that does not fit raises, never truncated
    padded = _capacity.pad_ids(ids, cap)
    weights = kjt.weights_or_none()
    if weights is not None:
        weights = _capacity.pad_ids(np.asarray(weights, np.float32)[:n], cap)
    return KeyedJaggedTensor.tree_unflatten(
        (tuple(kjt.keys()), kjt.stride(), tuple(int(c) for c in caps)),
        (padded, weights, lengths, offsets),
    )


class LengthCaps:
    """Per-feature bag-length caps that only grow (so a steady loop keeps one program).

    `observe(kjt)` returns the caps for this host batch (`length_cap` of its longest bag,
    never below what was seen before) and records them. Thread-safe: a pipeline prepares
    batches on a background thread.
    """

    def __init__(self):
        self._caps: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe(self, kjt: KeyedJaggedTensor) -> tuple[int, ...]:
        keys, stride = kjt.keys(), kjt.stride()
        lengths = np.asarray(kjt.lengths()).reshape(len(keys), stride)
        with self._lock:
            caps = _capacity.length_caps(lengths, [self._caps.get(k, 1) for k in keys])
            self._caps.update(zip(keys, caps, strict=True))
        return caps
