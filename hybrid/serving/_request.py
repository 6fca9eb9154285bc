"""A serving request's sparse features, read into the arrays the exported lookup takes.

Accepted forms of `sparse` (every feature of the artifact present; other keys are ignored,
as in training):

- `{feature: [[ids of sample 0], [ids of sample 1], ...]}`: per-sample id lists; for a
  weighted model `{feature: {"ids": [[...], ...], "weights": [[...], ...]}}`;
- `{feature: (values, lengths)}` / `(values, lengths, weights)`: flat 1-D arrays (numpy,
  torch or jax), as `hybrid.Model` takes them;
- a KJT-like object: `.keys() .values() .lengths()` (+ `.weights_or_none()`), e.g. a
  `sparse_jax.KeyedJaggedTensor` (padded or not), `hybrid.torch_kjt(...)` or a TorchRec KJT;
- a tuple `(keys, values, lengths)` or `(keys, values, lengths, weights)`.

The result (`SparseArrays`) is what the program reads: ids int32 `[capacity]` (every
feature's ids, in the artifact's feature order, then zeros up to a capacity of the id
ladder), offsets int32 `[num_features * rung + 1]` (feature-major bags, `rung` the smallest
of the artifact's batch rungs holding the request, else `max_batch_size`; samples past the
request are empty bags) and, for a weighted model, weights float32 `[capacity]`.
Ids are checked as training checks them: with bounds_check "error" an id outside its table
raises, naming the feature, table, sample and id. A managed-collision feature takes raw
64-bit ids, mapped to rows through the id map frozen at export (an id the map does not
hold reads the table's default row, as in training).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import torch

from hybrid.serving._id_map import frozen_rows

__all__ = [
    "RequestError",
    "RequestSpec",
    "SparseArrays",
    "columns",
    "probe_requests",
    "read_dense",
    "read_sparse",
]

_INT32_MAX = np.iinfo(np.int32).max


class RequestError(ValueError):
    """A request the artifact cannot score. A ValueError whose message names the feature,
    sample or value and what to fix; `kind` names the check that refused it (the server's
    error metrics and HTTP status use it): "malformed", "missing_feature",
    "unknown_feature", "ids_not_integer", "id_out_of_range", "weights", "batch_size",
    "oversize_batch", "too_many_ids", "dense_shape"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class RequestSpec(NamedTuple):
    """What the artifact accepts (from its manifest)."""

    features: tuple[str, ...]  # input features, in the program's order
    tables_of: dict[str, tuple[tuple[str, int], ...]]  # feature -> ((table, num_embeddings), ...)
    is_weighted: bool
    bounds_check: str  # "error", "clamp" or "skip"
    max_batch_size: int
    id_capacities: tuple[int, ...]
    # managed-collision features: feature -> its table's frozen id map (ids, rows, each shard's
    # default row: sparse_jax.FrozenIdMap's fields; hybrid.serving._id_map)
    id_maps: Mapping[str, tuple] | None = None
    # batch sizes with a lookup program of their own (ascending; () or the largest:
    # max_batch_size): a request's bags are padded to the smallest that holds it
    batch_rungs: tuple[int, ...] = ()
    # `id_bounds(spec)`, computed once (`with_bounds`); None: read_sparse computes it per call
    bounds: IdBounds | None = None


class IdBounds(NamedTuple):
    """The ids' allowed [low, high) per feature (program order), and the single pair every
    feature shares when they all share one (then one min and one max check a request)."""

    low: np.ndarray  # int64 [features]
    high: np.ndarray  # int64 [features]
    uniform: tuple[int, int] | None


class SparseArrays(NamedTuple):
    """One request's sparse input, padded to the program's shapes."""

    values: np.ndarray  # int32 [capacity]
    offsets: np.ndarray  # int32 [num_features * batch rung + 1]
    weights: np.ndarray | None  # float32 [capacity], weighted models only
    batch_size: int  # samples in the request (the first rows of the output)


