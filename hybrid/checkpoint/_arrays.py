"""The tables and sparse optimizer state as plan-independent arrays (`tables.npz`).

Per table `weight/<table>` `[rows, dim]`; each per-row optimizer state leaf
`state/<table>/<leaf>` (`[rows, dim]`, elementwise rules) or
`state/<table>/<leaf>/cols_<c0>_<cn>` (`[rows]`, one value per row of each column block:
row-wise Adagrad); `count`, the sparse optimizer's step count; managed-collision id maps
beside them (`_managed`). `sparse_state_arrays` reads them off a model on any mesh and
plan; `_restore_sparse` places them into another model's buffers (reshard on load);
`saved_table_shapes` reads only the array headers; `estimate_bytes` sizes one checkpoint.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import zipfile
from collections.abc import Mapping

import jax
import numpy as np
import torch

from hybrid.checkpoint._managed import (
    check_mc_tables,
    mc_state_arrays,
    reshard_mc_arrays,
    restore_mc_state,
)
from sparse_jax.optim import SparseOptState

__all__ = ["estimate_bytes", "saved_table_shapes", "sparse_state_arrays"]


def _leaves(opt_state: SparseOptState, buffer: str) -> Mapping[str, jax.Array]:
    leaves = opt_state.tables[buffer]
    if leaves is None or (isinstance(leaves, tuple | list) and not leaves):
        return {}  # a stateless rule (sgd): no per-row leaves to save or restore
    if not isinstance(leaves, Mapping):
        raise TypeError(
            f"checkpoint: sparse optimizer state of buffer {buffer!r} is a {type(leaves).__name__}; "
            "only rules whose per-table state is a dict of arrays (sgd, adagrad, rowwise_adagrad, "
            "adam) can be checkpointed"
        )
    return leaves


def place_state_rows(out, dims, table: str, leaf_name: str, rows, r0: int, c0: int, cn: int):
    """Writes one stored block's rows of an optimizer state leaf into its plan-independent
    array in `out` (created on first use): `[rows]` per column block for row-wise leaves
    (`state/<table>/<leaf>/cols_<c0>_<cn>`), `[rows, dim]` for elementwise ones."""
    rn = rows.shape[0]
    if rows.ndim == 1:
        key = f"state/{table}/{leaf_name}/cols_{c0}_{cn}"
        out.setdefault(key, np.zeros(dims[0], rows.dtype))[r0 : r0 + rn] = rows
    else:
        key = f"state/{table}/{leaf_name}"
        out.setdefault(key, np.zeros(dims, rows.dtype))[r0 : r0 + rn, c0 : c0 + cn] = rows[:, :cn]


def dense_state_bytes(model, dense_optimizer) -> bytes:
    """`dense.pt`: the dense tower's and the torch optimizer's state dicts, torch's RNG."""
    buffer = io.BytesIO()
    torch.save(
        {
            "dense": model.dense.state_dict(),
            "optimizer": dense_optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
        },
        buffer,
    )
    return buffer.getvalue()


def sparse_state_arrays(model) -> dict[str, np.ndarray]:
    """The model's tables and sparse optimizer state in checkpoint form (module docstring)."""
    module, opt_state = model.sparse_module, model.sparse_opt_state
    out = {
        f"weight/{name}": np.asarray(w)
        for name, w in module.table_weights(model.sparse_params).items()
    }
    dims = {t.name: (t.num_embeddings, t.embedding_dim) for t in module.tables}
    hosts: dict[tuple[str, str], np.ndarray] = {}
    for block in module.stored_blocks():  # sparse_jax.StoredBlock
        buffer, table, start, r0, rn, c0, cn = block
        for leaf_name, leaf in _leaves(opt_state, buffer).items():
            if leaf.ndim == 0 or leaf.shape[0] != model.sparse_params[buffer].shape[0]:
                raise TypeError(
                    f"checkpoint: sparse optimizer state leaf {leaf_name!r} of buffer {buffer!r} is "
                    f"not per-row (shape {leaf.shape}); such rules cannot be checkpointed"
                )
            host = hosts.get((buffer, leaf_name))
            if host is None:
                host = hosts[(buffer, leaf_name)] = np.asarray(leaf)
            place_state_rows(
                out, dims[table], table, leaf_name, host[start : start + rn], r0, c0, cn
            )
    out["count"] = np.asarray(opt_state.count)
    out.update(mc_state_arrays(model))
    return out


def _row_values(arrays, table: str, leaf: str, c0: int, cn: int, where: str) -> np.ndarray:
    """One value per row for columns c0:c0+cn of `table`, from the saved column blocks."""
    prefix = f"state/{table}/{leaf}/cols_"
    saved = {}
    for key in arrays:
        if key.startswith(prefix):
            s0, sn = (int(x) for x in key[len(prefix) :].split("_"))
            saved[(s0, sn)] = key
    if not saved:
        raise ValueError(
            f"{where}: no row-wise state {leaf!r} for table {table!r}; was it written by another optimizer?"
        )
    if (c0, cn) in saved:
        return arrays[saved[(c0, cn)]]
    total, weight = 0.0, 0
    for (s0, sn), key in saved.items():
        overlap = min(c0 + cn, s0 + sn) - max(c0, s0)
        if overlap > 0:
            total = total + overlap * arrays[key].astype(np.float64)
            weight += overlap
    return (total / weight).astype(np.float32)


