"""Input checks for jagged data, run eagerly on concrete arrays before any device work.

Every message names the feature (key), the batch position and the value, and says how to
fix it. Checks are skipped for traced arrays (inside `jit` the shapes were checked when the
batch was built).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

__all__ = [
    "as_id_array",
    "as_values_array",
    "bag_position",
    "canonical_int",
    "check_agree",
    "check_lengths",
    "check_offsets",
    "check_weights",
    "is_concrete",
    "locate",
    "not_a_batch",
]

_INT32_MAX = np.iinfo(np.int32).max
_INT32_MIN = np.iinfo(np.int32).min


def is_concrete(*arrays) -> bool:
    """True when no array is a tracer (so values can be read on the host)."""
    return not any(isinstance(a, jax.core.Tracer) for a in arrays if a is not None)


def not_a_batch(owner: str, batch) -> TypeError:
    """The error for `owner.apply` given something other than a KJT or a prepared batch,
    naming its class (a torch KJT: how to convert it)."""
    torch_like = callable(getattr(batch, "lengths", None))
    return TypeError(
        f"{owner}.apply takes a sparse_jax.KeyedJaggedTensor or its prepare()d batch, got a "
        f"{type(batch).__module__}.{type(batch).__qualname__}"
        + (
            " (a torch KJT: convert it with hybrid.as_kjt(kjt), or feed hybrid.Model, which "
            "takes TorchRec's)"
            if torch_like
            else ""
        )
    )


def bag_position(bag: int, keys: Sequence[str], stride) -> str:
    """Where flat bag `bag` sits, as "feature 'k', batch position b"; `stride` is the batch
    size, or one batch size per key (a variable-stride KJT)."""
    if isinstance(stride, int | np.integer):
        return (
            f"feature {keys[bag // stride]!r}, batch position {bag % stride}"
            if stride
            else f"bag {bag}"
        )
    starts = np.cumsum([0, *stride])
    k = int(np.searchsorted(starts, bag, side="right")) - 1
    return f"feature {keys[k]!r}, batch position {bag - int(starts[k])}"


def locate(index: int, lengths: np.ndarray, keys: Sequence[str] | None, stride) -> str:
    """Describe where value `index` sits: feature, batch position, and index in the bag."""
    ends = np.cumsum(lengths)
    seg = int(np.searchsorted(ends, index, side="right"))
    start = int(ends[seg - 1]) if seg > 0 else 0
    if not keys:
        return f"bag {seg}, index {index - start} in the bag"
    return f"{bag_position(seg, keys, stride)}, index {index - start} in the bag"


def as_id_array(values, *, what: str, where=None) -> np.ndarray:
    """Host integer ids as int32 (or int64 with x64 on). Never truncates: out-of-range ids raise.

    `where(i)` turns a value index into a location string for the error message.
    """
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what}: values must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{what}: values must be integer ids, got dtype {arr.dtype}; convert with "
            "astype(int32) or hash strings to integers first"
        )
    if jax.config.jax_enable_x64:
        return arr.astype(np.int64, copy=False)
    if arr.size and (arr.dtype.itemsize > 4 or arr.dtype == np.uint32):
        _fits_int32(arr, what=what, where=where)
    return arr.astype(np.int32, copy=False)


def _fits_int32(arr: np.ndarray, *, what: str, where=None, kind: str = "id") -> None:
    bad = np.flatnonzero((arr > _INT32_MAX) | (arr < _INT32_MIN))
    if bad.size:
        i = int(bad[0])
        loc = where(i) if where is not None else f"index {i}"
        raise ValueError(
            f"{what}: {kind} {int(arr[i])} at {loc} does not fit in int32 and jax x64 is off "
            f"({bad.size} such values); hash or remap ids into the table's range, or enable "
            "jax.config.update('jax_enable_x64', True)"
        )


def as_values_array(values, *, what: str, where=None) -> np.ndarray:
    """Jagged values of any numeric dtype and trailing shape (`[N]` ids, `[N, D]` rows, floats),
    in the dtype JAX keeps: the given one, except 64-bit types when x64 is off (int64/uint64
    become int32 after a range check, never truncated; float64 becomes float32)."""
    arr = np.asarray(values)
    if arr.ndim < 1:
        raise ValueError(
            f"{what}: values must have at least one dimension (one entry per id), got a scalar"
        )
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_ or arr.dtype.name == "bfloat16"
    ):
        raise ValueError(
            f"{what}: values must be numbers, got dtype {arr.dtype}; hash strings to integers first"
        )
    if jax.config.jax_enable_x64:
        return arr
    if np.issubdtype(arr.dtype, np.integer) and arr.dtype.itemsize > 4:
        if arr.size:  # per row its largest and smallest entry, so the message names the row
            rows = arr.reshape(arr.shape[0], -1)
            _fits_int32(rows.max(axis=1), what=what, where=where)
            _fits_int32(rows.min(axis=1), what=what, where=where)
        return arr.astype(np.int32)
    if arr.dtype == np.float64:
        return arr.astype(np.float32)
    if arr.dtype == np.complex128:
        return arr.astype(np.complex64)
    return arr


def canonical_int(arr: np.ndarray) -> np.ndarray:
    """Lengths/offsets in the integer dtype JAX keeps: as given with x64, int32 without."""
    if not jax.config.jax_enable_x64 and arr.dtype.itemsize > 4:
        return arr.astype(np.int32)
    return arr


def check_lengths(lengths, num_values: int, *, what: str, keys, stride, exact=True):
    """Lengths are integers >= 0 summing to `num_values` (or at most it when `exact=False`);
    `keys` and `stride` locate a bag for the message (`keys=None`: a keyless JaggedTensor)."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{what}: lengths must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: lengths must be integers, got dtype {arr.dtype}")
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        i = int(neg[0])
        where = bag_position(i, keys, stride) if keys else f"bag {i}"
        raise ValueError(
            f"{what}: length {int(arr[i])} at {where} is negative; lengths count ids per bag"
        )
    total = int(arr.sum())
    if (exact and total != num_values) or total > num_values:
        raise ValueError(
            f"{what}: sum(lengths)={total} but values holds {num_values} ids; every id belongs "
            "to exactly one bag, so the two must match"
        )
    return arr


