"""Criteo display-ads TSV: `label, I1..I13, C1..C26`, tab-separated, plain or gzipped.

Each line: a 0/1 label, 13 integer counts (may be empty or negative), 26 categorical
values written as hex strings (may be empty). Dense features are `log(1 + max(x, 0))`
(missing -> 0). Categorical feature f has a table of `num_embeddings[f]` rows: id 0 means
missing, and a present value hashes to `1 + int(hex, 16) % (num_embeddings[f] - 1)`.
`num_embeddings[f] = 0` keeps feature f's raw ids instead (no vocabulary, no hashing, for
a managed-collision table): the hex value's 64 bits as an int64 (two's complement above
`2**63 - 1`; that one value is reserved and refused); a missing value is an empty bag (no
id: every 64-bit value is some hex string, so no id could stand for "missing").

Accepted field syntax (anything else is an error, never silently coerced):

- label: exactly `0` or `1`.
- integer feature: empty (missing) or ASCII decimal digits with an optional leading `-` or
  `+` (`[-+]?[0-9]+`); no spaces, underscores or non-ASCII digits.
- categorical feature: empty (missing) or 1 to 16 hex digits, lower- or uppercase
  (`[0-9a-fA-F]{1,16}`, at most 64 bits); no `0x` prefix, no sign, no spaces or
  underscores. The public Criteo 1TB / Kaggle files write 8 lowercase digits.

`iter_criteo_tsv` streams the files in chunks of `chunk_rows` samples (`ClickData` each);
`read_criteo_tsv` reads them whole. Every problem raises `CriteoFormatError` (a
`ValueError`) whose message starts `<file>, line <n>:` -- a malformed line (with the
column number and the offending value for a bad field), a missing file, a directory, a
file that cannot be read, an empty file (or one of blank lines only; reported at line 1 or
at the line after the last one), a truncated or corrupt `.gz` (at the line where the
compressed stream broke off). Raw `OSError` / `EOFError` / `gzip.BadGzipFile` never leak.
"""

from __future__ import annotations

import gzip
import math
import os
import re
import zlib
from collections.abc import Iterator, Sequence

import numpy as np

from hybrid.data._arrays import ClickData, concat_rows

__all__ = ["CriteoFormatError", "iter_criteo_tsv", "read_criteo_tsv"]

NUM_DENSE, NUM_SPARSE = 13, 26
CRITEO_KEYS = tuple(f"cat_{i}" for i in range(NUM_SPARSE))


class CriteoFormatError(ValueError):
    """A line of a Criteo TSV file that cannot be read (the message names file and line)."""


_HEX = re.compile(r"[0-9a-fA-F]{1,16}")
_INT = re.compile(r"[-+]?[0-9]+")
# what a damaged gzip stream raises while it is read (zlib.error: corrupt deflate data)
_READ_ERRORS = (OSError, EOFError, zlib.error)


def _open(path: str | os.PathLike):
    """The file as binary lines (gzip recognized by its magic bytes, not its name).

    Raises `CriteoFormatError` for a missing file, a directory or an unreadable file."""
    name = os.fspath(path)
    try:
        if os.path.isdir(name):
            raise IsADirectoryError(f"{name!r} is a directory")
        with open(name, "rb") as probe:
            magic = probe.read(2)
        return gzip.open(name, "rb") if magic == b"\x1f\x8b" else open(name, "rb")
    except FileNotFoundError:
        raise CriteoFormatError(f"{name}, line 1: no such file") from None
    except IsADirectoryError:
        raise CriteoFormatError(
            f"{name}, line 1: is a directory, not a Criteo TSV file (list the day files inside it)"
        ) from None
    except OSError as e:
        raise CriteoFormatError(f"{name}, line 1: cannot be opened ({e.strerror or e})") from None


