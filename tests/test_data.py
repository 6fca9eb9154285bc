"""hybrid.data: ClickData batches, the step-addressed loader, Criteo TSV, synthetic, MovieLens."""

import gzip
import math

import numpy as np
import pytest

from hybrid.data import (
    BatchLoader,
    ClickData,
    CriteoFormatError,
    eval_batches,
    iter_criteo_tsv,
    read_criteo_tsv,
    synthetic_clicks,
)
from hybrid.data._criteo import CRITEO_KEYS


def _tiny():
    return ClickData(
        ("a", "b"),
        np.arange(8, dtype=np.float32).reshape(4, 2),
        (np.array([1, 2, 3, 4, 5], np.int64), np.array([7, 8, 9, 6], np.int64)),
        np.array([[1, 2, 0, 2], [1, 1, 1, 1]], np.int64),
        np.array([0, 1, 0, 1], np.float32),
        (10, 10),
    )


def test_rows_gathers_jagged_bags_key_major():
    dense, (keys, values, lengths), labels = _tiny().rows(np.array([3, 1]))
    assert keys == ["a", "b"]
    assert values.tolist() == [4, 5, 2, 3, 6, 8]
    assert lengths.tolist() == [2, 2, 1, 1]
    assert dense.tolist() == [[6.0, 7.0], [2.0, 3.0]] and labels.tolist() == [1.0, 1.0]


def test_loader_is_a_function_of_seed_and_step():
    data = synthetic_clicks(100, num_sparse=2, num_dense=3, num_embeddings=50, seed=1)
    a, b = BatchLoader(data, 16, seed=3), BatchLoader(data, 16, seed=3)
    assert a.steps_per_epoch == 6
    np.testing.assert_array_equal(a.indices(7), b.indices(7))  # epoch 1, second batch
    epoch0 = np.concatenate([a.indices(s) for s in range(6)])
    assert len(set(epoch0.tolist())) == 96  # no sample twice within an epoch
    assert not np.array_equal(a.indices(0), a.indices(6))  # reshuffled per epoch


def test_eval_batches_pad_the_last_batch():
    batches = list(eval_batches(_tiny(), 3))
    assert [v for _, v in batches] == [3, 1]
    assert all(b[0].shape[0] == 3 for b, _ in batches)


def _criteo_line(label, ints, cats):
    return "\t".join([str(label), *ints, *cats]) + "\n"


def test_criteo_tsv_plain_and_gzip(tmp_path):
    ints = ["1", "", "-5"] + ["3"] * 10
    cats = ["68fd1e64", ""] + ["a"] * 24
    text = _criteo_line(1, ints, cats) + _criteo_line(0, ["0"] * 13, ["ff"] * 26)
    plain = tmp_path / "day.tsv"
    plain.write_text(text)
    zipped = tmp_path / "day.gz"
    with gzip.open(zipped, "wt") as f:
        f.write(text)
    for path in (plain, zipped):
        data = read_criteo_tsv(path, num_embeddings=1001)
        assert len(data) == 2 and data.labels.tolist() == [1.0, 0.0]
        assert data.dense[0, :3].tolist() == pytest.approx([math.log(2), 0.0, 0.0])
        assert data.values[0][0] == 1 + int("68fd1e64", 16) % 1000
        assert data.values[1][0] == 0  # missing -> id 0
    chunks = list(iter_criteo_tsv([plain, zipped], num_embeddings=1001, chunk_rows=3))
    assert [len(c) for c in chunks] == [3, 1]


def test_criteo_raw_ids_keep_every_hex_bit_and_refuse_only_the_reserved_value(tmp_path):
    cats = ["68fd1e64", "", "ffffffffffffffff", "8000000000000000", "7ffffffffffffffe", "0"] + [
        "a"
    ] * 20
    path = tmp_path / "day.tsv"
    path.write_text(_criteo_line(1, ["1"] * 13, cats))
    sizes = [0] * 6 + [100] * 20
    data = read_criteo_tsv(path, num_embeddings=sizes)
    assert [v.tolist() for v in data.values[:6]] == [
        [0x68FD1E64],
        [],
        [-1],
        [-(2**63)],
        [2**63 - 2],
        [0],
    ]
    assert data.lengths[:6, 0].tolist() == [1, 0, 1, 1, 1, 1]  # missing: an empty bag, not an id
    assert data.num_embeddings[:7] == (0, 0, 0, 0, 0, 0, 100) and data.raw_keys == CRITEO_KEYS[:6]
    assert int(data.values[6][0]) == 1 + 0xA % 99  # a hashed feature beside them is unchanged
    path.write_text(_criteo_line(1, ["1"] * 13, ["7fffffffffffffff"] + ["a"] * 25))
    with pytest.raises(
        CriteoFormatError,
        match=r"day\.tsv, line 1: categorical feature C1 is '7fffffffffffffff' "
        r"\(column 15\): the raw id 2\*\*63 - 1 is reserved",
    ):
        read_criteo_tsv(path, num_embeddings=sizes)
    with pytest.raises(ValueError, match=r"integer >= 2 \(or 0: raw ids\)"):
        read_criteo_tsv(path, num_embeddings=1)


def test_movielens_raw_ids_are_distinct_64_bit_and_stable():
    from hybrid.data._movielens import raw_id

    index = np.arange(5000)
    users, items = raw_id("user", index), raw_id("item", index)
    assert users.dtype == np.int64 and len(set(users.tolist()) | set(items.tolist())) == 10_000
    assert (users < 0).any() and (np.abs(users) > 2**40).mean() > 0.99  # spread over the 64 bits
    np.testing.assert_array_equal(raw_id("user", index), users)
    assert int(raw_id("user", np.array([7]))[0]) == int(users[7])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("1\t2\t3\n", "3 tab-separated fields, expected 40"),
        (_criteo_line(2, ["1"] * 13, ["a"] * 26), "label '2' must be 0 or 1"),
        (_criteo_line(1, ["x"] + ["1"] * 12, ["a"] * 26), "integer feature I1 is 'x'"),
        (_criteo_line(1, ["1"] * 13, ["a"] * 25 + ["zz"]), "categorical feature C26 is 'zz'"),
    ],
)
def test_criteo_bad_row_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.tsv"
    path.write_text(_criteo_line(0, ["1"] * 13, ["a"] * 26) + line)
    with pytest.raises(CriteoFormatError, match=rf"bad\.tsv, line 2: .*{message}"):
        read_criteo_tsv(path, num_embeddings=100)


def test_synthetic_is_seeded_and_in_range():
    a = synthetic_clicks(200, num_sparse=3, num_dense=2, num_embeddings=40, seed=5)
    b = synthetic_clicks(200, num_sparse=3, num_dense=2, num_embeddings=40, seed=5)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert a.keys == ("cat_0", "cat_1", "cat_2") and a.num_embeddings == (40, 40, 40)
    assert 0.2 < a.labels.mean() < 0.8


def test_movielens_features_and_time_split():
    from hybrid.data import MOVIELENS_FEATURES, load_movielens

    train, evaluation = load_movielens()
    assert (len(train), len(evaluation)) == (80_000, 20_000)
    assert train.keys == MOVIELENS_FEATURES
    assert train.num_embeddings[:3] == (944, 1683, 3)
    assert 1 < max(train.max_lengths()) <= 6  # genres are multi-hot
    # time split: the eval timestamps (dense column 1) all follow the training ones
    assert train.dense[:, 1].max() <= evaluation.dense[:, 1].min()
    assert 0.5 < train.labels.mean() < 0.6
