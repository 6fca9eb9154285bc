"""Click data for `python -m hybrid.train`: in-memory tables, loaders and three sources.

- `ClickData`: dense features, jagged sparse features, labels; `rows(idx)` gives a batch
  `(dense, (keys, values, lengths), labels)` that `hybrid.Model` accepts.
- `BatchLoader` (training batches addressed by step, seeded shuffle per epoch) and
  `eval_batches` (in order, last batch padded to full size).
- `load_movielens()`: real MovieLens-100K as a click task, time split (cached).
- `read_criteo_tsv(paths, ...)` / `iter_criteo_tsv`: Criteo TSV files, plain or gzipped.
- `CriteoStream(paths, batch_size, process_index=, process_count=, ...)`: the same files as
  a stream of batches, this process's share only, shuffled in a window, read ahead on a
  thread, its position a JSON-able `state()` / `restore(state)` (needs `grain`: the
  `stream` extra; imported on first use); it reads binary shards too, the fast path.
- `python -m hybrid.data.preprocess` / `convert_criteo_tsv`: TSV -> binary shards
  (`<name>.criteo/`: fixed-width arrays + a JSON header; `CriteoBinaryError` if damaged).
- `synthetic_clicks(n, ...)`: Criteo-shaped data with a planted signal and Zipf ids
  (the draw itself, `planted_signal_data`, is in `_planted`; `python -m hybrid.demo` uses it).
"""

from hybrid.data._arrays import ClickData, concat_rows
from hybrid.data._binary import (
    CriteoBinaryError,
    ShardReader,
    ShardWriter,
    read_criteo_shards,
    read_header,
)
from hybrid.data._criteo import CriteoFormatError, iter_criteo_tsv, read_criteo_tsv
from hybrid.data._loader import BatchLoader, eval_batches
from hybrid.data._movielens import MOVIELENS_FEATURES, data_cache_dir, load_movielens
from hybrid.data._synthetic import synthetic_clicks

__all__ = [
    "MOVIELENS_FEATURES",
    "BatchLoader",
    "ClickData",
    "CriteoStream",
    "CriteoBinaryError",
    "CriteoFormatError",
    "ShardReader",
    "ShardWriter",
    "convert_criteo_tsv",
    "read_header",
    "concat_rows",
    "data_cache_dir",
    "eval_batches",
    "iter_criteo_tsv",
    "load_movielens",
    "read_criteo_shards",
    "read_criteo_tsv",
    "synthetic_clicks",
]


def __getattr__(name: str):
    if name == "CriteoStream":  # grain is imported only by a streamed run
        from hybrid.data._stream import CriteoStream

        return CriteoStream
    if name == "convert_criteo_tsv":
        from hybrid.data.preprocess import convert_criteo_tsv

        return convert_criteo_tsv
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