def _lines(path: str | os.PathLike, f, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line), turning a read failure (truncated / corrupt gzip, I/O error)
    into `CriteoFormatError` at the line that could not be read. `start`: lines before the
    file's position (a reader that seeked into the file numbers on from there)."""
    name, lines, number = os.fspath(path), iter(f), start
    while True:
        try:
            raw = next(lines)
        except StopIteration:
            return
        except EOFError:
            raise CriteoFormatError(
                f"{name}, line {number + 1}: the gzip stream ends early (truncated .gz file; "
                f"{number} complete line(s) were read before it)"
            ) from None
        except _READ_ERRORS as e:
            kind = (
                "corrupt gzip data"
                if isinstance(e, gzip.BadGzipFile | zlib.error)
                else "read error"
            )
            raise CriteoFormatError(
                f"{name}, line {number + 1}: {kind} ({e}); {number} complete line(s) were read before it"
            ) from None
        number += 1
        yield number, raw


_INT64_MAX = (1 << 63) - 1
_MISSING = (
    _INT64_MAX  # a raw feature's missing value in `_parse` (refused as a value): an empty bag
)


def _sizes(num_embeddings: int | Sequence[int]) -> tuple[int, ...]:
    sizes = (
        (num_embeddings,) * NUM_SPARSE if isinstance(num_embeddings, int) else tuple(num_embeddings)
    )
    if len(sizes) != NUM_SPARSE or any(not isinstance(s, int) or (s < 2 and s != 0) for s in sizes):
        raise ValueError(
            f"Criteo num_embeddings must be an integer >= 2 (or 0: raw ids) or {NUM_SPARSE} of them, got "
            f"{num_embeddings!r}"
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
        elif _INT.fullmatch(text):
            dense.append(math.log1p(max(int(text), 0)))
        else:
            raise CriteoFormatError(
                f"{where}: integer feature I{i + 1} is {text!r} (column {i + 2}), not an integer "
                "(ASCII digits with an optional sign; leave it empty if missing)"
            )
    ids = []
    for i, text in enumerate(fields[1 + NUM_DENSE :]):
        if text == "":
            ids.append(0 if sizes[i] else _MISSING)
        elif _HEX.fullmatch(text):
            value = int(text, 16)
            if sizes[i]:
                ids.append(1 + value % (sizes[i] - 1))
            elif value == _INT64_MAX:
                raise CriteoFormatError(
                    f"{where}: categorical feature C{i + 1} is {text!r} (column {i + 2 + NUM_DENSE}): the raw id "
                    "2**63 - 1 is reserved (it marks an empty slot of a managed-collision table); give the feature "
                    "a hashed table (num_embeddings >= 2) instead"
                )
            else:
                ids.append(value - (1 << 64) if value > _INT64_MAX else value)
        else:
            raise CriteoFormatError(
                f"{where}: categorical feature C{i + 1} is {text!r} (column {i + 2 + NUM_DENSE}), "
                "not a hex string of 1-16 digits without prefix or sign (leave it empty if missing)"
            )
    return float(fields[0]), dense, ids


def _chunk(labels, dense, ids, sizes) -> ClickData:
    n = len(labels)
    id_matrix = np.array(ids, np.int64).reshape(n, NUM_SPARSE)
    present = (id_matrix != _MISSING) | (
        np.array(sizes) > 0
    )  # a raw feature's missing value: no id
    return ClickData(
        CRITEO_KEYS,
        np.array(dense, np.float32).reshape(n, NUM_DENSE),
        tuple(np.ascontiguousarray(id_matrix[present[:, f], f]) for f in range(NUM_SPARSE)),
        present.T.astype(np.int64),
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
        if max_rows is not None and total >= max_rows:
            break
        with _open(path) as f:
            samples, number = 0, 0
            for number, raw in _lines(path, f):
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
                samples += 1
                labels.append(label)
                dense.extend(d)
                ids.extend(i)
                total += 1
                if len(labels) == chunk_rows:
                    yield _chunk(labels, dense, ids, sizes)
                    labels, dense, ids = [], [], []
            if samples == 0 and (max_rows is None or total < max_rows):
                what = "the file is empty" if number == 0 else f"all {number} lines are blank"
                raise CriteoFormatError(
                    f"{os.fspath(path)}, line {number + 1}: no samples ({what})"
                )
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
