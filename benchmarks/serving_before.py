"""The serving call as it was before the request read, the lookup hand-over and the tower
were cut (hybrid.serving at commit 559e9ca): a frozen copy, timed as `before` by
`benchmarks.serving_latency` on the same predictor, so that a change is measured in one run.

`call(predictor)` returns `(dense_features, sparse) -> logits` running, as that version did:
its request read (`read_sparse`: a zeros matrix of lengths filled per feature, bounds
derived per call and checked by two `np.repeat`s, separately aligned buffers), its hand-over
(`torch.from_dlpack`, slice, `.cpu()`) and its lean tower (the fx GraphModule of the
exported graph: `Module.__getattr__` per parameter, `OpOverload` wrappers, the advanced
index), under `torch.inference_mode`. Not part of the library; nothing here is tested
beyond its scores equal to the predictor's.
"""

# ruff: noqa: E501

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import torch

from hybrid.serving._id_map import frozen_rows
from hybrid.serving._request import (
    _INT32_MAX,
    RequestError,
    RequestSpec,
    SparseArrays,
    _Column,
)


def _is_array(x) -> bool:
    """A numpy, torch or JAX array (not a list of per-sample lists)."""
    return isinstance(x, np.ndarray | torch.Tensor | jax.Array)


def _is_list_of_lists(x) -> bool:
    def is_list(v):
        return isinstance(v, Sequence | np.ndarray) and not isinstance(v, str | bytes)

    return is_list(x) and all(is_list(v) for v in x)


def _array(x, what: str) -> np.ndarray:
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
    lengths = _array(entry[1], f"feature {feature!r}: lengths").astype(np.int64)
    weights = (
        None
        if len(entry) < 3 or entry[2] is None
        else _array(entry[2], f"feature {feature!r}: weights")
    )
    return _Column(values, lengths, weights)


def _from_mapping(sparse: Mapping) -> dict[str, _Column]:
    out = {}
    for feature, entry in sparse.items():
        is_flat = isinstance(entry, tuple | list) and len(entry) in (2, 3) and _is_array(entry[0])
        out[feature] = _flat(feature, entry) if is_flat else _per_sample(feature, entry)
    return out


def _from_keyed(keys, values, lengths, weights) -> dict[str, _Column]:
    keys = [str(k) for k in keys]
    values = _array(values, "the KJT's values")
    lengths = _array(lengths, "the KJT's lengths").astype(np.int64)
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


def _columns(sparse) -> dict[str, _Column]:
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


_ALIGN = 64


def _zeros(n: int, dtype) -> np.ndarray:
    """`np.zeros(n, dtype)` starting on a 64-byte boundary: the lookup program then reads
    the packed request in place (jax copies a numpy argument that is less aligned, ~0.1 ms
    for a 512-sample request's ids)."""
    dtype = np.dtype(dtype)
    buffer = np.zeros(n * dtype.itemsize + _ALIGN, np.uint8)
    start = -buffer.ctypes.data % _ALIGN
    return buffer[start : start + n * dtype.itemsize].view(dtype)


def _capacity(n: int, spec: RequestSpec) -> int:
    for rung in spec.id_capacities:
        if rung >= n:
            return rung
    raise RequestError(
        "too_many_ids",
        f"the request holds {n} ids, more than this artifact's largest id capacity {spec.id_capacities[-1]}; "
        f"split the request, or re-export with hybrid.export(..., id_capacities=[..., {n}])",
    )


