"""`python -m hybrid.data.preprocess`: Criteo TSV / .gz files -> binary shards, once.

    python -m hybrid.data.preprocess day_0.gz day_1.gz --out data_cache/criteo_bin --num-embeddings 100000

Each source file becomes `<out>/<name>.criteo/` (see `hybrid.data._binary`), its ids hashed
with `--num-embeddings` (one size, 26 comma-separated sizes, 0 = raw ids), read in chunks
(memory flat whatever the file's size). A shard whose header already records the same
source bytes (SHA-256) and sizes is kept, not converted again. Give the shards to
`hybrid.data.CriteoStream` (or `data.paths` with `--stream`) in place of the TSV files:
with the same sizes, seed and settings they yield the same batches, far faster.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from hybrid.data._binary import (
    CriteoBinaryError,
    ShardWriter,
    file_source,
    id_matrix,
    is_shard,
    read_header,
)
from hybrid.data._criteo import CriteoFormatError, _sizes, iter_criteo_tsv

__all__ = ["convert_criteo_tsv", "main", "shard_name"]


def shard_name(path: str | os.PathLike) -> str:
    """`day_0.gz` / `day_0.tsv` -> `day_0.criteo`."""
    name = os.path.basename(os.fspath(path))
    for suffix in (".gz", ".tsv", ".txt"):
        name = name.removesuffix(suffix)
    return name + ".criteo"


def convert_criteo_tsv(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    num_embeddings: int | Sequence[int] = 100_000,
    chunk_rows: int = 65_536,
) -> tuple[str, bool]:
    """Convert one TSV file; returns (the shard's path, whether it was written now)."""
    sizes = _sizes(num_embeddings)
    out = os.path.join(os.fspath(out_dir), shard_name(path))
    source = file_source(path) if os.path.isfile(path) else None
    if source and is_shard(out):
        try:
            header = read_header(out)
            if header["source"] == source and tuple(header["num_embeddings"]) == sizes:
                return out, False
        except CriteoBinaryError:
            pass  # damaged: written again
    os.makedirs(out_dir, exist_ok=True)
    writer = ShardWriter(out, sizes)
    try:
        for chunk in iter_criteo_tsv(path, num_embeddings=sizes, chunk_rows=chunk_rows):
            writer.append(chunk.labels, chunk.dense, id_matrix(chunk))
    except BaseException:
        writer.abort()
        raise
    return writer.commit(source), True


def _parse_sizes(text: str) -> int | list[int]:
    parts = [int(x) for x in text.split(",")]
    return parts[0] if len(parts) == 1 else parts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybrid.data.preprocess", description=__doc__.split("\n")[0]
    )
    parser.add_argument("paths", nargs="+", help="Criteo TSV files (plain or .gz)")
    parser.add_argument("--out", required=True, help="directory for the <name>.criteo shards")
    parser.add_argument(
        "--num-embeddings",
        default="100000",
        help="rows per table: one size or 26 comma-separated (0 = raw 64-bit ids); default 100000",
    )
    args = parser.parse_args(argv)
    try:
        sizes = _sizes(_parse_sizes(args.num_embeddings))
        for path in args.paths:
            shard, written = convert_criteo_tsv(path, args.out, num_embeddings=sizes)
            rows = read_header(shard)["rows"]
            print(f"{path} -> {shard}: {rows} rows{'' if written else ' (up to date, kept)'}")
    except (CriteoFormatError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
