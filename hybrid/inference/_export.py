"""`hybrid.export`: a trained model as one self-contained serving directory.

    hybrid.export(model, "artifacts/dlrm", example=(dense_features, sparse))
    predictor = hybrid.serving.load("artifacts/dlrm")       # jax + numpy + torch only

Works for a `hybrid.Model` (fp32 / fp16 / bf16 tables; tables sharded over a mesh are
gathered to the host) and for `hybrid.quantize(model, ...)`'s `QuantizedModel` (packed
uint8 rows). The directory (layout in `hybrid.serving._artifact`):

- `sparse_lookup.jaxexport`: the pooled lookup as a serialized `jax.export` program taking
  the tables and the batch's id arrays (`hybrid.inference._export_lookup`), lowered for `platforms`;
- `sparse_lookup.cpu_kernel.jaxexport` (and one per batch rung): for a `QuantizedModel`
  exported where sparse_jax's C++ kernels are built and `platforms` holds "cpu", the same
  lookups lowered for CPU with the quantized tables read by the fused C++ kernel (a custom
  call, `HybridrecQuantPooled`); `hybrid.serving` runs them when it can register the kernel
  and the XLA programs otherwise (manifest: `programs.sparse.cpu_kernel`). Both forms are
  run on the example at export and must agree bit for bit;
- `tables/<i>_<name>.npy`: the tables, one file each;
- `dense_tower.pt2`: `torch.export` of the dense tower behind a thin wrapper taking the pooled
  `[B, sum of dims]` tensor (it builds the `dense_torch.KeyedTensor` inside), so loading
  it needs torch alone; the batch dimension is dynamic, 1 to `max_batch_size`;
- `manifest.json` (written last): format version, input features in order, the output
  blocks, per table its name, rows, dim, dtype, weight type, pooling, the features reading
  it and its file, the accepted shapes, jax / jaxlib / torch / numpy / hybridrec versions
  and the sha256 and size of every file.

Accepted shapes: a request holds 1 to `max_batch_size` samples (default: the example's
batch size) and any number of ids up to the largest of `id_capacities` (default: the
model's capacity ladder); the server pads the batch to `max_batch_size` empty bags and the
ids to the next capacity, so each capacity compiles once. Anything larger is refused with
what to re-export with.

The directory is written under a temporary name beside `path` and renamed into place: a
crash leaves at most a hidden `.tmp-*` directory, never a partial artifact.
"""

from __future__ import annotations

import io
import os
import pathlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import torch
from torch import nn

from hybrid.inference._export_dense import dense_program
from hybrid.inference._export_files import npy_bytes, stored_array, versions, write_artifact
from hybrid.inference._export_lookup import (
    KERNEL_TARGET,
    OutputSlot,
    export_lookup,
    lookup_program,
)
from hybrid.inference._quantize import QuantizedModel
from hybrid.model import Model
from hybrid.serving._artifact import (
    DENSE_FILE,
    FORMAT,
    FORMAT_VERSION,
    SPARSE_FILE,
    id_map_file,
    sparse_file,
    table_file,
)
from hybrid.serving._request import RequestSpec, read_sparse
from sparse_jax import DEFAULT_LADDER, EmbeddingBagConfig, PoolingType

__all__ = ["export"]

DEFAULT_PLATFORMS = ("cpu", "cuda")


class _Table(NamedTuple):
    config: EmbeddingBagConfig
    array: np.ndarray  # what the program takes: float rows, or packed uint8 rows
    # float rows: "fp32" / "fp16" / "bf16"; packed rows: "int8" / "int4" / "int2" / "fp16"
    weight_type: str
    row_alignment: int | None  # packed tables only (None: float rows)


class _Output(NamedTuple):
    """One `[B, dim]` block of the pooled output: `feature`'s bags pooled from `table`."""

    name: str  # the output key: the feature, or `feature@table` when several tables read it
    feature: str
    table: EmbeddingBagConfig
    offset: int  # its first column


class _Source(NamedTuple):
    """What the exporter reads of a model, whichever kind it is (through the sparse
    modules' declared contract: `tables`, `feature_names`, `output_dims`, `table_weights`)."""

    kind: str
    outputs: list[_Output]  # in output order
    tables: list[_Table]
    is_weighted: bool
    bounds_check: str
    ladder: tuple[int, ...]
    dense: nn.Module
    id_maps: dict  # managed table -> sparse_jax.FrozenIdMap: the id map frozen for serving


def _check_pooled(tables) -> None:
    for t in tables:
        if not isinstance(t, EmbeddingBagConfig) or t.pooling not in (
            PoolingType.SUM,
            PoolingType.MEAN,
        ):
            raise ValueError(
                f"hybrid.export serves pooled tables (EmbeddingBagConfig, SUM or MEAN); table {t.name!r} is a "
                f"{type(t).__name__} with pooling {getattr(t, 'pooling', None)}"
            )


