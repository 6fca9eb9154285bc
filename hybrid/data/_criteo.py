"""Criteo display-ads TSV: `label, I1..I13, C1..C26`, tab-separated, plain or gzipped.

Each line: a 0/1 label, 13 integer counts (may be empty or negative), 26 categorical
values written as hex strings (may be empty). Dense features are `log(1 + max(x, 0))`
(missing -> 0). Categorical feature f has a table of `num_embeddings[f]` rows: id 0 means
missing, and a present value hashes to `1 + int(hex, 16) % (num_embeddings[f] - 1)`.

`iter_criteo_tsv` streams the files in chunks of `chunk_rows` samples (`ClickData` each);
`read_criteo_tsv` reads them whole. A malformed line raises `CriteoFormatError` naming the
file, the line number and what is wrong.
"""

from __future__ import annotations

import gzip
import math
import os
from collections.abc import Iterator, Sequence

import numpy as np

from hybrid.data._arrays import ClickData, concat_rows

__all__ = ["CriteoFormatError", "iter_criteo_tsv", "read_criteo_tsv"]

NUM_DENSE, NUM_SPARSE = 13, 26
CRITEO_KEYS = tuple(f"cat_{i}" for i in range(NUM_SPARSE))


class CriteoFormatError(ValueError):
    """A line of a Criteo TSV file that cannot be read (the message names file and line)."""


def _open(path: str | os.PathLike):
    """The file as binary lines (gzip recognized by its magic bytes, not its name)."""
    path = os.fspath(path)
    with open(path, "rb") as probe:
        magic = probe.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def _sizes(num_embeddings: int | Sequence[int]) -> tuple[int, ...]:
    sizes = (
        (num_embeddings,) * NUM_SPARSE if isinstance(num_embeddings, int) else tuple(num_embeddings)
    )
    if len(sizes) != NUM_SPARSE or any(not isinstance(s, int) or s < 2 for s in sizes):
        raise ValueError(
            f"Criteo num_embeddings must be an integer >= 2 or {NUM_SPARSE} of them, got {num_embeddings!r}"
        )
    return sizes


def _parse(line: str, where: str, sizes: tuple[int, ...]):
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != 1 + NUM_DENSE + NUM_SPARSE:
        raise CriteoFormatError(
            f"{where}: {len(fields)} tab-separated fields, expected {1 + NUM_DENSE + NUM_SPARSE} "
            f"(label, {NUM_DENSE} integers, {NUM_SPARSE} hex categories; empty fields are allowed)"
        )
    if fields[0] not in ("0", "1"):
        raise CriteoFormatError(f"{where}: label {fields[0]!r} must be 0 or 1")
    dense = []
    for i, text in enumerate(fields[1 : 1 + NUM_DENSE]):
        if text == "":
            dense.append(0.0)
            continue
        try:
            dense.append(math.log1p(max(int(text), 0)))
        except ValueError:
            raise CriteoFormatError(
                f"{where}: integer feature I{i + 1} is {text!r}, not an integer (leave it empty if missing)"
            ) from None
    ids = []
    for i, text in enumerate(fields[1 + NUM_DENSE :]):
        if text == "":
            ids.append(0)
            continue
        try:
            ids.append(1 + int(text, 16) % (sizes[i] - 1))
        except ValueError:
            raise CriteoFormatError(
                f"{where}: categorical feature C{i + 1} is {text!r}, not a hex string"
            ) from None
    return float(fields[0]), dense, ids


def _chunk(labels, dense, ids, sizes) -> ClickData:
    n = len(labels)
    id_matrix = np.array(ids, np.int64).reshape(n, NUM_SPARSE)
    return ClickData(
        CRITEO_KEYS,
        np.array(dense, np.float32).reshape(n, NUM_DENSE),
        tuple(np.ascontiguousarray(id_matrix[:, f]) for f in range(NUM_SPARSE)),
        np.ones((NUM_SPARSE, n), np.int64),
        np.array(labels, np.float32),
        sizes,
    )


def iter_criteo_tsv(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    num_embeddings: int | Sequence[int] = 100_000,
    chunk_rows: int = 65_536,
    max_rows: int | None = None,
) -> Iterator[ClickData]:
    """Stream the files (in order) as `ClickData` chunks of up to `chunk_rows` samples."""
    sizes = _sizes(num_embeddings)
    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    labels, dense, ids, total = [], [], [], 0
    for path in paths:
        with _open(path) as f:
            for number, raw in enumerate(f, start=1):
                if max_rows is not None and total >= max_rows:
                    break
                where = f"{os.fspath(path)}, line {number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise CriteoFormatError(f"{where}: not UTF-8 text ({e})") from None
                if not line.strip():
                    continue
                label, d, i = _parse(line, where, sizes)
                labels.append(label)
                dense.extend(d)
                ids.extend(i)
                total += 1
                if len(labels) == chunk_rows:
                    yield _chunk(labels, dense, ids, sizes)
                    labels, dense, ids = [], [], []
    if labels:
        yield _chunk(labels, dense, ids, sizes)


def read_criteo_tsv(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    num_embeddings: int | Sequence[int] = 100_000,
    max_rows: int | None = None,
) -> ClickData:
    """All samples of the files as one `ClickData` (see `iter_criteo_tsv`)."""
    chunks = list(iter_criteo_tsv(paths, num_embeddings=num_embeddings, max_rows=max_rows))
    if not chunks:
        raise ValueError(f"Criteo files {paths!r} hold no samples")
    return concat_rows(chunks)
