"""Training checkpoints: save, find the latest, restore (onto any mesh and plan).

A checkpoint is a directory `step_<NNNNNNNN>/` written under a temporary name and renamed
into place (atomic: a run killed mid-write leaves only a `.tmp-*` directory, ignored):

- `tables.npz`: per table, in plan-independent form: `weight/<table>` `[rows, dim]`;
  each per-row optimizer state leaf `state/<table>/<leaf>` (`[rows, dim]`, elementwise
  rules) or `state/<table>/<leaf>/cols_<c0>_<cn>` (`[rows]`, one value per row of each
  column block: row-wise Adagrad); `count`, the sparse optimizer's step count; for
  managed-collision tables their id maps, counters and draw key (`mc/<table>/<field>`,
  `mc_key`; see `_managed`).
- `dense.pt`: the dense tower's and the torch optimizer's state dicts, torch's RNG state.
- `meta.json`: step, the sparse rule's name, the mesh and plan written on, the run id, and
  whatever the caller adds (the training script: loss tracker, config).
- `manifest.json`, written last (temporary name, fsync, rename): sha256 and size of every
  other file. `load_checkpoint` verifies every file against it and raises `CheckpointError`
  naming the file and the reason (missing, truncated, hash mismatch, unreadable json);
  `latest_checkpoint` returns the newest *intact* checkpoint and logs the ones it skipped.

Run identity: a checkpoint directory belongs to one run. The first save writes
`run.json` (run id, config, creation time) atomically; every checkpoint's meta carries
the run id. Rotation deletes only older checkpoints of the same run (by the meta's run
id), never another run's, never the checkpoint just written, and keeps the newest intact
ones. `prepare_run` (the training script's preflight) refuses a fresh run into a
directory holding checkpoints, checks the directory is writable and has room for two
checkpoints, that the sparse optimizer can be checkpointed, and on resume that the
config keeps exact resumption possible.

Single-process: the training script refuses `checkpoint.dir` under torchrun (every array
is read whole on the host here).

Restore reads the tables by rows and columns and places them into the current model's
buffers, so a checkpoint written on one mesh/plan loads on another (reshard on load),
optimizer state included. Row-wise state of a column-sharded table is one value per row
per column block; loaded into coarser blocks it is the width-weighted mean of the saved
blocks (exact: `s` accumulates `mean(g*g)` over the block's columns); loaded into finer
blocks each takes its enclosing saved block's value (TorchRec's approximation).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable, Mapping

import jax
import numpy as np
import torch

from hybrid._files import fsync_dir, publish_dir, sha256_file, write_atomic, write_fsynced
from hybrid.checkpoint._managed import (
    check_mc_tables,
    mc_state_arrays,
    reshard_mc_arrays,
    restore_mc_state,
)
from sparse_jax.optim import SparseOptState

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "prepare_run",
    "save_checkpoint",
    "sparse_state_arrays",
    "verify_checkpoint",
]

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_MANIFEST = "manifest.json"
_RUN_FILE = "run.json"
_log = logging.getLogger("hybrid.checkpoint")


class CheckpointError(Exception):
    """A checkpoint that cannot be used: a damaged, truncated or missing file (the message
    names the checkpoint, the file and the reason), or a directory owned by another run."""


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
            rows = host[start : start + rn]
            if host.ndim == 1:
                key = f"state/{table}/{leaf_name}/cols_{c0}_{cn}"
                out.setdefault(key, np.zeros(dims[table][0], host.dtype))[r0 : r0 + rn] = rows
            else:
                key = f"state/{table}/{leaf_name}"
                out.setdefault(key, np.zeros(dims[table], host.dtype))[
                    r0 : r0 + rn, c0 : c0 + cn
                ] = rows[:, :cn]
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
    arrays = reshard_mc_arrays(model, arrays, where)  # id maps saved with another split, their rows with them
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


# -- files: written with fsync, verified against the manifest ---------------------------


def _write_file(path: pathlib.Path, data: bytes) -> dict:
    """Write `data` to `path`, fsync it; its manifest entry (sha256, size)."""
    write_fsynced(path, data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def _write_json_atomic(path: pathlib.Path, value) -> None:
    write_atomic(path, json.dumps(value, indent=1, default=str).encode())


def _read_json(path: pathlib.Path, what: str):
    """JSON of `path`, or CheckpointError naming it (missing / unreadable)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{what}: {path.name} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{what}: {path.name} is unreadable ({e})") from None
    try:
        return json.loads(data)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{what}: {path.name} is unreadable json ({e})") from None


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check every file of checkpoint `path` against its manifest; returns its meta.json.
    Raises `CheckpointError` naming the file and the reason."""
    path = pathlib.Path(path)
    where = f"checkpoint {path}"
    if not path.is_dir():
        raise CheckpointError(f"{where}: no such checkpoint directory")
    if not (path / _MANIFEST).exists():
        raise CheckpointError(
            f"{where}: {_MANIFEST} is missing (the save did not finish, the file was deleted, or "
            "the checkpoint predates manifests: load it with verify=False at your own risk)"
        )
    manifest = _read_json(path / _MANIFEST, where)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and "sha256" in v and "size" in v for v in files.values()
    ):
        raise CheckpointError(f"{where}: {_MANIFEST} is unreadable (no valid 'files' table)")
    for name in ("tables.npz", "dense.pt", "meta.json"):
        if name not in files:
            raise CheckpointError(f"{where}: {_MANIFEST} does not list {name}")
    for name, entry in sorted(files.items()):
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{where}: {name} is missing") from None
        except OSError as e:
            raise CheckpointError(f"{where}: {name} is unreadable ({e})") from None
        if size < entry["size"]:
            raise CheckpointError(f"{where}: {name} is truncated ({size} of {entry['size']} bytes)")
        if size > entry["size"]:
            raise CheckpointError(
                f"{where}: {name} has {size} bytes, the manifest says {entry['size']} (hash mismatch)"
            )
        try:
            digest = sha256_file(file)
        except OSError as e:
            raise CheckpointError(f"{where}: {name} is unreadable ({e})") from None
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"{where}: {name} hash mismatch (sha256 {digest[:12]}..., the manifest says "
                f"{entry['sha256'][:12]}...): the file is damaged"
            )
    meta = _read_json(path / "meta.json", where)
    if not isinstance(meta, dict) or "step" not in meta:
        raise CheckpointError(f"{where}: meta.json is unreadable (no 'step')")
    return meta


# -- the directory: steps, run identity, rotation ----------------------------------------


def _step_dirs(root: pathlib.Path) -> list[pathlib.Path]:
    """`step_*` directories under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def _step_of(path: pathlib.Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def _run_id_of(path: pathlib.Path) -> str | None:
    """The run id in a checkpoint's meta.json, None if unknown (unreadable, pre-run-id)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta.get("run_id") if isinstance(meta, dict) else None


def read_run(directory: str | os.PathLike) -> dict | None:
    """The directory's `run.json` (run id, config, creation time), None if absent."""
    path = pathlib.Path(directory) / _RUN_FILE
    if not path.exists():
        return None
    run = _read_json(path, f"checkpoint directory {directory}")
    if not isinstance(run, dict) or "run_id" not in run:
        raise CheckpointError(f"checkpoint directory {directory}: {_RUN_FILE} has no run_id")
    return run


def _claim(root: pathlib.Path, run_id: str | None, config) -> str:
    """This save's run id; writes `run.json` on a directory's first save. Refuses a save
    into a directory owned by another run."""
    run = read_run(root)
    if run is None:
        run_id = run_id or uuid.uuid4().hex
        _write_json_atomic(
            root / _RUN_FILE,
            {"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config},
        )
        return run_id
    if run_id is not None and run["run_id"] != run_id:
        raise CheckpointError(
            f"checkpoint directory {root} belongs to run {run['run_id']} (created "
            f"{run.get('created')}), not to this run {run_id}; resume that run, or choose another "
            "checkpoint.dir"
        )
    return run["run_id"]


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
        buffer = io.BytesIO()
        torch.save(
            {
                "dense": model.dense.state_dict(),
                "optimizer": dense_optimizer.state_dict(),
                "torch_rng": torch.get_rng_state(),
            },
            buffer,
        )
        files["dense.pt"] = _write_file(tmp / "dense.pt", buffer.getvalue())
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


def scan_checkpoints(
    directory: str | os.PathLike,
) -> tuple[pathlib.Path | None, list[tuple[pathlib.Path, str]]]:
    """(the newest intact checkpoint or None, [(newer damaged checkpoint, why skipped)])."""
    skipped = []
    for path in reversed(_step_dirs(pathlib.Path(directory))):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            skipped.append((path, str(e)))
            continue
        return path, skipped
    return None, skipped


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
    try:
        with np.load(path / "tables.npz") as arrays:
            tables = {k: arrays[k] for k in arrays.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(
            f"{where}: tables.npz is unreadable ({type(e).__name__}: {e})"
        ) from None
    try:
        dense = torch.load(path / "dense.pt", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged file
        raise CheckpointError(
            f"{where}: dense.pt is unreadable ({type(e).__name__}: {e})"
        ) from None
    _restore_sparse(model, tables, where)
    try:
        model.dense.load_state_dict(dense["dense"])
    except RuntimeError as e:
        raise ValueError(
            f"checkpoint {path}: the dense tower does not match the [model] config ({e})"
        ) from None
    dense_optimizer.load_state_dict(dense["optimizer"])
    torch.set_rng_state(dense["torch_rng"])
    return meta


# -- preflight for the training script ----------------------------------------------------

# config keys whose change makes the resumed run differ from an uninterrupted one
_RESUME_KEYS = ("seed", "train.batch_size", "data.", "model.data_type", "sparse_optimizer.stochastic_rounding",
                "managed_collision.")
# keys added after checkpoints were first written: a stored config without them had these values
_ADDED_DEFAULTS = {"model.data_type": "FP32", "sparse_optimizer.stochastic_rounding": True, "data.raw_ids": [],
                   "managed_collision.eviction_policy": "lru", "managed_collision.eviction_interval": 1,
                   "managed_collision.threshold": 1, "managed_collision.history_capacity": 0}


@dataclasses.dataclass(frozen=True)
class RunCheckpoints:
    """What `prepare_run` decided: this run's id, the checkpoint to resume from (None:
    start at step 0), and the newer checkpoints skipped as damaged (path, why)."""

    directory: pathlib.Path
    run_id: str
    resume_from: pathlib.Path | None
    skipped: list[tuple[pathlib.Path, str]]


def _flat(d: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(old: Mapping, new: Mapping) -> list[tuple[str, object, object]]:
    """(key, old, new) for the keys in `_RESUME_KEYS` that differ (a table precision change
    would round the stored fp32 rows: not the run that was interrupted)."""
    a, b = {**_ADDED_DEFAULTS, **_flat(old)}, {**_ADDED_DEFAULTS, **_flat(new)}
    return [
        (k, a.get(k, "<unset>"), b.get(k, "<unset>"))
        for k in sorted(set(a) | set(b))
        if any(k == r or (r.endswith(".") and k.startswith(r)) for r in _RESUME_KEYS)
        and a.get(k, "<unset>") != b.get(k, "<unset>")
    ]


def estimate_bytes(model) -> int:
    """About one checkpoint's size: tables, sparse optimizer state, dense tower and its
    optimizer (three times the dense parameters: weights and two Adam moments; before the
    first step a torch optimizer holds no state to measure)."""
    tables = sum(t.num_embeddings * t.embedding_dim * t.data_type.itemsize for t in model.sparse_module.tables)
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


def _moved_aside(root: pathlib.Path, old_id: str) -> pathlib.Path:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = root / f".replaced-{old_id[:12]}-{stamp}"
    aside.mkdir()
    for p in _step_dirs(root):
        os.rename(p, aside / p.name)
    if (root / _RUN_FILE).exists():
        os.rename(root / _RUN_FILE, aside / _RUN_FILE)
    fsync_dir(root)
    return aside


def saved_table_shapes(path: str | os.PathLike) -> dict[str, list[int]]:
    """{table: [rows, dim]} of checkpoint `path`, from the array headers of its tables.npz
    (nothing else is read)."""
    out = {}
    with zipfile.ZipFile(pathlib.Path(path) / "tables.npz") as z:
        for info in z.infolist():
            name = info.filename
            if not (name.startswith("weight/") and name.endswith(".npy")):
                continue
            with z.open(info) as f:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                out[name[len("weight/") : -len(".npy")]] = list(read(f)[0])
    return out


def _refuse_other_tables(latest: pathlib.Path, model) -> None:
    """A resume whose tables (names, [rows, dim]) are not the checkpoint's stops here, naming
    every difference, before anything is loaded."""
    from hybrid._errors import ConfigError

    try:
        saved = saved_table_shapes(latest)
    except (OSError, ValueError, zipfile.BadZipFile):
        return  # unreadable: load_checkpoint reports it, naming the file
    wanted = {t.name: [t.num_embeddings, t.embedding_dim] for t in model.sparse_module.tables}
    differences = []
    if missing := sorted(set(wanted) - set(saved)):
        differences.append(f"this config's tables {missing} are not in the checkpoint")
    if extra := sorted(set(saved) - set(wanted)):
        differences.append(f"the checkpoint's tables {extra} are not in this config")
    differences += [
        f"table {name!r} is saved as {saved[name]} but configured as {wanted[name]} (num_embeddings, embedding_dim)"
        for name in sorted(set(saved) & set(wanted))
        if saved[name] != wanted[name]
    ]
    if differences:
        raise ConfigError(
            f"--resume from {latest}: the checkpoint holds other tables than this config builds: "
            f"{'; '.join(differences)}. Not even checkpoint.allow_config_change can load it: it is "
            f"another model. Resume it with the config that wrote it (stored under 'config' in "
            f"{latest / 'meta.json'}), or train this config as a fresh run in another checkpoint.dir "
            "(--set checkpoint.dir=...)"
        )


def _fmt(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def prepare_run(
    directory: str | os.PathLike,
    *,
    config: Mapping,
    model,
    resume: bool,
    overwrite: bool = False,
    allow_config_change: bool = False,
    echo: Callable[[str], None] = print,
) -> RunCheckpoints:
    """The training script's checkpoint preflight, before any training step. Raises
    `ConfigError` (naming the directory / key) when:

    - the directory cannot be created or written (read-only, a path under a file);
    - its disk has no room for two checkpoints (estimated from tables + optimizer state);
    - the sparse optimizer's state cannot be checkpointed;
    - a fresh run (no resume) finds another run's checkpoints: resume it, choose another
      directory, or set `checkpoint.overwrite = true` (the old checkpoints and run.json are
      then moved aside into `<dir>/.replaced-<old run id>-<time>/`, never deleted);
    - a resume finds checkpoints but none intact, or its config changes a key that exact
      resumption needs (seed, train.batch_size, [data]) without `allow_config_change`.
    """
    from hybrid._errors import ConfigError

    root = pathlib.Path(directory)
    where = f"checkpoint.dir {str(directory)!r}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=root)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"{where} is not writable ({type(e).__name__}: {e}); checkpoints could not be saved. "
            "Choose a writable checkpoint.dir (--set checkpoint.dir=...) or fix its permissions"
        ) from None
    try:  # first: the size estimate reads the state too
        _check_checkpointable(model)
    except TypeError as e:
        raise ConfigError(
            f"sparse_optimizer.name = {model.sparse_optimizer.name!r} cannot be checkpointed ({e}); "
            "choose another sparse optimizer or unset checkpoint.dir"
        ) from None
    need = 2 * estimate_bytes(model)
    free = shutil.disk_usage(root).free
    if free < need:
        raise ConfigError(
            f"{where}: {free / 2**20:.1f} MiB free on its disk but two checkpoints need about "
            f"{need / 2**20:.1f} MiB (tables + optimizer state); free space or choose another "
            "checkpoint.dir"
        )
    try:
        run = read_run(root)
    except CheckpointError as e:
        raise ConfigError(f"{where}: {e}; move the directory aside or choose another") from None
    steps = _step_dirs(root)

    if not resume:
        if steps:
            owner = (
                f"run {run['run_id']} (created {run.get('created')})"
                if run
                else f"a run with unknown id ({_run_id_of(steps[-1]) or 'no run.json'})"
            )
            names = ", ".join(p.name for p in steps)
            if not overwrite:
                raise ConfigError(
                    f"{where} already holds checkpoints of {owner}: {names}. Refusing to start a "
                    "fresh run over them. Resume that run (--resume), choose another "
                    "checkpoint.dir, or pass --set checkpoint.overwrite=true (its checkpoints are "
                    "moved aside into the directory's .replaced-* folder)"
                )
            aside = _moved_aside(root, run["run_id"] if run else "unknown")
            echo(
                f"checkpoint.overwrite: moved the checkpoints of {owner} ({names}) aside to {aside}; "
                "delete it yourself to free the space"
            )
        elif run is not None:  # a run.json with no checkpoint: nothing to lose, take it over
            (root / _RUN_FILE).unlink()
        return RunCheckpoints(root, uuid.uuid4().hex, None, [])

    latest, skipped = scan_checkpoints(root)
    if steps and latest is None:
        reasons = "; ".join(why for _, why in skipped)
        raise ConfigError(
            f"--resume: no intact checkpoint in {where} ({reasons}). Nothing can be resumed; "
            "start over with a fresh run and --set checkpoint.overwrite=true (the damaged "
            "checkpoints are moved aside), or choose another checkpoint.dir"
        )
    run_id = run["run_id"] if run else (latest and _run_id_of(latest)) or uuid.uuid4().hex
    stored = None
    if latest is not None:
        stored = json.loads((latest / "meta.json").read_text()).get("config")
    if stored is None and run is not None:
        stored = run.get("config")
    if isinstance(stored, Mapping):
        changes = config_changes(stored, config)
        if changes and not allow_config_change:
            listed = "; ".join(f"{k}: {_fmt(a)} -> {_fmt(b)}" for k, a, b in changes)
            raise ConfigError(
                f"--resume from {latest or root}: the config changes keys that exact resumption "
                f"needs ({listed}); restore them, or pass --set checkpoint.allow_config_change=true "
                "to resume anyway (the run will not match an uninterrupted one)"
            )
        if changes:
            echo(
                "checkpoint.allow_config_change: resuming with changed "
                + ", ".join(k for k, _, _ in changes)
            )
    if latest is not None:
        _refuse_other_tables(latest, model)
    for p in root.iterdir():  # leftovers of saves killed midway (this run owns the directory)
        if p.name.startswith(".tmp-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    return RunCheckpoints(root, run_id, latest, skipped)
