"""`python -m benchmarks.criteo_scale`: its data set (deterministic, cached, Kaggle-shaped,
read by the stream) and its `--tiny` run end to end (2 training processes; the resume and
the TorchRec side are left to the benchmark's own runs, they cost a minute more); and
`benchmarks.stream_throughput --tiny` (its TSV and binary batches compared equal)."""

import json

import numpy as np
import pytest

from benchmarks import criteo_scale
from hybrid.data import CriteoStream, read_header


def test_kaggle_tables_and_generated_shards(tmp_path):
    assert len(criteo_scale.KAGGLE_CARDINALITIES) == 26
    assert sum(criteo_scale.KAGGLE_CARDINALITIES) == 33_762_577  # ~34M rows at dim 16
    sizes = criteo_scale.table_sizes(tiny=True)
    first = criteo_scale.generate(tmp_path / "a", 3000, sizes, seed=1)
    again = criteo_scale.generate(tmp_path / "a", 3000, sizes, seed=1)
    other = criteo_scale.generate(tmp_path / "b", 3000, sizes, seed=1)
    assert not first["cached"] and again["cached"] and again["paths"] == first["paths"]
    for a, b in zip(first["paths"], other["paths"], strict=True):  # deterministic bytes
        for name in ("labels.bin", "dense.bin", "ids.bin"):
            assert (tmp_path / "a" / a.split("/a/")[1] / name).read_bytes() == (
                tmp_path / "b" / b.split("/b/")[1] / name
            ).read_bytes()
    assert [read_header(p)["rows"] for p in first["paths"]] == [1500, 1500, 256]
    stream = CriteoStream(first["paths"][:2], 500, num_epochs=1, process_index=1, process_count=2)
    ids = np.concatenate([b[1][1].numpy().reshape(26, -1).T for b in stream])  # feature-major
    assert len(ids) == 1500 and stream.num_embeddings == sizes
    assert (ids < np.array(sizes)).all() and (ids >= 0).all()
    top = np.bincount(ids[:, 2]).max() / len(ids)  # Zipf-like: one id is far above uniform
    assert top > 5 / sizes[2]


@pytest.mark.multiprocess
def test_tiny_run_writes_its_tables(tmp_path):
    criteo_scale.main(
        [
            "--tiny",
            "--no-torchrec",
            "--no-resume",
            "--out",
            str(tmp_path),
            "--data-dir",
            str(tmp_path / "data"),
        ]
    )
    result = json.loads((tmp_path / "criteo_scale_tiny.json").read_text())
    ours = result["ours"]
    assert ours["samples_per_s"] > 0 and len(ours["peak_rss_mib"]) == 2
    assert len(ours["checkpoint_save_s"]) == 2 and ours["checkpoint_bytes"] > 0
    text = (tmp_path / "criteo_scale_tiny.md").read_text()
    assert "| samples/s |" in text and "not run (--no-resume)" in text


def test_stream_throughput_tiny_compares_equal_batches(tmp_path):
    from benchmarks import stream_throughput

    stream_throughput.main(["--tiny", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "stream_throughput.json").read_text())
    assert (
        result["rows"] == 5000 and result["tsv_rows_per_s"] > 0 and result["binary_rows_per_s"] > 0
    )
    assert result["quiet"] is False  # --tiny runs no probe: never reported as quiet