def _outputs(module) -> list[_Output]:
    """The output blocks in order: tables in config order, each table's features in order
    (the order of `module.feature_names`, which names them)."""
    pairs = [(f, t) for t in module.tables for f in t.feature_names]
    names, dims = list(module.feature_names), list(module.output_dims)
    if len(names) != len(pairs) or dims != [t.embedding_dim for _, t in pairs]:
        raise ValueError(
            f"hybrid.export: the sparse module's outputs {names} (dims {dims}) are not its tables' "
            "features in table order; this module cannot be exported"
        )
    offsets = np.cumsum([0, *dims[:-1]]).tolist()
    return [_Output(n, f, t, o) for n, (f, t), o in zip(names, pairs, offsets, strict=True)]


def _source(model) -> _Source:
    if isinstance(model, QuantizedModel):
        qebc = model.sparse_module
        _check_pooled(qebc.tables)
        tables = [
            _Table(
                t,
                np.asarray(qebc.packed_tables[t.name]),
                qebc.weight_types[t.name],
                qebc.row_alignment,
            )
            for t in qebc.tables
        ]
        return _Source(
            "QuantizedModel",
            _outputs(qebc),
            tables,
            qebc.is_weighted(),
            qebc.bounds_check,
            tuple(qebc.ladder or DEFAULT_LADDER),
            model.dense,
            model.id_maps,
        )
    if isinstance(model, Model):
        module = model.sparse_module
        managed = module.managed()
        _check_pooled(module.tables)
        weights = module.table_weights(model.sparse_params)  # a sharded module gathers to the host
        tables = [
            _Table(t, np.asarray(weights[t.name]), t.data_type.value.lower(), None)
            for t in module.tables
        ]
        return _Source(
            "Model",
            _outputs(module),
            tables,
            module.is_weighted(),
            module.bounds_check,
            tuple(model.capacity_ladder),
            model.dense,
            {} if managed is None else managed.frozen_maps(),
        )
    raise TypeError(
        f"hybrid.export takes a hybrid.Model or hybrid.quantize(...)'s QuantizedModel, got {type(model).__name__}"
    )


def _features(source: _Source) -> list[str]:
    """Input features in the program's order: each feature once, in output order."""
    return list(dict.fromkeys(o.feature for o in source.outputs))


def _spec(
    source: _Source, features: list[str], max_batch: int, capacities: tuple[int, ...]
) -> RequestSpec:
    tables_of: dict[str, list] = {f: [] for f in features}
    for o in source.outputs:
        tables_of[o.feature].append((o.table.name, o.table.num_embeddings))
    id_maps = {
        o.feature: source.id_maps[o.table.name]
        for o in source.outputs
        if o.table.name in source.id_maps
    }
    return RequestSpec(
        tuple(features),
        {f: tuple(v) for f, v in tables_of.items()},
        source.is_weighted,
        source.bounds_check,
        max_batch,
        capacities,
        id_maps,
    )


def _check_capacities(capacities) -> tuple[int, ...]:
    caps = tuple(int(c) for c in capacities)
    if not caps or caps[0] < 1 or any(b <= a for a, b in zip(caps, caps[1:], strict=False)):
        raise ValueError(
            f"id_capacities must be an increasing list of sizes >= 1, got {list(capacities)}"
        )
    return caps


def _table_entry(i: int, table: _Table, outputs: list[_Output], id_map=None) -> dict[str, Any]:
    t = table.config
    return {
        "name": t.name,
        "num_embeddings": t.num_embeddings,
        "embedding_dim": t.embedding_dim,
        "dtype": str(table.array.dtype),
        "file_dtype": str(stored_array(table.array).dtype),
        "shape": list(table.array.shape),
        "weight_type": table.weight_type,
        "packed": table.row_alignment is not None,
        "row_alignment": table.row_alignment,
        "pooling": t.pooling.value,
        "features": [o.feature for o in outputs if o.table.name == t.name],
        "file": table_file(i, t.name),
        "managed_collision": None
        if id_map is None
        else {
            "file": id_map_file(i, t.name),
            "resident": int(len(id_map.ids)),
            "default_row": int(id_map.default_row),
            "shards": int(id_map.shards),
            "default_rows": [int(r) for r in id_map.default_rows],
        },
    }


def _batch_rungs(max_batch: int, rungs: Sequence[int] | None) -> tuple[int, ...]:
    """The batch sizes a lookup program is written for: `rungs` (default powers of 8 below
    `max_batch_size`), and `max_batch_size` itself."""
    if rungs is None:
        rungs = [8**k for k in range(8) if 8**k < max_batch]
    rungs = tuple(sorted({int(b) for b in rungs} | {max_batch}))
    if rungs[0] < 1 or rungs[-1] > max_batch:
        raise ValueError(f"batch_rungs {list(rungs)} must lie in [1, max_batch_size={max_batch}]")
    return rungs


