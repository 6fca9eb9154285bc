"""`CriteoStream`: Criteo TSV files read as a stream, per process, shuffled in a window, resumable.

Memory stays flat whatever the files' size: the stream holds one shuffle window of parsed
samples (~270 bytes each), a few read-ahead batches and one open file.

- Split over processes (deterministic, no counting pass): when the number of files is a
  multiple of `process_count`, process p reads files p, p + count, ... whole ("by file":
  each reads only its own bytes); otherwise every process scans every file and parses
  only its row blocks: block b (lines `b * block_rows + 1` ..) of file i belongs to
  process `(i + b) % process_count` ("by row blocks"). Either way all processes together
  see every row exactly once per epoch. An epoch is a pass over this process's share;
  `num_epochs=None` repeats forever (the training script stops at `train.steps`). The
  shuffle window runs across epoch boundaries (a share smaller than the window mixes
  several epochs in one window); every sample still comes once per epoch of the reader.
- Pipeline (grain 0.2.18 datasets): our line source (an `IterDataset` whose iterator state
  is `{epoch, file, offset, line, rows, samples}`: the byte offset of the next line in the
  file's (decompressed) stream, so a plain file is reopened with one seek; a `.gz` file
  is decompressed up to it) -> `WindowShuffleIterDataset` (grain: a window of
  `shuffle_window` samples in an order seeded by `seed` and the window's index; its state
  is the source state at the window's start plus the position in the window, so a
  restore re-reads that one window instead of storing it) -> `batch` (our collate:
  `ClickData.rows`, the form `BatchLoader.batch` gives) -> `ThreadPrefetchIterDataset`
  (grain: a background thread, a queue of `prefetch` batches, each batch carried with
  the state after it, so `state()` is the consumer's position, not the reader's).
- `state()` is that position as a small JSON-able dict (plus the settings it is only valid
  with); `restore(state)` makes a stream with the same settings yield exactly the
  batches the saved one would have yielded next.

Binary shards (`hybrid.data._binary`, the fast path) go through the same pipeline with
another source (`_RowsIterator`: blocks of rows read from the shard's arrays, state
`{epoch, file, row, samples}`), so they yield the TSV stream's batches exactly.

Errors are `CriteoFormatError` naming file and line, as `iter_criteo_tsv` raises them
(`CriteoBinaryError` for a shard, naming it).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Sequence

import grain
import numpy as np
from grain.experimental import ThreadPrefetchIterDataset, WindowShuffleIterDataset

from hybrid.data._binary import CriteoBinaryError, ShardReader, is_shard, read_header
from hybrid.data._criteo import (
    CRITEO_KEYS,
    NUM_DENSE,
    NUM_SPARSE,
    CriteoFormatError,
    _chunk,
    _lines,
    _open,
    _parse,
    _sizes,
)

__all__ = ["CriteoStream"]

_FORMAT = "hybridrec.criteo_stream/1"
# one parsed sample: label and dense features (float32), then the 26 ids (int64; a raw
# feature's missing value is the reserved 2**63 - 1, as in `_criteo._parse`)
_RECORD = np.dtype([("x", "<f4", (1 + NUM_DENSE,)), ("ids", "<i8", (NUM_SPARSE,))])


@dataclasses.dataclass(frozen=True)
class _Share:
    """Which lines of which files one process reads."""

    files: tuple[tuple[int, str], ...]  # (index in the full path list, path), in reading order
    whole_files: bool
    process_index: int
    process_count: int
    block_rows: int
    sizes: tuple[int, ...]
    num_epochs: int | None

    def owns(self, k: int, line: int) -> bool:
        if self.whole_files:
            return True
        block = (line - 1) // self.block_rows
        return (block + self.files[k][0]) % self.process_count == self.process_index


def _share(paths, process_index, process_count, block_rows, sizes, num_epochs) -> _Share:
    if not paths:
        raise ValueError("CriteoStream: no files given; list the Criteo TSV files (plain or .gz)")
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"CriteoStream: process_index={process_index} must lie in [0, process_count={process_count})"
        )
    if block_rows < 1:
        raise ValueError(f"CriteoStream: block_rows={block_rows} must be >= 1")
    indexed = tuple(enumerate(paths))
    whole = len(paths) % process_count == 0
    files = indexed[process_index::process_count] if whole else indexed
    return _Share(files, whole, process_index, process_count, block_rows, sizes, num_epochs)


def _record(raw: bytes, where: str, sizes: tuple[int, ...]) -> bytes:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CriteoFormatError(f"{where}: not UTF-8 text ({e})") from None
    label, dense, ids = _parse(line, where, sizes)
    return np.array([label, *dense], np.float32).tobytes() + np.array(ids, np.int64).tobytes()


class _ShareIterator(grain.DatasetIterator):
    """What both readers of a process's share hold alike: their position `_state` (a dict of
    ints, its keys fixed by each reader) as grain's checkpointable state, and the move to the
    next file, then to the next epoch after the last one. A subclass has `_close()`."""

    def _next_file_of_share(self, no_rows: Callable[[], Exception]) -> None:
        """Advance `_state` to the next file, or to the next epoch after the last file;
        raises `no_rows()` when a whole pass over the files gave this process no sample."""
        s, share = self._state, self._share
        s["file"] += 1
        if s["file"] == len(share.files):
            if s["samples"] == 0:
                raise no_rows()
            s.update(file=0, epoch=s["epoch"] + 1, samples=0)

    def get_state(self) -> dict:
        return dict(self._state)

    def set_state(self, state: dict) -> None:
        self._close()
        self._state = {k: int(state[k]) for k in self._state}

    def close(self) -> None:
        self._close()
        super().close()


class _LinesIterator(_ShareIterator):
    """This process's samples (packed `_RECORD` bytes), in file and line order."""

    def __init__(self, share: _Share):
        super().__init__()
        self._share = share
        self._state = {"epoch": 0, "file": 0, "offset": 0, "line": 0, "rows": 0, "samples": 0}
        self._file = None
        self._lines = None

    def _path(self) -> str:
        return os.fspath(self._share.files[self._state["file"]][1])

    def _open(self) -> None:
        path, s = self._path(), self._state
        self._file = _open(path)
        if s["offset"]:
            try:
                self._file.seek(s["offset"])
            except (OSError, EOFError) as e:  # a .gz seek decompresses up to the offset
                raise CriteoFormatError(
                    f"{path}, line {s['line'] + 1}: cannot resume at byte {s['offset']} ({e}); "
                    "the file changed since the stream position was saved"
                ) from None
        self._lines = _lines(path, self._file, start=s["line"])

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = self._lines = None

    def _next_file(self) -> None:
        s, share = self._state, self._share
        if s["rows"] == 0:
            what = "the file is empty" if s["line"] == 0 else f"all {s['line']} lines are blank"
            raise CriteoFormatError(f"{self._path()}, line {s['line'] + 1}: no samples ({what})")
        self._close()
        path, line = self._path(), s["line"]
        s.update(offset=0, line=0, rows=0)
        self._next_file_of_share(
            lambda: CriteoFormatError(
                f"{path}, line {line}: process {share.process_index} of {share.process_count} "
                f"gets no rows of the {len(share.files)} file(s) (blocks of {share.block_rows} "
                "lines are dealt to the processes in turn); lower block_rows or give more rows"
            )
        )

    def __next__(self) -> bytes:
        s, share = self._state, self._share
        while True:
            if share.num_epochs is not None and s["epoch"] >= share.num_epochs:
                raise StopIteration
            if self._lines is None:
                self._open()
            try:
                number, raw = next(self._lines)
            except StopIteration:
                self._next_file()
                continue
            s["offset"] += len(raw)
            s["line"] = number
            if not raw.strip():
                continue
            s["rows"] += 1
            if share.owns(s["file"], number):
                s["samples"] += 1
                return _record(raw, f"{self._path()}, line {number}", share.sizes)


