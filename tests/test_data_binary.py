"""Binary Criteo shards (hybrid.data.preprocess): the same batches as the TSV stream, exact
resume, damaged or mismatched shards refused by name."""

import json

import numpy as np
import pytest

from hybrid.data import CriteoBinaryError, CriteoStream, convert_criteo_tsv, read_header
from hybrid.data.preprocess import main as preprocess_main
from tests.test_data_stream import SIZES, assert_same_batches, drain, write_criteo


def _files(tmp_path, n=3):
    tsv = [
        write_criteo(
            tmp_path / f"day_{i}.tsv{'.gz' if i == 1 else ''}", 90 + 31 * i, first=1000 * i, seed=i
        )
        for i in range(n)
    ]
    shards = [convert_criteo_tsv(p, tmp_path / "bin", num_embeddings=SIZES)[0] for p in tsv]
    return tsv, shards


@pytest.mark.parametrize("process", [(0, 1), (1, 2)])  # one process; row blocks over 2
def test_binary_stream_yields_the_tsv_streams_batches(tmp_path, process):
    tsv, shards = _files(tmp_path)
    settings = dict(
        num_embeddings=SIZES,
        num_epochs=2,
        shuffle_window=40,
        seed=7,
        block_rows=9,
        process_index=process[0],
        process_count=process[1],
    )
    assert_same_batches(
        drain(CriteoStream(shards, 16, **settings)), drain(CriteoStream(tsv, 16, **settings))
    )


@pytest.mark.parametrize("cut", [1, 7, 16])  # first window; second window; second epoch
def test_binary_stream_resumes_exactly(tmp_path, cut):
    _, shards = _files(tmp_path, 2)
    settings = dict(
        num_epochs=2, shuffle_window=50, seed=2, block_rows=5, process_index=1, process_count=2
    )
    stream = CriteoStream(shards, 8, **settings)  # sizes from the header
    assert stream.num_embeddings == tuple(SIZES)
    for _ in range(cut):
        next(stream)
    state = json.loads(json.dumps(stream.state()))
    rest = drain(stream)
    resumed = CriteoStream(shards, 8, **settings)
    resumed.restore(state)
    assert_same_batches(drain(resumed), rest)


def test_damaged_or_mismatched_shards_are_refused_by_name(tmp_path):
    tsv, shards = _files(tmp_path, 2)
    with pytest.raises(
        CriteoBinaryError, match=r"day_0\.criteo: its ids were hashed with num_embeddings"
    ):
        CriteoStream(shards, 8, num_embeddings=1000)
    with pytest.raises(ValueError, match=r"mix binary shards .* and TSV files"):
        CriteoStream([shards[0], tsv[1]], 8)
    with pytest.raises(
        ValueError, match=r"saved with source = 'criteo_binary', this stream has 'tsv'"
    ):
        CriteoStream(tsv, 8, num_embeddings=SIZES).restore(
            {**CriteoStream(shards, 8).state(), "files": [t.name for t in tsv]}
        )
    ids = tmp_path / "bin" / "day_1.criteo" / "ids.bin"
    ids.write_bytes(ids.read_bytes()[:-4])  # truncated
    with pytest.raises(
        CriteoBinaryError,
        match=r"day_1\.criteo: ids\.bin holds \d+ bytes, its header says 121 rows",
    ):
        CriteoStream(shards, 8)
    header = tmp_path / "bin" / "day_0.criteo" / "header.json"
    header.write_text(header.read_text()[:40])
    with pytest.raises(CriteoBinaryError, match=r"day_0\.criteo: header\.json is damaged"):
        read_header(shards[0])
    header.write_text(json.dumps({"format": "other/2"}))
    with pytest.raises(
        CriteoBinaryError, match=r"format 'other/2', expected 'hybridrec\.criteo_binary/1'"
    ):
        read_header(shards[0])


def test_preprocess_cli_keeps_an_up_to_date_shard_and_redoes_a_changed_one(tmp_path, capsys):
    path = write_criteo(tmp_path / "day_0.tsv", 30)
    args = [
        str(path),
        "--out",
        str(tmp_path / "bin"),
        "--num-embeddings",
        "0," + ",".join(["1000"] * 25),
    ]
    assert preprocess_main(args) == 0 and preprocess_main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("30 rows") and out[1].endswith("30 rows (up to date, kept)")
    header = read_header(tmp_path / "bin" / "day_0.criteo")
    assert header["source"]["name"] == "day_0.tsv" and len(header["source"]["sha256"]) == 64
    assert header["arrays"]["ids"]["dtype"] == "<i8"  # a raw feature: 64-bit ids
    write_criteo(path, 20, seed=5)
    assert preprocess_main(args) == 0
    assert capsys.readouterr().out.strip().endswith("20 rows")
    ids = np.fromfile(tmp_path / "bin" / "day_0.criteo" / "ids.bin", "<i8").reshape(20, 26)
    assert ids[:, 0].tolist() == list(range(20))