def _kernel_form(source: _Source, platforms: Sequence[str]) -> bool:
    """Whether to write the lookups in the C++ kernel's form too: quantized tables, a CPU
    program asked for, and the kernel built here (its custom call must be lowered)."""
    if "cpu" not in platforms or not any(t.row_alignment is not None for t in source.tables):
        return False
    from sparse_jax import cpu_kernels_problem

    return cpu_kernels_problem() is None


def _sparse_program(
    source: _Source,
    features: list[str],
    max_batch: int,
    platforms: Sequence[str],
    form: str = "xla",
) -> bytes:
    """The serialized lookup program (`hybrid.inference._export_lookup`) for this model's
    tables, taking `max_batch` bags per feature; `form` "cpu_kernel": lowered for CPU only,
    the quantized tables read by the C++ kernel's custom call."""
    index = {t.config.name: i for i, t in enumerate(source.tables)}
    slots = []
    for o in source.outputs:
        table = source.tables[index[o.table.name]]
        packed = None if table.row_alignment is None else table.weight_type
        mean = o.table.pooling is PoolingType.MEAN
        i, dim = features.index(o.feature), o.table.embedding_dim
        slots.append(OutputSlot(i, index[o.table.name], dim, mean, packed))
    program = lookup_program(
        slots,
        len(source.tables),
        max_batch,
        weighted=source.is_weighted,
        bounds_check=source.bounds_check,
        form=form,
    )
    avals = [jax.ShapeDtypeStruct(t.array.shape, t.array.dtype) for t in source.tables]
    exported = export_lookup(
        program,
        avals,
        len(features),
        max_batch,
        weighted=source.is_weighted,
        platforms=platforms if form == "xla" else ("cpu",),
        custom_calls=() if form == "xla" else (KERNEL_TARGET,),
    )
    return exported.serialize()


def _manifest(
    source: _Source,
    features: list[str],
    dense: dict[str, Any],
    max_batch: int,
    capacities: tuple[int, ...],
    platforms: Sequence[str],
    rungs: tuple[int, ...],
    kernel: bool = False,
) -> dict[str, Any]:
    """The manifest without its "files" table (`_write` adds it)."""
    total = sum(o.table.embedding_dim for o in source.outputs)
    sparse_inputs = [
        f"table {t.config.name!r}: {t.array.dtype}{list(t.array.shape)}" for t in source.tables
    ]
    sparse_inputs += ["ids: int32[num_ids]", f"offsets: int32[{len(features) * max_batch + 1}]"]
    sparse_inputs += ["weights: float32[num_ids]"] if source.is_weighted else []
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": source.kind,
        "features": features,
        "embeddings": [
            {
                "name": o.name,
                "feature": o.feature,
                "table": o.table.name,
                "dim": o.table.embedding_dim,
                "offset": o.offset,
            }
            for o in source.outputs
        ],
        "tables": [
            _table_entry(i, t, source.outputs, source.id_maps.get(t.config.name))
            for i, t in enumerate(source.tables)
        ],
        "is_weighted": source.is_weighted,
        "bounds_check": source.bounds_check,
        "dense": dense,
        "accepts": {
            "min_batch_size": 1,
            "max_batch_size": max_batch,
            "id_capacities": list(capacities),
            "max_ids": capacities[-1],
        },
        "programs": {
            "sparse": {
                "file": SPARSE_FILE,
                "batch_rungs": list(rungs),
                "platforms": list(platforms),
                "inputs": sparse_inputs,
                "output": f"pooled: float32[{max_batch}, {total}]",
                # the same programs with the C++ kernel's custom call (CPU), or none
                "cpu_kernel": {"target": KERNEL_TARGET, "platforms": ["cpu"]} if kernel else None,
            },
            "dense": {
                "file": DENSE_FILE,
                "inputs": [
                    f"dense_features: {dense['dtype']}[batch, {dense['in_features']}]",
                    f"pooled: float32[batch, {total}]",
                ],
                "output": f"logits: [batch, {dense['out_features']}]",
            },
        },
        "versions": versions(),
    }


