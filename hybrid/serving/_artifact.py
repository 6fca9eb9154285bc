"""The serving artifact on disk: its layout, its manifest, and the checks made on load.

An artifact is one directory written by `hybrid.export`:

    manifest.json          format, features, tables, accepted shapes, versions, sha256 of every file
    sparse_lookup.jaxexport  the pooled lookup, a serialized `jax.export.Exported`, for
                           `max_batch_size` bags per feature
    sparse_lookup.b<B>.jaxexport  the same lookup for B bags per feature, for each smaller
                           batch rung (manifest: programs.sparse.batch_rungs; optional)
    sparse_lookup[.b<B>].cpu_kernel.jaxexport  the same lookups, CPU only, with the quantized
                           tables read by the C++ kernel's custom call (manifest:
                           programs.sparse.cpu_kernel; optional: quantized models exported
                           where the kernel was built)
    dense_tower.pt2        the dense tower, a `torch.export.save`d ExportedProgram
    tables/<i>_<name>.npy  one file per table: fp32 (or fp16) rows, or packed uint8 rows
    id_maps/<i>_<name>.npz  a managed-collision table's frozen id map: resident raw ids and
                           their rows (manifest: the table's managed_collision, with the
                           default row of each shard holding a map, default_rows)

`read_manifest` parses and checks the manifest; `verify_files` checks every listed file
against its sha256 and size. Both raise `ArtifactError` naming the artifact, the file and
what to do. Only the standard library is used here.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any

from hybrid._files import sha256_file

__all__ = [
    "DENSE_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "SPARSE_FILE",
    "ArtifactError",
    "batch_rungs",
    "kernel_program",
    "read_manifest",
    "sparse_file",
    "table_file",
    "verify_files",
]

FORMAT = "hybridrec-serving"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPARSE_FILE = "sparse_lookup.jaxexport"
DENSE_FILE = "dense_tower.pt2"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")

# manifest keys read by the loader, with their types
_REQUIRED = {
    "format": str,
    "format_version": int,
    "model": str,
    "features": list,
    "embeddings": list,
    "tables": list,
    "is_weighted": bool,
    "bounds_check": str,
    "dense": dict,
    "accepts": dict,
    "programs": dict,
    "versions": dict,
    "files": dict,
}
_TABLE_KEYS = (
    "name",
    "num_embeddings",
    "embedding_dim",
    "dtype",
    "file_dtype",
    "shape",
    "weight_type",
    "pooling",
    "features",
    "file",
)


class ArtifactError(Exception):
    """A serving artifact that cannot be used: a missing, damaged or truncated file, a
    malformed manifest or one of another format version. The message names the artifact,
    the file and the reason."""


def sparse_file(batch: int, max_batch_size: int, form: str = "xla") -> str:
    """The lookup program taking `batch` bags per feature (`max_batch_size`: SPARSE_FILE), in
    `form` ("xla", or "cpu_kernel": the C++ kernel's custom call)."""
    stem = "sparse_lookup" if batch == max_batch_size else f"sparse_lookup.b{batch}"
    return f"{stem}.jaxexport" if form == "xla" else f"{stem}.{form}.jaxexport"


def kernel_program(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """`programs.sparse.cpu_kernel`: `{"target": the custom call, "platforms": ["cpu"]}` when
    the artifact also holds the lookups in the C++ kernel's form (one per batch rung), else
    None (artifacts written before it, float models, exports where the kernel was not built)."""
    return manifest["programs"].get("sparse", {}).get("cpu_kernel")


def batch_rungs(manifest: dict[str, Any]) -> list[int]:
    """The batch sizes the artifact holds a lookup program for, ascending (the largest is
    `max_batch_size`; artifacts written before batch rungs hold that one only)."""
    top = int(manifest["accepts"]["max_batch_size"])
    rungs = manifest["programs"].get("sparse", {}).get("batch_rungs") or [top]
    return sorted({int(b) for b in rungs} | {top})


def table_file(index: int, name: str) -> str:
    """The path (relative to the artifact) of table `index` named `name`."""
    return f"tables/{index:02d}_{_UNSAFE.sub('_', name)}.npy"


def id_map_file(index: int, name: str) -> str:
    """The path of managed table `index`'s frozen id map: an .npz of `ids` (resident raw ids,
    ascending int64) and `rows` (the row of each, int32)."""
    return f"id_maps/{index:02d}_{_UNSAFE.sub('_', name)}.npz"


def _where(path: pathlib.Path) -> str:
    return f"serving artifact {str(path)!r}"


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `manifest.json` of artifact directory `path`, checked for format, version
    and the keys the loader reads. Raises `ArtifactError` naming manifest.json."""
    path = pathlib.Path(path)
    where = _where(path)
    if not path.is_dir():
        raise ArtifactError(f"{where}: no such directory; pass the directory hybrid.export wrote")
    try:
        data = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise ArtifactError(
            f"{where}: {MANIFEST} is missing; re-export the model with hybrid.export"
        ) from None
    except OSError as e:
        raise ArtifactError(f"{where}: {MANIFEST} is unreadable ({e})") from None
    try:
        manifest = json.loads(data)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ArtifactError(
            f"{where}: {MANIFEST} is not valid json ({e}); re-export the model"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ArtifactError(
            f"{where}: {MANIFEST} has format {found!r}, not {FORMAT!r}: this is not a hybridrec serving "
            "artifact (a checkpoint directory loads with hybrid.load_checkpoint)"
        )
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        wrote = (
            manifest.get("versions", {}).get("hybridrec", "unknown")
            if isinstance(manifest.get("versions"), dict)
            else "unknown"
        )
        raise ArtifactError(
            f"{where}: {MANIFEST} has format_version {version!r}; this hybridrec reads version {FORMAT_VERSION}. "
            f"Load it with the hybridrec that wrote it ({wrote}) or re-export the model with this one"
        )
    for key, kind in _REQUIRED.items():
        if not isinstance(manifest.get(key), kind):
            raise ArtifactError(
                f"{where}: {MANIFEST} is malformed: {key!r} should be a {kind.__name__}, got "
                f"{type(manifest.get(key)).__name__}; re-export the model"
            )
    for i, table in enumerate(manifest["tables"]):
        missing = [k for k in _TABLE_KEYS if not isinstance(table, dict) or k not in table]
        if missing:
            raise ArtifactError(
                f"{where}: {MANIFEST} is malformed: tables[{i}] lacks {missing}; re-export the model"
            )
    files = manifest["files"]
    if not all(
        isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("size"), int)
        for v in files.values()
    ):
        raise ArtifactError(
            f"{where}: {MANIFEST} is malformed: 'files' needs a sha256 and a size per file"
        )
    try:
        top = int(manifest["accepts"]["max_batch_size"])
        programs = [sparse_file(b, top) for b in batch_rungs(manifest)]
        if any(b < 1 or b > top for b in batch_rungs(manifest)):
            raise ValueError("a batch rung outside [1, max_batch_size]")
        kernel = kernel_program(manifest)
        if kernel is not None:
            if not isinstance(kernel, dict) or not isinstance(kernel.get("target"), str):
                raise ValueError("programs.sparse.cpu_kernel needs a 'target'")
            programs += [sparse_file(b, top, "cpu_kernel") for b in batch_rungs(manifest)]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ArtifactError(
            f"{where}: {MANIFEST} is malformed: accepts.max_batch_size / programs.sparse "
            f"({type(e).__name__}: {e}); re-export the model"
        ) from None
    needed = [*programs, DENSE_FILE, *(t["file"] for t in manifest["tables"])]
    unlisted = [name for name in needed if name not in files]
    if unlisted:
        raise ArtifactError(
            f"{where}: {MANIFEST} does not list {unlisted} under 'files'; re-export the model"
        )
    return manifest


def verify_files(path: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Check every file the manifest lists: present, of its size, of its sha256. Raises
    `ArtifactError` naming the first bad file."""
    path = pathlib.Path(path)
    where = _where(path)
    for name, entry in sorted(manifest["files"].items()):
        file = path / name
        if pathlib.PurePosixPath(name).is_absolute() or ".." in pathlib.PurePosixPath(name).parts:
            raise ArtifactError(
                f"{where}: {MANIFEST} lists {name!r}, which is outside the artifact"
            )
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise ArtifactError(
                f"{where}: {name} is missing (the manifest lists it); re-export the model"
            ) from None
        except OSError as e:
            raise ArtifactError(f"{where}: {name} is unreadable ({e})") from None
        if size != entry["size"]:
            state = "truncated" if size < entry["size"] else "longer than written"
            raise ArtifactError(
                f"{where}: {name} is {state} ({size} bytes, the manifest says {entry['size']}): the file is "
                "damaged; copy the artifact again or re-export the model"
            )
        try:
            digest = sha256_file(file)
        except OSError as e:
            raise ArtifactError(f"{where}: {name} is unreadable ({e})") from None
        if digest != entry["sha256"]:
            raise ArtifactError(
                f"{where}: {name} hash mismatch (sha256 {digest[:12]}..., the manifest says "
                f"{entry['sha256'][:12]}...): the file is damaged; copy the artifact again or re-export the model"
            )
