"""Save, find the latest, restore: the checkpoint directory's life.

`save_checkpoint` writes `step_<NNNNNNNN>/` under a temporary name (`tables.npz` from
`_arrays`, `dense.pt`, `meta.json`, then `manifest.json` last, each fsynced) and renames it
into place, then rotates: only older checkpoints of the same run (by the meta's run id)
are deleted, never another run's, never the one just written, and the newest intact ones
are kept. `latest_checkpoint` returns the newest intact checkpoint and logs the ones it
skipped (logger `hybrid.checkpoint`). `load_checkpoint` verifies every file, then restores
tables, optimizer state, dense tower, dense optimizer and torch's RNG onto any mesh and plan,
from either format (the "orbax" one through `_sharded`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pathlib
import shutil
import tempfile
import zipfile
from collections.abc import Mapping

import numpy as np
import torch

from hybrid._files import fsync_dir, publish_dir, write_fsynced
from hybrid.checkpoint._arrays import _restore_sparse, dense_state_bytes, sparse_state_arrays
from hybrid.checkpoint._format import (
    _MANIFEST,
    CheckpointError,
    _read_json,
    _step_dirs,
    _step_of,
    _write_json_atomic,
    scan_checkpoints,
    verify_checkpoint,
)
from hybrid.checkpoint._preflight import _claim, _run_id_of
from hybrid.checkpoint._sharded import load_sharded

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]


_log = logging.getLogger("hybrid.checkpoint")


def _write_file(path: pathlib.Path, data: bytes) -> dict:
    """Write `data` to `path`, fsync it; its manifest entry (sha256, size)."""
    write_fsynced(path, data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def _rotate(root: pathlib.Path, run_id: str, written: pathlib.Path, keep: int) -> None:
    """Keep `written` and the newest `keep - 1` intact older checkpoints of this run; delete
    this run's other older checkpoints (damaged ones included). Another run's checkpoints,
    unknown ones and newer steps are never touched."""
    ours = [
        p
        for p in _step_dirs(root)
        if p != written and _step_of(p) < _step_of(written) and _run_id_of(p) == run_id
    ]
    kept = 0
    for path in reversed(ours):  # newest first
        if kept < keep - 1:
            try:
                verify_checkpoint(path)
            except CheckpointError as e:
                _log.warning("rotation: deleting damaged checkpoint of this run: %s", e)
            else:
                kept += 1
                continue
        shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    directory: str | os.PathLike,
    *,
    step: int,
    model,
    dense_optimizer: torch.optim.Optimizer,
    meta: Mapping | None = None,
    keep: int = 2,
    run_id: str | None = None,
) -> pathlib.Path:
    """Write `directory/step_<step>/` atomically with its manifest (written last); keep the
    newest `keep` intact checkpoints of this run.

    `run_id`: the run this save belongs to. The directory's first save writes `run.json`
    (this id, or a new one when None, and `meta["config"]`); a save with another run's id
    raises `CheckpointError`. With None the directory's run id is adopted."""
    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    run_id = _claim(root, run_id, meta.get("config"))
    final = root / f"step_{step:08d}"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        files = {}
        buffer = io.BytesIO()
        np.savez(buffer, **sparse_state_arrays(model))
        files["tables.npz"] = _write_file(tmp / "tables.npz", buffer.getvalue())
        files["dense.pt"] = _write_file(tmp / "dense.pt", dense_state_bytes(model, dense_optimizer))
        module = model.sparse_module
        plan = module.plan
        info = {
            "step": step,
            "run_id": run_id,
            "sparse_optimizer": model.sparse_optimizer.name,
            "mesh": module.mesh_axes,
            "plan": None if plan is None else json.loads(plan.to_json()),
            **meta,
        }
        files["meta.json"] = _write_file(
            tmp / "meta.json", json.dumps(info, indent=1, default=str).encode()
        )
        _write_json_atomic(tmp / _MANIFEST, {"version": 1, "files": files})  # last
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final)  # (re)writing a step: the old one goes only once the new is in place
    _rotate(root, run_id, final, keep)
    return final


def latest_checkpoint(directory: str | os.PathLike) -> pathlib.Path | None:
    """The newest intact `step_*` checkpoint under `directory` (every file verified against
    its manifest), or None. Newer damaged or incomplete ones are skipped and logged
    (logger `hybrid.checkpoint`)."""
    path, skipped = scan_checkpoints(directory)
    for bad, why in skipped:
        _log.warning("skipping checkpoint %s: %s", bad, why)
    return path


def load_checkpoint(
    path: str | os.PathLike, *, model, dense_optimizer: torch.optim.Optimizer, verify: bool = True
) -> dict:
    """Restore `model` (tables, sparse optimizer state, dense tower), `dense_optimizer` and
    torch's RNG from checkpoint directory `path`; returns its `meta.json`.

    Every file is first verified against the manifest: a damaged, truncated or missing file
    raises `CheckpointError` naming it (nothing is restored then). `verify=False` skips the
    manifest (checkpoints written before manifests); unreadable files still raise
    `CheckpointError`."""
    path = pathlib.Path(path)
    where = f"checkpoint {path}"
    meta = verify_checkpoint(path) if verify else _read_json(path / "meta.json", where)
    if meta["sparse_optimizer"] != model.sparse_optimizer.name:
        raise ValueError(
            f"checkpoint {path}: written with sparse optimizer {meta['sparse_optimizer']!r} but "
            f"sparse_optimizer.name is {model.sparse_optimizer.name!r}; use the same optimizer"
        )
    if meta.get("format") == "orbax":  # written by every process (`_sharded`)
        dense = _read_dense(path, where)
        load_sharded(path, meta, model, where)
        _load_dense(path, model, dense_optimizer, dense)
        return meta
    try:
        with np.load(path / "tables.npz") as arrays:
            tables = {k: arrays[k] for k in arrays.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(
            f"{where}: tables.npz is unreadable ({type(e).__name__}: {e})"
        ) from None
    dense = _read_dense(path, where)
    _restore_sparse(model, tables, where)
    _load_dense(path, model, dense_optimizer, dense)
    return meta


def _read_dense(path: pathlib.Path, where: str) -> dict:
    try:
        return torch.load(path / "dense.pt", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged file
        raise CheckpointError(
            f"{where}: dense.pt is unreadable ({type(e).__name__}: {e})"
        ) from None


def _load_dense(path: pathlib.Path, model, dense_optimizer, dense: dict) -> None:
    try:
        model.dense.load_state_dict(dense["dense"])
    except RuntimeError as e:
        raise ValueError(
            f"checkpoint {path}: the dense tower does not match the [model] config ({e})"
        ) from None
    dense_optimizer.load_state_dict(dense["optimizer"])
    torch.set_rng_state(dense["torch_rng"])
