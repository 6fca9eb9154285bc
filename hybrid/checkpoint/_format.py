"""The checkpoint format: a `step_<NNNNNNNN>/` directory checked against its manifest.

`manifest.json`, written last, holds the sha256 and size of every other file
(`tables.npz`, `dense.pt`, `meta.json`; in the "orbax" format, `_sharded`, every file of
`sparse/` instead of `tables.npz`); `verify_checkpoint` checks each file against it
and raises `CheckpointError` naming the checkpoint, the file and the reason (missing,
truncated, hash mismatch, unreadable json); `scan_checkpoints` finds the newest intact
checkpoint of a directory and the newer damaged ones it skipped. `run.json` (the run's
identity) is read and written by `_preflight`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

from hybrid._files import sha256_file, write_atomic

__all__ = ["CheckpointError", "scan_checkpoints", "verify_checkpoint"]


_STEP_DIR = re.compile(r"^step_(\d{8,})$")


_MANIFEST = "manifest.json"


_RUN_FILE = "run.json"


class CheckpointError(Exception):
    """A checkpoint that cannot be used: a damaged, truncated or missing file (the message
    names the checkpoint, the file and the reason), or a directory owned by another run."""


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
    orbax = manifest.get("format") == "orbax"  # sparse/ written by every process (`_sharded`)
    for name in ("dense.pt", "meta.json") if orbax else ("tables.npz", "dense.pt", "meta.json"):
        if name not in files:
            raise CheckpointError(f"{where}: {_MANIFEST} does not list {name}")
    if orbax and not any(name.startswith("sparse/") for name in files):
        raise CheckpointError(f"{where}: {_MANIFEST} lists no file of sparse/")
    if orbax:  # a shard file the manifest does not know: not what was committed
        listed = {path / name for name in files} | {path / _MANIFEST}
        for file in sorted((path / "sparse").rglob("*")):
            if file.is_file() and file not in listed:
                raise CheckpointError(
                    f"{where}: {file.relative_to(path)} is not in {_MANIFEST} (a file added after "
                    "the commit)"
                )
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


# -- the directory: its step_* checkpoints, oldest first --------------------------------


def _step_dirs(root: pathlib.Path) -> list[pathlib.Path]:
    """`step_*` directories under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def _step_of(path: pathlib.Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


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