class _Column(NamedTuple):
    values: np.ndarray  # [n] ids as given
    lengths: np.ndarray  # [B] int64
    weights: np.ndarray | None  # [n] float32


def _is_array(x) -> bool:
    """A numpy, torch or JAX array (not a list of per-sample lists)."""
    return isinstance(x, np.ndarray | torch.Tensor | jax.Array)


def _is_list_of_lists(x) -> bool:
    def is_list(v):
        return isinstance(v, Sequence | np.ndarray) and not isinstance(v, str | bytes)

    return is_list(x) and all(is_list(v) for v in x)


def _array(x, what: str) -> np.ndarray:
    if type(x) is np.ndarray and x.ndim == 1:  # the common case, without conversions
        return x
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
    a = np.asarray(x)
    if a.ndim != 1:
        raise RequestError("malformed", f"{what} must be 1-D, got shape {a.shape}")
    return a


_BAG_TYPES = frozenset({list, tuple, np.ndarray})


def _per_sample(feature: str, entry) -> _Column:
    weights = None
    if isinstance(entry, Mapping):
        if "ids" not in entry:
            raise RequestError(
                "malformed",
                f"feature {feature!r}: a dict entry is {{'ids': [[...], ...], 'weights': [[...], ...]}}",
            )
        bags_w = entry.get("weights")
        entry = entry["ids"]
        if bags_w is not None:
            if not _is_list_of_lists(bags_w):
                raise RequestError(
                    "weights", f"feature {feature!r}: 'weights' is one list of weights per sample"
                )
            weights = bags_w
    if isinstance(entry, str | bytes) or not isinstance(entry, Sequence):
        raise RequestError(
            "malformed",
            f"feature {feature!r}: expected one list of ids per sample (e.g. [[1, 2], [3]]), got {type(entry).__name__}",
        )
    if not set(map(type, entry)) <= _BAG_TYPES:  # the per-sample check, only when one is odd
        for b, bag in enumerate(entry):
            if isinstance(bag, str | bytes) or not isinstance(bag, Sequence | np.ndarray):
                raise RequestError(
                    "malformed",
                    f"feature {feature!r}: sample {b} is {bag!r}; give a list of ids per sample (e.g. [[1, 2], [3]])",
                )
    lengths = np.fromiter(map(len, entry), np.int64, count=len(entry))
    flat = list(itertools.chain.from_iterable(entry))
    try:
        values = np.asarray(flat) if flat else np.zeros(0, np.int64)
    except ValueError:  # bags holding lists of several lengths
        values = None
    if values is None or values.ndim != 1:  # a bag holding lists
        raise RequestError(
            "malformed", f"feature {feature!r}: a sample's ids are not a flat list of integers"
        )
    if weights is not None:
        if len(weights) != len(entry) or not np.array_equal(
            np.fromiter(map(len, weights), np.int64, count=len(weights)), lengths
        ):
            raise RequestError(
                "weights",
                f"feature {feature!r}: 'weights' must hold one weight per id, sample by sample",
            )
        try:
            weights = np.asarray(list(itertools.chain.from_iterable(weights)), np.float32)
        except (TypeError, ValueError):
            raise RequestError(
                "weights", f"feature {feature!r}: 'weights' must be numbers, one per id"
            ) from None
        if weights.ndim != 1:
            raise RequestError(
                "weights", f"feature {feature!r}: 'weights' must be numbers, one per id"
            )
    return _Column(values, lengths, weights)


def _flat(feature: str, entry) -> _Column:
    values = _array(entry[0], f"feature {feature!r}: values")
    lengths = _array(entry[1], f"feature {feature!r}: lengths").astype(np.int64, copy=False)
    weights = (
        None
        if len(entry) < 3 or entry[2] is None
        else _array(entry[2], f"feature {feature!r}: weights")
    )
    return _Column(values, lengths, weights)


