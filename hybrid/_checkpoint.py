"""Training checkpoints: save, find the latest, restore (onto any mesh and plan).

A checkpoint is a directory `step_<NNNNNNNN>/` written under a temporary name and renamed
into place (atomic: a run killed mid-write leaves only a `.tmp-*` directory, ignored):

- `tables.npz`: per table, in plan-independent form: `weight/<table>` `[rows, dim]`;
  each per-row optimizer state leaf `state/<table>/<leaf>` (`[rows, dim]`, elementwise
  rules) or `state/<table>/<leaf>/cols_<c0>_<cn>` (`[rows]`, one value per row of each
  column block: row-wise Adagrad); `count`, the sparse optimizer's step count.
- `dense.pt`: the dense tower's and the torch optimizer's state dicts, torch's RNG state.
- `meta.json`: step, the sparse rule's name, the mesh and plan written on, and whatever
  the caller adds (the training script: loss tracker, config).

Restore reads the tables by rows and columns and places them into the current model's
buffers, so a checkpoint written on one mesh/plan loads on another (reshard on load),
optimizer state included. Row-wise state of a column-sharded table is one value per row
per column block; loaded into coarser blocks it is the width-weighted mean of the saved
blocks (exact: `s` accumulates `mean(g*g)` over the block's columns); loaded into finer
blocks each takes its enclosing saved block's value (TorchRec's approximation).
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Mapping

import jax
import numpy as np
import torch

from sparse_jax.optim import SparseOptState

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint", "sparse_state_arrays"]

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _host(array: jax.Array) -> np.ndarray:
    if array.is_fully_addressable:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _leaves(opt_state: SparseOptState, buffer: str) -> Mapping[str, jax.Array]:
    leaves = opt_state.tables[buffer]
    if not isinstance(leaves, Mapping):
        raise TypeError(
            f"checkpoint: sparse optimizer state of buffer {buffer!r} is a {type(leaves).__name__}; "
            "only rules whose per-table state is a dict of arrays (sgd, adagrad, rowwise_adagrad, "
            "adam) can be checkpointed"
        )
    return leaves


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
                host = hosts[(buffer, leaf_name)] = _host(leaf)
            rows = host[start : start + rn]
            if host.ndim == 1:
                key = f"state/{table}/{leaf_name}/cols_{c0}_{cn}"
                out.setdefault(key, np.zeros(dims[table][0], host.dtype))[r0 : r0 + rn] = rows
            else:
                key = f"state/{table}/{leaf_name}"
                out.setdefault(key, np.zeros(dims[table], host.dtype))[
                    r0 : r0 + rn, c0 : c0 + cn
                ] = rows[:, :cn]
    out["count"] = _host(opt_state.count)
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
        b: {name: place(hosts[(b, name)], leaf) for name, leaf in _leaves(opt_state, b).items()}
        for b in opt_state.tables
    }
    count = place(np.asarray(arrays["count"], np.int32).reshape(()), opt_state.count)
    # SparseTables has no public setter for optimizer state (see the closing note of the
    # training-script change): the state is replaced whole, as the fused update does
    model.load_sparse_opt_state(SparseOptState(count=count, tables=tables))


def save_checkpoint(
    directory: str | os.PathLike,
    *,
    step: int,
    model,
    dense_optimizer: torch.optim.Optimizer,
    meta: Mapping | None = None,
    keep: int = 2,
) -> pathlib.Path:
    """Write `directory/step_<step>/` atomically; keep the newest `keep` checkpoints."""
    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        arrays = sparse_state_arrays(model)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        (tmp / "tables.npz").write_bytes(buffer.getvalue())
        torch.save(
            {
                "dense": model.dense.state_dict(),
                "optimizer": dense_optimizer.state_dict(),
                "torch_rng": torch.get_rng_state(),
            },
            tmp / "dense.pt",
        )
        module = model.sparse_module
        plan = module.plan
        info = {
            "step": step,
            "sparse_optimizer": model.sparse_optimizer.name,
            "mesh": module.mesh_axes,
            "plan": None if plan is None else json.loads(plan.to_json()),
            **(meta or {}),
        }
        (tmp / "meta.json").write_text(json.dumps(info, indent=1, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(directory: str | os.PathLike) -> pathlib.Path | None:
    """The newest complete `step_*` checkpoint under `directory`, or None."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        return None
    steps = sorted(
        p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "meta.json").exists()
    )
    return steps[-1] if steps else None


def load_checkpoint(
    path: str | os.PathLike, *, model, dense_optimizer: torch.optim.Optimizer
) -> dict:
    """Restore `model` (tables, sparse optimizer state, dense tower), `dense_optimizer` and
    torch's RNG from checkpoint directory `path`; returns its `meta.json`."""
    path = pathlib.Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta["sparse_optimizer"] != model.sparse_optimizer.name:
        raise ValueError(
            f"checkpoint {path}: written with sparse optimizer {meta['sparse_optimizer']!r} but "
            f"sparse_optimizer.name is {model.sparse_optimizer.name!r}; use the same optimizer"
        )
    with np.load(path / "tables.npz") as arrays:
        _restore_sparse(model, {k: arrays[k] for k in arrays.files}, f"checkpoint {path}")
    dense = torch.load(path / "dense.pt", weights_only=True)
    try:
        model.dense.load_state_dict(dense["dense"])
    except RuntimeError as e:
        raise ValueError(
            f"checkpoint {path}: the dense tower does not match the [model] config ({e})"
        ) from None
    dense_optimizer.load_state_dict(dense["optimizer"])
    torch.set_rng_state(dense["torch_rng"])
    return meta
