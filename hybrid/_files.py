"""Files that survive a crash: fsynced writes, atomic replacement, sha256 of a file
(checkpoints and the cached data verify and write through these)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import uuid

__all__ = ["fsync_dir", "publish_dir", "sha256_file", "write_atomic", "write_fsynced"]


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_fsynced(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """`path` holds the old content or the new, never a part (readers and concurrent
    writers included): a hidden `.tmp-*` file, fsynced, renamed over it, the rename fsynced."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        write_fsynced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def publish_dir(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Rename the fully written directory `tmp` to `final`. An existing `final` is moved aside
    first and deleted only once the new one is in place; if the rename fails, `tmp` is removed
    and the old `final` put back."""
    old = None
    try:
        if final.exists():
            old = final.parent / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final.exists():
            os.rename(old, final)
            old = None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