def _from_mapping(sparse: Mapping) -> dict[str, _Column]:
    out = {}
    for feature, entry in sparse.items():
        is_flat = (
            isinstance(entry, tuple | list)
            and len(entry) in (2, 3)
            and (type(entry[0]) is np.ndarray or _is_array(entry[0]))
        )
        out[feature] = _flat(feature, entry) if is_flat else _per_sample(feature, entry)
    return out


def _from_keyed(keys, values, lengths, weights) -> dict[str, _Column]:
    keys = [str(k) for k in keys]
    values = _array(values, "the KJT's values")
    lengths = _array(lengths, "the KJT's lengths").astype(np.int64, copy=False)
    weights = None if weights is None else _array(weights, "the KJT's weights")
    if not keys or lengths.shape[0] % len(keys):
        raise RequestError(
            "malformed",
            f"the KJT has {len(keys)} keys and {lengths.shape[0]} lengths; give one length per key and sample "
            "(key-major, the same batch size for every key)",
        )
    stride = lengths.shape[0] // len(keys)
    ends = np.concatenate([[0], np.cumsum(lengths)])
    if ends[-1] > values.shape[0]:
        raise RequestError(
            "malformed",
            f"the KJT's lengths add up to {ends[-1]} but it has {values.shape[0]} values",
        )
    out = {}
    for k, key in enumerate(keys):
        a, b = ends[k * stride], ends[(k + 1) * stride]
        out[key] = _Column(
            values[a:b],
            lengths[k * stride : (k + 1) * stride],
            None if weights is None else weights[a:b],
        )
    return out


def _numpy_columns(sparse, features: Sequence[str]) -> list[_Column] | None:
    """The columns of `features` (in that order) when `sparse` is a dict giving each as
    `(values, lengths)`, both 1-D numpy arrays, lengths int64 (what a program builds):
    taken as they are, without a conversion; None for any other form (`columns` reads it)."""
    if type(sparse) is not dict:
        return None
    cols = []
    for f in features:
        entry = sparse.get(f)
        if type(entry) is not tuple or len(entry) != 2:
            return None
        values, lengths = entry
        if not (
            type(values) is np.ndarray
            and type(lengths) is np.ndarray
            and values.ndim == lengths.ndim == 1
            and lengths.dtype == np.int64
        ):
            return None
        cols.append(_Column(values, lengths, None))
    return cols


def columns(sparse) -> dict[str, _Column]:
    """{feature: (values, lengths int64, weights or None)} of a sparse request in any form the
    module docstring lists, unchecked (`read_sparse` checks them; the server packs a checked
    request's columns with it)."""
    if isinstance(sparse, Mapping):
        return _from_mapping(sparse)
    if all(callable(getattr(sparse, name, None)) for name in ("keys", "values", "lengths")):
        get_w = getattr(sparse, "weights_or_none", None)
        return _from_keyed(
            sparse.keys(), sparse.values(), sparse.lengths(), get_w() if callable(get_w) else None
        )
    if isinstance(sparse, tuple | list) and len(sparse) in (3, 4):
        return _from_keyed(*sparse, *([None] if len(sparse) == 3 else []))
    raise TypeError(
        f"cannot read a sparse request from {type(sparse).__name__}; pass {{feature: [[ids of sample 0], ...]}}, "
        "{feature: (values, lengths)}, a KeyedJaggedTensor-like object or a (keys, values, lengths[, weights]) tuple"
    )


