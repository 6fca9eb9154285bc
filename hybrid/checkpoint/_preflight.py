"""Run identity and the training script's preflight.

A checkpoint directory belongs to one run: the first save writes `run.json` (run id,
config, creation time) atomically (`_claim`), and every checkpoint's meta carries the run
id (`_run_id_of`). `prepare_run`, before any training step, refuses a fresh run into a
directory holding checkpoints, checks the directory is writable and has room for two
checkpoints, that the sparse optimizer can be checkpointed, and on resume that the config
keeps exact resumption possible (`config_changes`) and builds the checkpoint's tables. It
raises `hybrid._errors.ConfigError`; nothing here imports the training script.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable, Mapping

from hybrid._errors import ConfigError
from hybrid._files import fsync_dir
from hybrid.checkpoint._arrays import _check_checkpointable, estimate_bytes, saved_table_shapes
from hybrid.checkpoint._format import (
    _RUN_FILE,
    CheckpointError,
    _read_json,
    _step_dirs,
    _write_json_atomic,
    scan_checkpoints,
)

__all__ = ["RunCheckpoints", "config_changes", "prepare_run", "read_run"]


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


# -- preflight for the training script ----------------------------------------------------

# config keys whose change makes the resumed run differ from an uninterrupted one
_RESUME_KEYS = (
    "seed",
    "train.batch_size",
    "data.",
    "model.data_type",
    "sparse_optimizer.stochastic_rounding",
    "managed_collision.",
)
# keys added after checkpoints were first written: a stored config without them had these values
_ADDED_DEFAULTS = {
    "model.data_type": "FP32",
    "sparse_optimizer.stochastic_rounding": True,
    "data.raw_ids": [],
    "managed_collision.eviction_policy": "lru",
    "managed_collision.eviction_interval": 1,
    "managed_collision.threshold": 1,
    "managed_collision.history_capacity": 0,
    "managed_collision.decay_exponent": 1.0,
    "managed_collision.single_ttl": 0,
}


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


def _refuse_other_tables(latest: pathlib.Path, model) -> None:
    """A resume whose tables (names, [rows, dim]) are not the checkpoint's stops here, naming
    every difference, before anything is loaded."""
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
