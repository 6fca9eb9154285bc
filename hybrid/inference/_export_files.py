"""Writing a serving artifact: the .npy bytes of a table, the versions in the manifest, and
the directory written under a temporary name and renamed into place (`write_artifact`)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import pathlib
import shutil
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from hybrid._files import fsync_dir, publish_dir, write_fsynced
from hybrid.serving._artifact import MANIFEST

__all__ = ["npy_bytes", "stored_array", "versions", "write_artifact"]


def versions() -> dict[str, str]:
    """The versions the manifest records (the loader reports them when a program will not load)."""
    import jaxlib

    try:
        ours = importlib.metadata.version("hybridrec")
    except importlib.metadata.PackageNotFoundError:
        ours = "unknown"
    return {
        "hybridrec": ours,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
    }


def npy_bytes(array: np.ndarray) -> bytes:
    """`array` as the bytes of a .npy file (no pickles)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def stored_array(array: np.ndarray) -> np.ndarray:
    """The array as its .npy holds it (bfloat16 as its uint16 bits: .npy has no bfloat16)."""
    return array.view(np.uint16) if array.dtype == jnp.bfloat16 else array


def write_artifact(
    path: pathlib.Path, files: dict[str, bytes], manifest: dict[str, Any], *, overwrite: bool
) -> None:
    """Write `files` and the manifest into a temporary directory beside `path`, rename it into place."""
    if path.exists() and not overwrite:
        raise FileExistsError(
            f"hybrid.export: {path} already exists; pass overwrite=True or choose another path"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    try:
        listed = {}
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            write_fsynced(tmp / name, data)
            listed[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        manifest = {**manifest, "files": listed}
        write_fsynced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())  # last
        fsync_dir(tmp / "tables")
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, path)