def _check_ids(feature: str, col: _Column, spec: RequestSpec) -> np.ndarray:
    """The feature's ids as int64 after the training path's checks (see module docstring)."""
    values = col.values
    if values.size and values.dtype.kind not in "iu":
        if (
            values.dtype.kind == "f"
            and np.all(np.isfinite(values))
            and np.all(values == np.round(values))
        ):
            values = values.astype(np.int64)  # JSON may write 3.0
        else:
            bad = values.reshape(-1)[0]
            raise RequestError(
                "ids_not_integer",
                f"feature {feature!r}: ids must be integers, got {values.dtype} values (e.g. {bad!r})",
            )
    values = values.astype(np.int64)
    id_map = (spec.id_maps or {}).get(feature)
    if id_map is not None:  # raw ids through the frozen map; an id not in it reads the default row
        values = frozen_rows(id_map, values)
    ends = np.concatenate([[0], np.cumsum(col.lengths)])
    if spec.bounds_check == "error":
        limits = [
            (f"table {table!r}, num_embeddings={rows}", 0, rows)
            for table, rows in spec.tables_of[feature]
        ]
    else:  # the program clamps or skips them, but they must reach it untruncated
        limits = [("ids must fit int32", -_INT32_MAX - 1, _INT32_MAX + 1)]
    for what, low, high in limits:
        bad = np.flatnonzero((values < low) | (values >= high))
        if bad.size:
            i = int(bad[0])
            sample = int(np.searchsorted(ends, i, side="right")) - 1
            raise RequestError(
                "id_out_of_range",
                f"feature {feature!r} ({what}): id {int(values[i])} at sample {sample}, position "
                f"{i - int(ends[sample])} in its bag, is outside [{low}, {high}) ({bad.size} such ids); fix the ids",
            )
    return values


_ALIGN = 64  # bytes: XLA:CPU takes a host array this aligned without copying it


