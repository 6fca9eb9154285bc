"""sha256 of a file, read in 1 MiB blocks (checkpoints and cached data verify with it)."""

from __future__ import annotations

import hashlib
import os

__all__ = ["sha256_file"]


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