class _RowsIterator(_ShareIterator):
    """This process's samples of binary shards (packed `_RECORD` bytes), in file and row
    order: the samples `_LinesIterator` gives for the TSV files they were converted from
    (row r stands for line r + 1: the same row blocks when the TSV has no blank lines).
    Reads `_CHUNK` rows at a time; its state is `{epoch, file, row, samples}`."""

    _CHUNK = 4096

    def __init__(self, share: _Share):
        super().__init__()
        self._share = share
        self._state = {"epoch": 0, "file": 0, "row": 0, "samples": 0}
        self._reader: ShardReader | None = None
        self._pending: tuple[bytes, list[int]] = (b"", [])
        self._next = 0

    def _close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader, self._pending, self._next = None, (b"", []), 0

    def _fill(self) -> bool:
        """Read the next chunk's owned samples; False at the end of the file."""
        s, share, reader = self._state, self._share, self._reader
        while s["row"] < reader.rows:
            start = s["row"]
            stop = min(start + self._CHUNK, reader.rows)
            rows = np.arange(start, stop)
            if not share.whole_files:
                block = rows // share.block_rows + share.files[s["file"]][0]
                rows = rows[block % share.process_count == share.process_index]
            if len(rows) == 0:
                s["row"] = stop
                continue
            labels, dense, ids = reader.read(int(rows[0]), int(rows[-1]) + 1)
            pick = rows - rows[0]
            rec = np.empty(len(rows), _RECORD)
            rec["x"][:, 0] = labels[pick]
            rec["x"][:, 1:] = dense[pick]
            rec["ids"] = ids[pick]
            self._pending, self._next = (rec.tobytes(), rows.tolist()), 0
            return True
        return False

    def _next_file(self) -> None:
        share = self._share
        path = self._reader.path
        self._close()
        self._state["row"] = 0
        self._next_file_of_share(
            lambda: CriteoBinaryError(
                f"{path}: process {share.process_index} of {share.process_count} gets no rows of the "
                f"{len(share.files)} shard(s) (blocks of {share.block_rows} rows are dealt to the "
                "processes in turn); lower block_rows or give more rows"
            )
        )

    def __next__(self) -> bytes:
        s, share = self._state, self._share
        while True:
            if share.num_epochs is not None and s["epoch"] >= share.num_epochs:
                raise StopIteration
            if self._reader is None:
                self._reader = ShardReader(share.files[s["file"]][1])
                if self._reader.rows == 0:
                    raise CriteoBinaryError(f"{self._reader.path}: no samples (0 rows)")
            data, rows = self._pending
            if self._next == len(rows):
                if not self._fill():
                    self._next_file()
                continue
            i = self._next
            self._next += 1
            s["row"] = rows[i] + 1
            s["samples"] += 1
            return data[i * _RECORD.itemsize : (i + 1) * _RECORD.itemsize]


