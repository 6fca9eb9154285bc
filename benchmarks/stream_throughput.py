"""`CriteoStream` read throughput: Criteo TSV parsing vs the binary shards it converts to.

    python -m benchmarks.stream_throughput [--rows 200000] [--out DIR | --update-results]

Writes `--rows` Criteo-format TSV lines (random labels, counts with 10% missing, 8-digit
hex categories), converts them once (`hybrid.data.preprocess`, timed), then reads both
through `CriteoStream` with the same settings (batch 2048, shuffle window 65,536, one
epoch) and reports rows/s of each and their ratio, after checking the two streams yield
the same first batches. The two reads run one after the other in this process; the
quietness probe (`benchmarks.e2e_step`) runs before and after, and a contended run is
marked void.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import numpy as np

from benchmarks import report

__all__ = ["main", "run"]


def write_tsv(path: pathlib.Path, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for start in range(0, rows, 50_000):
            m = min(50_000, rows - start)
            ints = rng.integers(0, 1000, (m, 13)).astype(str)
            ints[rng.random((m, 13)) < 0.1] = ""
            cats = np.char.mod("%08x", rng.integers(0, 2**32, (m, 26)))
            table = np.column_stack([rng.integers(0, 2, m).astype(str), ints, cats])
            f.write("\n".join("\t".join(r) for r in table.tolist()) + "\n")


def _read(paths, batch: int) -> tuple[float, list]:
    from hybrid.data import CriteoStream

    stream = CriteoStream(paths, batch, num_embeddings=100_000, num_epochs=1, seed=0)
    t0, rows, head = time.perf_counter(), 0, []
    for b in stream:
        rows += b[2].shape[0]
        if len(head) < 3:
            head.append(b)
    seconds = time.perf_counter() - t0
    stream.close()
    return rows / seconds, head


def run(rows: int, tiny: bool = False) -> dict:
    from benchmarks.e2e_step import quietness_probe
    from hybrid.data import convert_criteo_tsv

    probe = quietness_probe if not tiny else (lambda: {"quiet": False, "ratio_2_over_1": None})
    before = probe()
    with tempfile.TemporaryDirectory() as tmp:
        tsv = pathlib.Path(tmp) / "day_0.tsv"
        write_tsv(tsv, rows)
        t0 = time.perf_counter()
        shard, _ = convert_criteo_tsv(tsv, pathlib.Path(tmp) / "bin", num_embeddings=100_000)
        convert_s = time.perf_counter() - t0
        tsv_rate, tsv_head = _read([tsv], 2048)
        bin_rate, bin_head = _read([shard], 2048)
    for a, b in zip(tsv_head, bin_head, strict=True):
        assert all(
            x.numpy().tobytes() == y.numpy().tobytes()
            for x, y in ((a[0], b[0]), (a[1][1], b[1][1]), (a[2], b[2]))
        ), "the binary stream's batches differ from the TSV stream's"
    after = probe()
    return {
        "rows": rows,
        "tsv_rows_per_s": tsv_rate,
        "binary_rows_per_s": bin_rate,
        "binary_over_tsv": bin_rate / tsv_rate,
        "convert_rows_per_s": rows / convert_s,
        "quiet": bool(before["quiet"] and after["quiet"]),
        "probe_ratio_2_over_1": [before["ratio_2_over_1"], after["ratio_2_over_1"]],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--tiny", action="store_true", help="5,000 rows, no probe (smoke)")
    report.add_output_args(parser, "stream_throughput")
    args = parser.parse_args(argv)
    out = pathlib.Path(report.output_dir(parser, args, "stream_throughput"))
    out.mkdir(parents=True, exist_ok=True)
    result = run(5000 if args.tiny else args.rows, args.tiny)
    (out / "stream_throughput.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