def export(
    model,
    path: str | os.PathLike,
    example: tuple[Any, Any],
    *,
    max_batch_size: int | None = None,
    id_capacities: Sequence[int] | None = None,
    platforms: Sequence[str] = DEFAULT_PLATFORMS,
    batch_rungs: Sequence[int] | None = None,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write `model` (a `hybrid.Model` or a `QuantizedModel`) as a serving directory `path`.

    example: `(dense_features [b, n_dense], sparse)`, one batch in any form
      `hybrid.serving` reads (its ids are checked); it fixes `n_dense`, the dense dtype and
      the default `max_batch_size` (b), and traces the dense tower.
    max_batch_size: the most samples one request may hold (>= b).
    id_capacities: increasing id counts a request is padded to (default: the model's
      capacity ladder); the largest is the most ids a request may hold.
    platforms: what the sparse program is lowered for (default cpu and cuda).
    batch_rungs: batch sizes below `max_batch_size` that get a lookup program of their own
      (default powers of 8: 1, 8, 64, ...), so a small request pools its own bags and not
      `max_batch_size` empty ones; a request runs the smallest rung that holds it.
    overwrite: replace an existing `path` (atomically) instead of raising.

    The model is not changed (its tables are read, its dense tower copied). Returns `path`.
    """
    path = pathlib.Path(path)
    if path.exists() and not overwrite:  # before any work
        raise FileExistsError(
            f"hybrid.export: {path} already exists; pass overwrite=True or choose another path"
        )
    source = _source(model)
    dense_x = torch.as_tensor(example[0])
    if dense_x.ndim != 2 or not dense_x.is_floating_point():
        raise ValueError(
            f"example dense_features must be a float [batch, n_dense] tensor, got "
            f"{dense_x.dtype} {list(dense_x.shape)}"
        )
    dense_x = dense_x.detach().cpu().contiguous()
    max_batch = int(dense_x.shape[0] if max_batch_size is None else max_batch_size)
    if not 1 <= dense_x.shape[0] <= max_batch:
        raise ValueError(
            f"max_batch_size={max_batch} must be >= the example's batch size {dense_x.shape[0]} (and >= 1)"
        )
    capacities = _check_capacities(source.ladder if id_capacities is None else id_capacities)
    rungs = _batch_rungs(max_batch, batch_rungs)
    features = _features(source)
    spec = _spec(source, features, max_batch, capacities)
    request = read_sparse(example[1], spec)  # checks the example's ids as a server would
    if request.batch_size != dense_x.shape[0]:
        raise ValueError(
            f"example: dense_features has {dense_x.shape[0]} rows but the sparse batch has "
            f"{request.batch_size} samples"
        )

    sparse_bytes = _sparse_program(source, features, max_batch, platforms)
    # run the serialized program on the example: it is what the server will run
    args = [t.array for t in source.tables] + [request.values, request.offsets]
    if source.is_weighted:
        args.append(request.weights)
    pooled = np.array(jax.export.deserialize(bytearray(sparse_bytes)).call(*args))
    kernel = _kernel_form(source, platforms)
    if kernel:  # the kernel's program must pool what the XLA program pools, bit for bit
        kernel_bytes = _sparse_program(source, features, max_batch, platforms, "cpu_kernel")
        got = np.array(jax.export.deserialize(bytearray(kernel_bytes)).call(*args))
        if not np.array_equal(got, pooled):
            raise RuntimeError(
                "hybrid.export: the C++ kernel's lookup program pools the example differently "
                f"from the XLA program (max abs difference {np.abs(got - pooled).max()}); this "
                "is a bug, please report it"
            )
    pooled = torch.from_numpy(pooled[: request.batch_size])
    keys, dims = [o.name for o in source.outputs], [o.table.embedding_dim for o in source.outputs]
    dense_bytes, outputs = dense_program(source.dense, keys, dims, dense_x, pooled, max_batch)
    files = {
        table_file(i, t.config.name): npy_bytes(stored_array(t.array))
        for i, t in enumerate(source.tables)
    }
    for i, t in enumerate(source.tables):
        if t.config.name in source.id_maps:
            id_map = source.id_maps[t.config.name]
            buffer = io.BytesIO()
            np.savez(buffer, ids=id_map.ids, rows=id_map.rows)
            files[id_map_file(i, t.config.name)] = buffer.getvalue()
    files[SPARSE_FILE] = sparse_bytes
    for b in rungs[:-1]:
        files[sparse_file(b, max_batch)] = _sparse_program(source, features, b, platforms)
    if kernel:
        files[sparse_file(max_batch, max_batch, "cpu_kernel")] = kernel_bytes
        for b in rungs[:-1]:
            files[sparse_file(b, max_batch, "cpu_kernel")] = _sparse_program(
                source, features, b, platforms, "cpu_kernel"
            )
    files[DENSE_FILE] = dense_bytes
    dense_info = {
        "in_features": int(dense_x.shape[1]),
        "dtype": str(dense_x.dtype).removeprefix("torch."),
        "out_features": outputs,
    }
    manifest = _manifest(
        source, features, dense_info, max_batch, capacities, platforms, rungs, kernel
    )
    write_artifact(path, files, manifest, overwrite=overwrite)
    return path
