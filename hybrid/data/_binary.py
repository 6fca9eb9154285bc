"""Criteo in a preprocessed binary form: fixed-width, memory-mappable shards (the stream's fast path).

A shard is a directory `<name>.criteo/` holding one source file's parsed samples:

- `labels.bin`: uint8 [N] (0 / 1);
- `dense.bin`: float32 [N, 13], already `log(1 + max(x, 0))` (missing -> 0), as `_criteo`;
- `ids.bin`: [N, 26] ids already hashed with the header's `num_embeddings` (0 = missing),
  int32 when every table has at most 2**31 rows, else int64 (a raw feature, size 0, keeps
  its 64-bit value; a missing one is the reserved 2**63 - 1, as `_criteo._parse`);
- `header.json` (written last: a shard without it is unfinished and refused): the format
  tag, the row count, `num_embeddings`, each array's file, dtype and shape, and where the
  rows came from (`source`: the file's name, size and SHA-256, or a generator's
  parameters), so a converter can skip a source already converted.

All arrays are little-endian, C order, no padding: `np.memmap(path, dtype, shape=...)`
maps them; `ShardReader.read(start, stop)` reads a block of rows with plain file reads
(a memory map's pages would count as the reader's resident memory as it goes).
`read_header` refuses a shard whose header is unreadable, of another format, or
disagrees with its array files' sizes, raising `CriteoBinaryError` (a `CriteoFormatError`)
that names the shard and what to do. `read_criteo_shards` reads shards whole (an eval set).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence

import numpy as np

from hybrid.data._criteo import _MISSING, NUM_DENSE, NUM_SPARSE, CriteoFormatError, _sizes

__all__ = [
    "BINARY_FORMAT",
    "CriteoBinaryError",
    "ShardReader",
    "ShardWriter",
    "is_shard",
    "read_criteo_shards",
    "read_header",
]

BINARY_FORMAT = "hybridrec.criteo_binary/1"
HEADER = "header.json"


class CriteoBinaryError(CriteoFormatError):
    """A binary Criteo shard that cannot be used (the message names the shard and the fix)."""


def is_shard(path: str | os.PathLike) -> bool:
    """Whether `path` is a binary shard directory (a `header.json` inside)."""
    return os.path.isfile(os.path.join(os.fspath(path), HEADER))


def ids_dtype(sizes: Sequence[int]) -> np.dtype:
    return np.dtype("<i4") if all(0 < s <= 2**31 for s in sizes) else np.dtype("<i8")


def _arrays(rows: int, sizes: Sequence[int]) -> dict:
    return {
        "labels": {"file": "labels.bin", "dtype": "<u1", "shape": [rows]},
        "dense": {"file": "dense.bin", "dtype": "<f4", "shape": [rows, NUM_DENSE]},
        "ids": {"file": "ids.bin", "dtype": ids_dtype(sizes).str, "shape": [rows, NUM_SPARSE]},
    }


def file_source(path: str | os.PathLike) -> dict:
    """A source file's identity for the header: name, size in bytes, SHA-256 of its bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return {
        "name": os.path.basename(os.fspath(path)),
        "bytes": os.path.getsize(path),
        "sha256": digest.hexdigest(),
    }


class ShardWriter:
    """Appends blocks of parsed samples to a new shard; `commit(source)` writes the header and
    moves the finished shard into place (a crash leaves only `<path>.partial`)."""

    def __init__(self, path: str | os.PathLike, num_embeddings: int | Sequence[int]):
        self.path = os.fspath(path)
        self.sizes = _sizes(num_embeddings)
        self._tmp = self.path + ".partial"
        shutil.rmtree(self._tmp, ignore_errors=True)
        os.makedirs(self._tmp)
        spec = _arrays(0, self.sizes)
        self._dtypes = {k: np.dtype(v["dtype"]) for k, v in spec.items()}
        self._files = {k: open(os.path.join(self._tmp, v["file"]), "wb") for k, v in spec.items()}
        self.rows = 0

    def append(self, labels: np.ndarray, dense: np.ndarray, ids: np.ndarray) -> None:
        """`labels [n]` (0/1), `dense [n, 13]`, `ids [n, 26]` (hashed with `num_embeddings`)."""
        n = len(labels)
        if dense.shape != (n, NUM_DENSE) or ids.shape != (n, NUM_SPARSE):
            raise ValueError(
                f"ShardWriter.append: dense {dense.shape} and ids {ids.shape} must be "
                f"[{n}, {NUM_DENSE}] and [{n}, {NUM_SPARSE}] for {n} labels"
            )
        for key, block in (("labels", labels), ("dense", dense), ("ids", ids)):
            self._files[key].write(np.ascontiguousarray(block, self._dtypes[key]).tobytes())
        self.rows += n

    def commit(self, source: dict) -> str:
        for f in self._files.values():
            f.close()
        header = {
            "format": BINARY_FORMAT,
            "rows": self.rows,
            "num_embeddings": list(self.sizes),
            "arrays": _arrays(self.rows, self.sizes),
            "source": source,
        }
        with open(os.path.join(self._tmp, HEADER), "w") as f:
            json.dump(header, f, indent=1)
        shutil.rmtree(self.path, ignore_errors=True)
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        for f in self._files.values():
            f.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