def check_agree(lengths, from_offsets: np.ndarray, *, what: str, keys, stride) -> None:
    """Lengths and offsets given together must describe the same bags (TorchRec trusts one of
    them silently; a disagreement is a bug in the caller)."""
    arr = np.asarray(lengths)
    if arr.shape != from_offsets.shape:
        raise ValueError(
            f"{what}: lengths has shape {arr.shape} but offsets describe {from_offsets.shape[0]} "
            "bags; give one of them, or both for the same bags"
        )
    bad = np.flatnonzero(arr != from_offsets)
    if bad.size:
        i = int(bad[0])
        where = bag_position(i, keys, stride) if keys else f"bag {i}"
        raise ValueError(
            f"{what}: at {where}, lengths says {int(arr[i])} ids but offsets say "
            f"{int(from_offsets[i])}; give one of them, or both for the same bags"
        )


def check_offsets(offsets, num_values: int, *, what: str) -> np.ndarray:
    """Offsets start at 0, never decrease, and end at `num_values`; returns the lengths."""
    arr = np.asarray(offsets)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(
            f"{what}: offsets must be 1-D with at least one entry (0), got shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: offsets must be integers, got dtype {arr.dtype}")
    if int(arr[0]) != 0:
        raise ValueError(f"{what}: offsets must start at 0, got {int(arr[0])}")
    lengths = np.diff(arr)
    down = np.flatnonzero(lengths < 0)
    if down.size:
        i = int(down[0])
        raise ValueError(
            f"{what}: offsets decrease at bag {i} ({int(arr[i])} -> {int(arr[i + 1])})"
        )
    if int(arr[-1]) != num_values:
        raise ValueError(f"{what}: offsets end at {int(arr[-1])} but values holds {num_values} ids")
    return lengths


def check_weights(weights, num_values: int, *, what: str) -> np.ndarray:
    arr = np.asarray(weights)
    if arr.shape != (num_values,):
        raise ValueError(
            f"{what}: weights has shape {arr.shape} but values holds {num_values} ids; "
            "give one weight per id"
        )
    if arr.size and not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{what}: weights must be floating point, got dtype {arr.dtype}")
    return arr