class _Lines(grain.IterDataset):
    def __init__(self, share: _Share, binary: bool = False):
        super().__init__()
        self._share = share
        self._binary = binary
        self.reader: _LinesIterator | _RowsIterator | None = None  # the newest (for `progress`)

    def __iter__(self) -> _LinesIterator | _RowsIterator:
        self.reader = (_RowsIterator if self._binary else _LinesIterator)(self._share)
        return self.reader


def _binary_paths(paths) -> bool:
    """Whether the paths are binary shards (all) rather than TSV files (all)."""
    kinds = {is_shard(p) for p in paths}
    if len(kinds) > 1:
        raise ValueError(
            "CriteoStream: the paths mix binary shards (<name>.criteo directories) and TSV files; "
            "convert the TSV files too (python -m hybrid.data.preprocess) or list only one kind"
        )
    return kinds == {True}


class CriteoStream:
    """Batches `(dense [B, 13], (keys, values, lengths), labels [B])` of this process's share
    of Criteo TSV files (plain or gzipped), with `B = batch_size` (this process's part of a
    global batch), read ahead on a background thread and shuffled within a window.

    `paths` may instead all be binary shards (`python -m hybrid.data.preprocess`): the
    same samples read far faster, the same batches for the same settings (their ids were
    hashed when converted: `num_embeddings` must match their header's, and defaults to it).
    `num_embeddings` as in `read_criteo_tsv` (one size, or 26; 0 = raw 64-bit ids;
    default 100,000 for TSV files).
    `shuffle_window` samples are shuffled together (1 = file order); `seed` picks the
    order. `num_epochs=None` repeats the share forever; with a number the last batch may
    be short unless `drop_remainder`. `block_rows`: the row-block split's unit (see the
    module doc). `prefetch`: batches read ahead. The schema properties (`keys`,
    `num_embeddings`, `raw_keys`, `num_dense`, `max_lengths()`) match `ClickData`'s.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        batch_size: int,
        *,
        process_index: int = 0,
        process_count: int = 1,
        num_embeddings: int | Sequence[int] | None = None,
        shuffle_window: int = 65_536,
        seed: int = 0,
        num_epochs: int | None = None,
        block_rows: int = 8192,
        prefetch: int = 4,
        drop_remainder: bool = False,
    ):
        paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
        if batch_size < 1 or shuffle_window < 1 or prefetch < 0:
            raise ValueError(
                f"CriteoStream: batch_size={batch_size} and shuffle_window={shuffle_window} must be >= 1, "
                f"prefetch={prefetch} >= 0"
            )
        binary = _binary_paths(paths)
        if binary:
            headers = [read_header(p) for p in paths]
            shard_sizes = tuple(headers[0]["num_embeddings"])
            if num_embeddings is None:
                num_embeddings = shard_sizes
            for p, h in zip(paths, headers, strict=True):
                if tuple(h["num_embeddings"]) != _sizes(num_embeddings):
                    raise CriteoBinaryError(
                        f"{os.fspath(p)}: its ids were hashed with num_embeddings = {h['num_embeddings']}, "
                        f"this stream asks for {list(_sizes(num_embeddings))}; convert the source again "
                        "with these sizes (python -m hybrid.data.preprocess --num-embeddings ...)"
                    )
        self.num_embeddings = _sizes(100_000 if num_embeddings is None else num_embeddings)
        self._share = _share(
            [os.fspath(p) for p in paths],
            process_index,
            process_count,
            block_rows,
            self.num_embeddings,
            num_epochs,
        )
        self._settings = {
            "files": [os.path.basename(os.fspath(p)) for p in paths],
            "process": [process_index, process_count],
            "batch_size": batch_size,
            "shuffle_window": shuffle_window,
            "seed": seed,
            "block_rows": block_rows,
        }
        if binary:  # a TSV position does not apply to shards (nor back)
            self._settings["source"] = "criteo_binary"
        ds = self._lines = _Lines(self._share, binary)
        if shuffle_window > 1:
            ds = WindowShuffleIterDataset(ds, window_size=shuffle_window, seed=seed)
        ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=self._collate)
        ds = ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
        self._it = iter(ds)

    # -- the ClickData schema (what the training script builds tables and towers from) -----
    keys = CRITEO_KEYS
    num_dense = NUM_DENSE

    @property
    def raw_keys(self) -> tuple[str, ...]:
        return tuple(k for k, n in zip(self.keys, self.num_embeddings, strict=True) if n == 0)

    def max_lengths(self) -> tuple[int, ...]:
        """Criteo bags hold at most one id (a hashed feature always one)."""
        return (1,) * NUM_SPARSE

    # -- iteration -------------------------------------------------------------------------
    def _collate(self, samples: Sequence[bytes]):
        rec = np.frombuffer(b"".join(samples), _RECORD)
        data = _chunk(rec["x"][:, 0], rec["x"][:, 1:], rec["ids"], self.num_embeddings)
        return data.rows(np.arange(len(data)))

    def __iter__(self) -> CriteoStream:
        return self

    def __next__(self):
        return next(self._it)

    def close(self) -> None:
        """Stop the read-ahead thread and close the open file."""
        self._it.close()

    # -- position --------------------------------------------------------------------------
    def state(self) -> dict:
        """The position after the last batch handed out, as a small JSON-able dict."""
        return {
            "format": _FORMAT,
            **copy.deepcopy(self._settings),
            "position": copy.deepcopy(self._it.get_state()),
        }

    def restore(self, state: dict) -> None:
        """Continue from `state()` of a stream with the same files and settings."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(
                f"CriteoStream.restore: not a stream position ({_FORMAT}): {state!r:.200}"
            )
        kind = {"source": "tsv"}  # a TSV stream's position has no "source" (it predates shards)
        for key, mine in {**kind, **self._settings}.items():
            if state.get(key, kind.get(key)) != mine:
                raise ValueError(
                    f"CriteoStream.restore: the position was saved with {key} = {state.get(key)!r}, this "
                    f"stream has {mine!r}; a position is exact only with the files and settings it was "
                    "saved with"
                )
        self._it.set_state(copy.deepcopy(state["position"]))

    def progress(self) -> dict:
        """Where the reader stands, for a log line: epoch, samples of this process read in it,
        the file (the reader runs ahead of the batches handed out by up to a shuffle window
        and the read-ahead queue; `state()` is the exact position)."""
        source = dict(self._lines.reader.get_state())  # read from another thread: a snapshot
        path = self._share.files[min(source["file"], len(self._share.files) - 1)][1]
        return {
            "epoch": source["epoch"],
            "samples_in_epoch": source["samples"],
            "file": os.path.basename(path),
            "files": len(self._share.files),
        }