def read_header(path: str | os.PathLike) -> dict:
    """The shard's header, checked against its array files (sizes only, not the bytes)."""
    name = os.fspath(path)
    fix = "convert the source again (python -m hybrid.data.preprocess)"
    try:
        with open(os.path.join(name, HEADER)) as f:
            header = json.load(f)
    except FileNotFoundError:
        raise CriteoBinaryError(
            f"{name}: no {HEADER} (not a binary Criteo shard, or its conversion did not finish); {fix}"
        ) from None
    except (OSError, ValueError) as e:
        raise CriteoBinaryError(f"{name}: {HEADER} is damaged ({e}); {fix}") from None
    if not isinstance(header, dict) or header.get("format") != BINARY_FORMAT:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise CriteoBinaryError(
            f"{name}: {HEADER} has format {got!r}, expected {BINARY_FORMAT!r}; {fix}"
        )
    try:
        rows = header["rows"]
        sizes = _sizes(header["num_embeddings"])
        expect = _arrays(rows, sizes)
        if header["arrays"] != expect:
            raise ValueError(f"arrays {header['arrays']!r} do not match rows = {rows}: {expect!r}")
    except (KeyError, TypeError, ValueError) as e:
        raise CriteoBinaryError(f"{name}: {HEADER} is inconsistent ({e!s:.300}); {fix}") from None
    for spec in expect.values():
        file = os.path.join(name, spec["file"])
        want = int(np.prod(spec["shape"])) * np.dtype(spec["dtype"]).itemsize
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have != want:
            raise CriteoBinaryError(
                f"{name}: {spec['file']} holds {have if have is not None else 'no'} bytes, its header says "
                f"{rows} rows ({want} bytes): the shard is damaged or truncated; {fix}"
            )
    return header


class ShardReader:
    """Reads blocks of rows of one shard as `(labels f32 [n], dense f32 [n, 13], ids i64 [n, 26])`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.header = read_header(self.path)
        self.rows = self.header["rows"]
        self.sizes = tuple(self.header["num_embeddings"])
        self._specs = self.header["arrays"]
        self._files = {
            k: open(os.path.join(self.path, v["file"]), "rb") for k, v in self._specs.items()
        }

    def _read(self, key: str, start: int, stop: int) -> np.ndarray:
        spec = self._specs[key]
        dtype = np.dtype(spec["dtype"])
        width = int(np.prod(spec["shape"][1:]))
        f = self._files[key]
        f.seek(start * width * dtype.itemsize)
        out = np.fromfile(f, dtype, (stop - start) * width)
        if len(out) != (stop - start) * width:
            raise CriteoBinaryError(
                f"{self.path}: {spec['file']} ends before row {stop} (changed since it was opened)"
            )
        return out.reshape(stop - start, *spec["shape"][1:])

    def read(self, start: int, stop: int):
        return (
            self._read("labels", start, stop).astype(np.float32),
            self._read("dense", start, stop),
            self._read("ids", start, stop).astype(np.int64),
        )

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def id_matrix(chunk) -> np.ndarray:
    """A `ClickData` chunk of Criteo (bags of 0 or 1 id) as ids [n, 26] (missing: 0 for a
    hashed feature, the reserved 2**63 - 1 for a raw one)."""
    n = len(chunk.labels)
    ids = np.full((n, NUM_SPARSE), _MISSING, np.int64)
    for f in range(NUM_SPARSE):
        ids[chunk.lengths[f] == 1, f] = chunk.values[f]
    return ids


def read_criteo_shards(
    paths: str | os.PathLike | Sequence[str | os.PathLike], *, max_rows: int | None = None
):
    """Binary shards read whole as one `ClickData` (what `read_criteo_tsv` gives for their
    sources; `max_rows` at most)."""
    from hybrid.data._arrays import concat_rows
    from hybrid.data._criteo import _chunk

    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    chunks, left = [], max_rows
    for path in paths:
        reader = ShardReader(path)
        try:
            n = reader.rows if left is None else min(reader.rows, left)
            if n:
                labels, dense, ids = reader.read(0, n)
                chunks.append(_chunk(labels, dense, ids, reader.sizes))
        finally:
            reader.close()
        if left is not None:
            left -= n
            if left <= 0:
                break
    if not chunks:
        raise CriteoBinaryError(f"binary Criteo shards {paths!r} hold no samples")
    return concat_rows(chunks)