def _limits(spec: RequestSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per feature (program order) the ids' [low, high): the smallest table it reads when
    bounds_check is "error", else int32's range (the program clamps or skips the rest)."""
    if spec.bounds_check == "error":
        high = [min(rows for _, rows in spec.tables_of[f]) for f in spec.features]
        return np.zeros(len(high), np.int64), np.array(high, np.int64)
    n = len(spec.features)
    return np.full(n, -_INT32_MAX - 1, np.int64), np.full(n, _INT32_MAX + 1, np.int64)


def _ids(columns: dict[str, _Column], counts: np.ndarray, spec: RequestSpec) -> np.ndarray:
    """Every feature's ids as one int64 array, checked: one vectorised pass over all of them;
    only a request that fails it goes feature by feature (`_check_ids`) to name the id."""
    features = spec.features
    ids = np.concatenate([columns[f].values for f in features]) if features else np.zeros(0)
    if ids.size and ids.dtype.kind not in "iu":  # floats from JSON, or not numbers: one by one
        return np.concatenate([_check_ids(f, columns[f], spec) for f in features])
    ids = ids.astype(np.int64, copy=False)
    if spec.id_maps:  # raw ids through the frozen maps (an id not in one reads its default row)
        ends = np.cumsum(counts)
        ids = ids.copy()
        for k, f in enumerate(features):
            id_map = spec.id_maps.get(f)
            if id_map is not None:
                a, b = int(ends[k] - counts[k]), int(ends[k])
                ids[a:b] = frozen_rows(id_map, ids[a:b])
    low, high = _limits(spec)
    if ((ids < np.repeat(low, counts)) | (ids >= np.repeat(high, counts))).any():
        for f in features:  # raises, naming the feature, table, sample and id
            _check_ids(f, columns[f], spec)
    return ids


def read_sparse(sparse: Any, spec: RequestSpec) -> SparseArrays:
    """`sparse` (any form in the module docstring) checked and padded for the program.

    Vectorised: the features' lengths, counts, ids and weights are each checked and packed
    with a few numpy calls over the whole request (`tests/reference.read_sparse_loop` is
    its plain-loop twin); a request that fails a check is then walked to name the culprit."""
    columns = _columns(sparse)
    missing = [f for f in spec.features if f not in columns]
    if missing:
        raise RequestError(
            "missing_feature",
            f"the request lacks features {missing}; the artifact reads {list(spec.features)} "
            "(give an empty list for a sample without ids)",
        )
    sizes = {f: int(columns[f].lengths.shape[0]) for f in spec.features}
    batch = sizes[spec.features[0]]
    if len(set(sizes.values())) > 1:
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
    features = spec.features
    rung = next((r for r in spec.batch_rungs if r >= batch), spec.max_batch_size)
    lengths = np.zeros((len(features), rung), np.int64)  # empty bags past the request
    lengths[:, :batch] = [columns[f].lengths for f in features]
    counts = np.array([columns[f].values.shape[0] for f in features], np.int64)
    sums = lengths.sum(axis=1)
    if (lengths < 0).any() or (sums != counts).any():
        for k, f in enumerate(features):  # the first bad feature, named
            if (lengths[k] < 0).any():
                b = int(np.flatnonzero(lengths[k] < 0)[0])
                raise RequestError(
                    "malformed",
                    f"feature {f!r}: sample {b} has length {int(lengths[k, b])}; lengths must be >= 0",
                )
            if sums[k] != counts[k]:
                raise RequestError(
                    "malformed",
                    f"feature {f!r}: lengths add up to {int(sums[k])} but there are {int(counts[k])} ids",
                )
    if spec.is_weighted:
        unweighted = [f for f in features if columns[f].weights is None]
        if unweighted:
            raise RequestError(
                "weights",
                f"feature {unweighted[0]!r} has no weights, but the model is weighted: give one weight per id",
            )
    ids = _ids(columns, counts, spec)
    capacity = _capacity(ids.shape[0], spec)
    offsets = _zeros(lengths.size + 1, np.int32)
    np.cumsum(lengths.reshape(-1), out=offsets[1:])
    padded = _zeros(capacity, np.int32)
    padded[: ids.shape[0]] = ids
    w = None
    if spec.is_weighted:
        w = _zeros(capacity, np.float32)
        w[: ids.shape[0]] = np.concatenate([columns[f].weights for f in features])
    return SparseArrays(padded, offsets, w, batch)


def _lean_forward(
    module: torch.nn.Module, dense: tuple[int, torch.dtype], width: int, max_batch: int
) -> Callable:
    """`module`'s forward `(dense_features, pooled) -> logits` as the same graph with less
    Python per call: nodes nothing reads dropped (the per-feature views of the KeyedTensor
    the wrapper builds), each parameter and buffer a top-level attribute (not a walk down
    `dense.over_arch.model...`, a `Module.__getattr__` per step), no pytree flattening of
    the inputs nor unflattening of the output. The same aten ops on the same tensors: the
    result is checked equal to the graph's on probe batches (of 1 and 2 samples: dense
    features `dense` = (width, dtype), pooled `width` columns), else (or for a graph not of
    that form) `module.forward` itself is returned."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return module.forward
    try:
        lean = torch.fx.Graph()
        out = lean.graph_copy(graph, {})
        inputs = [n for n in lean.nodes if n.op == "placeholder"]
        if not (
            isinstance(out, tuple | list)
            and len(out) == 1
            and isinstance(out[0], torch.fx.Node)
            and len(inputs) == 2
        ):
            return module.forward
        lean.output(out[0])
        attrs = {}
        for node in lean.nodes:
            if node.op == "get_attr":
                name = f"_attr{len(attrs)}"
                attrs[name] = operator.attrgetter(node.target)(module)
                node.target = name
        lean.eliminate_dead_code()
        forward = torch.fx.GraphModule(attrs, lean).forward
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for batch in sorted({1, min(2, max_batch)}):
                probe = (
                    torch.randn(batch, dense[0], generator=gen).to(dense[1]),
                    torch.randn(batch, width, generator=gen),
                )
                if not torch.equal(forward(*probe), module.forward(*probe)):
                    return module.forward
    except Exception:  # any graph the rewrite does not handle runs as exported
        return module.forward
    return forward


def call(predictor) -> Callable:
    """The previous serving call on `predictor`'s artifact (module docstring)."""
    spec = predictor._spec._replace(bounds=None)
    forward = _lean_forward(
        predictor._dense,
        (predictor.n_dense, predictor._dense_dtype),
        sum(int(e["dim"]) for e in predictor.manifest["embeddings"]),
        predictor.max_batch_size,
    )

    def pool(arrays: SparseArrays) -> torch.Tensor:
        args = [*predictor._tables, arrays.values, arrays.offsets]
        if arrays.weights is not None:
            args.append(arrays.weights)
        batch = (arrays.offsets.shape[0] - 1) // len(spec.features)
        pooled = predictor._program(batch, arrays.values.shape[0])(*args)
        return torch.from_dlpack(pooled)[: arrays.batch_size].cpu()

    def run(dense_features, sparse) -> torch.Tensor:
        from hybrid.serving._request import read_dense

        arrays = read_sparse(sparse, spec)
        dense = read_dense(
            dense_features, predictor.n_dense, arrays.batch_size, predictor._dense_dtype
        )
        pooled = pool(arrays)
        with torch.inference_mode():
            return forward(dense, pooled)

    return run