def _zeros(*sizes: tuple[int, np.dtype]) -> list[np.ndarray]:
    """`np.zeros(n, dtype)` for each `(n, dtype)`, carved from one allocation, each starting
    on a 64-byte boundary: the lookup program then reads the packed request in place (jax
    copies a numpy argument that is less aligned, ~0.1 ms for a 512-sample request's ids)."""
    spans = [-(-n * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN for n, dtype in sizes]
    buffer = np.zeros(sum(spans) + _ALIGN, np.uint8)
    start = -buffer.ctypes.data % _ALIGN
    out = []
    for (n, dtype), span in zip(sizes, spans, strict=True):
        out.append(buffer[start : start + n * np.dtype(dtype).itemsize].view(dtype))
        start += span
    return out


def _capacity(n: int, spec: RequestSpec) -> int:
    for rung in spec.id_capacities:
        if rung >= n:
            return rung
    raise RequestError(
        "too_many_ids",
        f"the request holds {n} ids, more than this artifact's largest id capacity {spec.id_capacities[-1]}; "
        f"split the request, or re-export with hybrid.export(..., id_capacities=[..., {n}])",
    )


def id_bounds(spec: RequestSpec) -> IdBounds:
    """Per feature (program order) the ids' [low, high): the smallest table it reads when
    bounds_check is "error", else int32's range (the program clamps or skips the rest)."""
    n = len(spec.features)
    if spec.bounds_check == "error":
        high = np.array(
            [min(rows for _, rows in spec.tables_of[f]) for f in spec.features], np.int64
        )
        low = np.zeros(n, np.int64)
    else:
        low, high = np.full(n, -_INT32_MAX - 1, np.int64), np.full(n, _INT32_MAX + 1, np.int64)
    pairs = set(zip(low.tolist(), high.tolist(), strict=True))
    return IdBounds(low, high, next(iter(pairs)) if len(pairs) == 1 else None)


def with_bounds(spec: RequestSpec) -> RequestSpec:
    """`spec` carrying its `id_bounds`, so that `read_sparse` does not derive them per call."""
    return RequestSpec(*spec[:-1], bounds=id_bounds(spec))  # bounds: the last field


def _ids(cols: list[_Column], counts: list[int], spec: RequestSpec) -> np.ndarray:
    """Every feature's ids as one int64 array, checked: one vectorised pass over all of them;
    only a request that fails it goes feature by feature (`_check_ids`) to name the id."""
    features = spec.features
    ids = np.concatenate([c.values for c in cols]) if features else np.zeros(0)
    if ids.size and ids.dtype.kind not in "iu":  # floats from JSON, or not numbers: one by one
        return np.concatenate([_check_ids(f, c, spec) for f, c in zip(features, cols, strict=True)])
    ids = ids.astype(np.int64, copy=False)
    if spec.id_maps:  # raw ids through the frozen maps (an id not in one reads its default row)
        ids = ids.copy()
        a = 0
        for f, n in zip(features, counts, strict=True):
            id_map = spec.id_maps.get(f)
            if id_map is not None:
                ids[a : a + n] = frozen_rows(id_map, ids[a : a + n])
            a += n
    bounds = spec.bounds or id_bounds(spec)
    if bounds.uniform is not None:  # one min and one max over all features' ids
        bad = ids.size and (ids.min() < bounds.uniform[0] or ids.max() >= bounds.uniform[1])
    else:
        counts = np.asarray(counts)
        bad = (
            (ids < np.repeat(bounds.low, counts)) | (ids >= np.repeat(bounds.high, counts))
        ).any()
    if bad:
        for f, c in zip(
            features, cols, strict=True
        ):  # raises, naming the feature, table, sample and id
            _check_ids(f, c, spec)
    return ids


def read_sparse(sparse: Any, spec: RequestSpec) -> SparseArrays:
    """`sparse` (any form in the module docstring) checked and padded for the program.

    Vectorised: the features' lengths, counts, ids and weights are each checked and packed
    with a few numpy calls over the whole request (`tests/reference.serving_request_loop` is
    its plain-loop twin); a request that fails a check is then walked to name the culprit."""
    features = spec.features
    cols = _numpy_columns(sparse, features)
    if cols is None:  # any other form, or a feature missing
        columns_of = columns(sparse)
        missing = [f for f in features if f not in columns_of]
        if missing:
            extra = sorted(map(str, set(columns_of) - set(features)))  # a misspelled key, often
            raise RequestError(
                "missing_feature",
                f"the request lacks features {missing}; the artifact reads {list(features)} "
                "(give an empty list for a sample without ids)"
                + (f"; it has {extra}, which the artifact does not read" if extra else ""),
            )
        cols = [columns_of[f] for f in features]
    batch = cols[0].lengths.shape[0]
    if any(c.lengths.shape[0] != batch for c in cols):
        sizes = {f: int(c.lengths.shape[0]) for f, c in zip(features, cols, strict=True)}
        raise RequestError(
            "batch_size",
            f"features have different batch sizes {sizes}; every feature needs one bag per sample",
        )
    if batch < 1:
        raise RequestError("batch_size", "the request has no samples")
    if batch > spec.max_batch_size:
        raise RequestError(
            "oversize_batch",
            f"the request has {batch} samples, more than this artifact's max_batch_size {spec.max_batch_size}; "
            f"split the request, or re-export with hybrid.export(..., max_batch_size={batch})",
        )
    rung = next((r for r in spec.batch_rungs if r >= batch), spec.max_batch_size)
    counts = [c.values.shape[0] for c in cols]
    lengths = np.concatenate([c.lengths for c in cols])  # int64 [features * batch]
    ends = np.cumsum(lengths)  # each bag's end, feature-major, no padding bags
    # lengths in [0, ids] cannot overflow the sum; then each feature's last end is its count
    if (
        lengths.min() < 0
        or lengths.max() > sum(counts)
        or ends[batch - 1 :: batch].tolist() != list(itertools.accumulate(counts))
    ):
        _name_bad_lengths(features, lengths.reshape(len(features), batch), counts)
    if spec.is_weighted:
        unweighted = [f for f, c in zip(features, cols, strict=True) if c.weights is None]
        if unweighted:
            raise RequestError(
                "weights",
                f"feature {unweighted[0]!r} has no weights, but the model is weighted: give one weight per id",
            )
    ids = _ids(cols, counts, spec)
    capacity = _capacity(ids.shape[0], spec)
    wide = [(capacity, np.float32)] if spec.is_weighted else []
    padded, offsets, *w = _zeros((capacity, np.int32), (len(features) * rung + 1, np.int32), *wide)
    if rung == batch:
        offsets[1:] = ends
    else:  # the bags past the request are empty: each feature's last end repeated
        ends = ends.reshape(len(features), batch)
        bags = offsets[1:].reshape(len(features), rung)
        bags[:, :batch] = ends
        bags[:, batch:] = ends[:, -1:]
    padded[: ids.shape[0]] = ids
    if w:
        w[0][: ids.shape[0]] = np.concatenate([c.weights for c in cols])
    return SparseArrays(padded, offsets, w[0] if w else None, batch)


def _name_bad_lengths(features, lengths: np.ndarray, counts: list[int]) -> None:
    """Raise naming the first feature whose lengths are negative or do not add up to its ids."""
    for k, f in enumerate(features):
        if (lengths[k] < 0).any():
            b = int(np.flatnonzero(lengths[k] < 0)[0])
            raise RequestError(
                "malformed",
                f"feature {f!r}: sample {b} has length {int(lengths[k, b])}; lengths must be >= 0",
            )
        if (lengths[k] > counts[k]).any():
            b = int(np.flatnonzero(lengths[k] > counts[k])[0])
            raise RequestError(
                "malformed",
                f"feature {f!r}: sample {b} has length {int(lengths[k, b])} but there are {counts[k]} ids",
            )
        if int(lengths[k].sum()) != counts[k]:
            raise RequestError(
                "malformed",
                f"feature {f!r}: lengths add up to {int(lengths[k].sum())} but there are {counts[k]} ids",
            )
    raise AssertionError("lengths were found bad, but no feature's are")


def read_dense(dense_features, n_dense: int, batch_size: int, dtype: torch.dtype) -> torch.Tensor:
    """`dense_features` (tensor or array-like) as a CPU tensor `[batch_size, n_dense]` of
    `dtype`; anything else raises `RequestError` ("dense_shape") saying the shape needed."""
    need = (
        f"this artifact needs [{batch_size}, {n_dense}] (one row of {n_dense} dense features per "
        "sample of the sparse request)"
    )
    try:
        dense = torch.as_tensor(dense_features, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as e:
        raise RequestError(
            "dense_shape", f"dense_features is not a numeric array ({e}); {need}"
        ) from None
    if dense.ndim != 2 or dense.shape[1] != n_dense or dense.shape[0] != batch_size:
        raise RequestError("dense_shape", f"dense_features has shape {tuple(dense.shape)}; {need}")
    return dense.cpu().contiguous()


def probe_requests(spec: RequestSpec, seed: int = 0) -> list[dict[str, tuple]]:
    """Requests that exercise a lookup's corners (`{feature: (values, lengths[, weights])}`,
    valid for `spec`): batches of 1, 3 and `max_batch_size` samples, bags of 0 to 3 ids
    (each feature's first bag empty where the batch has several), ids up to each table's
    last row, and with bounds_check "clamp" or "skip" ids below and past it; for checking
    one way of running the lookup against another (`hybrid.serving._direct`)."""
    rng = np.random.default_rng(seed)
    out = []
    for batch in sorted({1, min(3, spec.max_batch_size), spec.max_batch_size}):
        request = {}
        for f in spec.features:
            rows = min(n for _, n in spec.tables_of[f])
            lengths = rng.integers(0, 4, batch).astype(np.int64)
            lengths[0] = 0 if batch > 1 else 2
            if rows < 1:  # a table of no rows (all pruned) reads no ids
                lengths[:] = 0
            ids = rng.integers(0, max(rows, 1), int(lengths.sum())).astype(np.int64)
            if ids.size:
                ids[-1] = rows - 1
            if spec.bounds_check != "error" and ids.size > 2:
                ids[:2] = (-1, rows)
            entry = (ids, lengths)
            if spec.is_weighted:
                entry += (rng.uniform(-2, 2, ids.size).astype(np.float32),)
            request[f] = entry
        out.append(request)
    return out