def _restore_sparse(model, arrays, where: str) -> None:
    module, opt_state = model.sparse_module, model.sparse_opt_state
    check_mc_tables(model, arrays, where)  # other managed tables: refused before anything changes
    arrays = reshard_mc_arrays(
        model, arrays, where
    )  # id maps saved with another split, their rows with them
    weights = {}
    for t in module.tables:
        key = f"weight/{t.name}"
        if key not in arrays:
            raise ValueError(
                f"{where}: table {t.name!r} is not in the checkpoint (it holds "
                f"{sorted(k[7:] for k in arrays if k.startswith('weight/'))}); "
                "load with the same dataset and tables"
            )
        if arrays[key].shape != (t.num_embeddings, t.embedding_dim):
            raise ValueError(
                f"{where}: table {t.name!r} is saved as {list(arrays[key].shape)} but configured as "
                f"[{t.num_embeddings}, {t.embedding_dim}] (num_embeddings, embedding_dim); use the "
                "checkpoint's table sizes"
            )
        weights[f"embedding_bags.{t.name}.weight"] = torch.from_numpy(np.array(arrays[key]))
    model.load_state_dict(weights, strict=False)

    hosts = {
        (b, name): np.zeros(leaf.shape, leaf.dtype)
        for b in opt_state.tables
        for name, leaf in _leaves(opt_state, b).items()
    }
    for block in module.stored_blocks():  # sparse_jax.StoredBlock
        buffer, table, start, r0, rn, c0, cn = block
        for leaf_name in _leaves(opt_state, buffer):
            host = hosts[(buffer, leaf_name)]
            if host.ndim == 1:
                host[start : start + rn] = _row_values(arrays, table, leaf_name, c0, cn, where)[
                    r0 : r0 + rn
                ]
                continue
            key = f"state/{table}/{leaf_name}"
            if key not in arrays:
                raise ValueError(f"{where}: no optimizer state {leaf_name!r} for table {table!r}")
            host[start : start + rn, :cn] = arrays[key][r0 : r0 + rn, c0 : c0 + cn]

    def place(host: np.ndarray, like: jax.Array) -> jax.Array:
        return jax.make_array_from_callback(host.shape, like.sharding, lambda index: host[index])

    tables = {
        b: (
            {name: place(hosts[(b, name)], leaf) for name, leaf in _leaves(opt_state, b).items()}
            if _leaves(opt_state, b)
            else opt_state.tables[b]  # stateless rule: keep its (empty) structure
        )
        for b in opt_state.tables
    }
    count = place(np.asarray(arrays["count"], np.int32).reshape(()), opt_state.count)
    # SparseTables has no public setter for optimizer state (see the closing note of the
    # training-script change): the state is replaced whole, as the fused update does
    model.load_sparse_opt_state(SparseOptState(count=count, tables=tables))
    restore_mc_state(model, arrays, where)  # the id maps, once the rows they point to are in place


def saved_table_shapes(path: str | os.PathLike) -> dict[str, list[int]]:
    """{table: [rows, dim]} of checkpoint `path`, from the array headers of its tables.npz
    (nothing else is read)."""
    out = {}
    if not (pathlib.Path(path) / "tables.npz").exists():  # the "orbax" format: in its meta
        meta = json.loads((pathlib.Path(path) / "meta.json").read_text())
        if meta.get("format") == "orbax":
            return {name: list(shape) for name, shape in meta["tables"].items()}
    with zipfile.ZipFile(pathlib.Path(path) / "tables.npz") as z:
        for info in z.infolist():
            name = info.filename
            if not (name.startswith("weight/") and name.endswith(".npy")):
                continue
            with z.open(info) as f:
                version = np.lib.format.read_magic(f)
                read = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                out[name[len("weight/") : -len(".npy")]] = list(read(f)[0])
    return out


def estimate_bytes(model) -> int:
    """About one checkpoint's size: tables, sparse optimizer state, dense tower and its
    optimizer (three times the dense parameters: weights and two Adam moments; before the
    first step a torch optimizer holds no state to measure)."""
    tables = sum(
        t.num_embeddings * t.embedding_dim * t.data_type.itemsize
        for t in model.sparse_module.tables
    )
    state = sum(
        int(leaf.nbytes)
        for b in model.sparse_opt_state.tables
        for leaf in _leaves(model.sparse_opt_state, b).values()
    )
    dense = sum(p.numel() * p.element_size() for p in model.dense.parameters()) * 3
    return tables + state + dense + (1 << 16)


def _check_checkpointable(model) -> None:
    opt_state = model.sparse_opt_state
    for buffer in opt_state.tables:
        leaves = _leaves(opt_state, buffer)  # TypeError: not a dict of arrays
        rows = model.sparse_params[buffer].shape[0]
        for name, leaf in leaves.items():
            if leaf.ndim == 0 or leaf.shape[0] != rows:
                raise TypeError(
                    f"sparse optimizer state leaf {name!r} of buffer {buffer!r} is not per-row "
                    f"(shape {leaf.shape})"
                )
