"""The pure-XLA lookup's position matrices (`sparse_jax._position_rows`), built on the host
in `prepare` for kernel="xla": equal to the plain loops of `tests/reference.py`, and the
lookup that reads them pools bit for bit what the lookup reading the KJT's ids pools."""

import dataclasses

import jax
import numpy as np
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from sparse_jax._position_rows import cap_classes, position_rows
from tests import reference

# a group of two tables (one MEAN) with three features, two sharing their length cap, and a
# second group: classes of one and of two features
TABLES = [
    EmbeddingBagConfig(name="a", num_embeddings=50, embedding_dim=8, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(
        name="b",
        num_embeddings=30,
        embedding_dim=8,
        feature_names=["f2"],
        pooling=PoolingType.MEAN,
    ),
    EmbeddingBagConfig(name="c", num_embeddings=20, embedding_dim=4, feature_names=["f3"]),
]
KEYS = ["f0", "f1", "f2", "f3"]
B = 6


def _kjt(rng, weighted, longest=(3, 14, 14, 40)):
    lengths = np.concatenate([rng.integers(0, m + 1, B) for m in longest])
    lengths[rng.random(lengths.size) < 0.2] = 0  # empty bags
    lengths[[B, 2 * B]] = longest[1]  # f1 and f2 reach the same cap: one class of two
    n = int(lengths.sum())
    ids = rng.integers(-3, 55, n)  # some outside every table, both ends
    weights = rng.random(n).astype(np.float32) + 0.25 if weighted else None
    return KeyedJaggedTensor(KEYS, ids, lengths=lengths, weights=weights)


def _bag_weights(kjt):
    """{feature: [[weights of bag 0], ...]}."""
    lengths = np.asarray(kjt.lengths())
    return reference.bags(KEYS, np.asarray(kjt.weights()), lengths, B, cast=float)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("bounds_check", ["clamp", "skip"])
def test_matrices_equal_the_loops(weighted, bounds_check):
    rng = np.random.default_rng(7 + weighted)
    kjt = _kjt(rng, weighted)
    ebc = EmbeddingBagCollection(
        TABLES, is_weighted=weighted, kernel="xla", bounds_check=bounds_check
    )
    padded = ebc.prepare(kjt).kjt  # the padded KJT on the device
    host = jax.tree.map(np.asarray, padded)
    got = position_rows(host, ebc.layout, weighted=weighted, bounds_check=bounds_check)
    bag_ids = reference.bags(KEYS, np.asarray(kjt.values()), np.asarray(kjt.lengths()), B)
    bag_w = _bag_weights(kjt) if weighted else None
    caps = [padded.length_caps()[KEYS.index(s.feature)] for s in ebc.layout.features]
    seen = 0
    for group in ebc.layout.groups:
        classes = cap_classes(ebc.layout, group, caps)
        assert len(got[group]) == len(classes)
        for (cap, members), (rows, w) in zip(classes, got[group], strict=True):
            slots = [ebc.layout.features[i] for i in members]
            want_rows, want_w = reference.position_rows_loop(
                bag_ids,
                bag_w if weighted else None,
                [
                    (s.feature, s.row_offset, s.num_rows, s.pooling.name, bounds_check)
                    for s in slots
                ],
                cap,
            )
            assert rows.dtype == np.int32 and w.dtype == np.float32
            np.testing.assert_array_equal(rows, np.array(want_rows, np.int32))
            np.testing.assert_array_equal(w, np.array(want_w, np.float32))
            seen += len(members)
    assert seen == len(KEYS)
    # the shared cap really made a class of two features
    assert any(len(m) == 2 for g in ebc.layout.groups for _, m in cap_classes(ebc.layout, g, caps))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("bounds_check", ["clamp", "skip"])
@pytest.mark.parametrize("dtype", ["FP32", "FP16"])
def test_lookup_reading_them_pools_the_same(weighted, bounds_check, dtype):
    rng = np.random.default_rng(11 + weighted)
    tables = [dataclasses.replace(t, data_type=dtype) for t in TABLES]
    ebc = EmbeddingBagCollection(
        tables, is_weighted=weighted, kernel="xla", bounds_check=bounds_check
    )
    params = ebc.init(jax.random.key(3))
    for _ in range(2):  # a second batch reuses the caps (and the compiled program)
        kjt = _kjt(rng, weighted)
        built, plain = ebc.prepare(kjt), ebc.prepare(kjt, positions=False)
        assert built.positions is not None and plain.positions is None
        got = np.asarray(ebc.apply(params, built).values())
        np.testing.assert_array_equal(got, np.asarray(ebc.apply(params, plain).values()))
        bag_ids = reference.bags(KEYS, np.asarray(kjt.values()), np.asarray(kjt.lengths()), B)
        bag_w = _bag_weights(kjt) if weighted else None
        scale = {}  # a skipped id (bounded to -1) reads row 0 with weight 0
        for t in tables:
            for f in t.feature_names:
                kept = [
                    reference.bounded_ids(bag, t.num_embeddings, bounds_check) for bag in bag_ids[f]
                ]
                bag_ids[f] = [[max(int(i), 0) for i in bag] for bag in kept]
                scale[f] = [
                    [
                        (1.0 if bag_w is None else bag_w[f][b][j]) * (i >= 0)
                        for j, i in enumerate(bag)
                    ]
                    for b, bag in enumerate(kept)
                ]
        weights = {name: np.asarray(w, np.float32) for name, w in ebc.table_weights(params).items()}
        features = [(s.feature, s.table, s.pooling.name) for s in ebc.layout.features]
        want = reference.pooled_lookup(weights, features, bag_ids, scale)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_only_the_xla_kernel_builds_them():
    kjt = _kjt(np.random.default_rng(0), False)
    for kernel, built in [("xla", True), ("auto", False), ("reference", False)]:
        ebc = EmbeddingBagCollection(TABLES, kernel=kernel, bounds_check="clamp")
        assert (ebc.prepare(kjt).positions is not None) is built, kernel


def test_a_padded_kjt_is_required():
    ebc = EmbeddingBagCollection(TABLES, kernel="xla")
    kjt = KeyedJaggedTensor(KEYS, np.zeros(4, np.int32), lengths=np.ones(4, np.int32))
    with pytest.raises(ValueError, match="padded KJT"):
        position_rows(kjt, ebc.layout, weighted=False, bounds_check="clamp")
