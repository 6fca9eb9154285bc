"""EmbeddingBagCollection: both kernels against the plain-loop oracle, configs, bounds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from tests import reference
from tests.cases import random_case


def _oracle(ebc, params, case):
    weights = {k: np.asarray(v, np.float64) for k, v in ebc.table_weights(params).items()}
    return reference.pooled_lookup(weights, case.features, case.bag_ids, case.bag_weights)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_lookup_matches_loops_both_kernels(seed, weighted):
    rng = np.random.default_rng(seed)
    dims = [int(d) for d in rng.choice([1, 3, 8, 16, 64, 256], size=int(rng.integers(1, 4)))]
    case = random_case(rng, dims=dims, batch=int(rng.integers(1, 7)), weighted=weighted)
    expected = None
    for kernel in ("ffi", "xla", "reference"):
        ebc = EmbeddingBagCollection(case.tables, is_weighted=weighted, kernel=kernel)
        params = ebc.init(jax.random.key(seed))
        kt = ebc.apply(params, case.kjt)
        assert kt.keys() == [f for f, _, _ in case.features]
        assert kt.length_per_key() == [
            t.embedding_dim for t in case.tables for _ in t.feature_names
        ]
        expected = _oracle(ebc, params, case) if expected is None else expected
        np.testing.assert_allclose(np.asarray(kt.values()), expected, rtol=1e-5, atol=1e-6)
        padded = ebc.apply(params, case.kjt.pad())  # static-shape form gives the same numbers
        np.testing.assert_allclose(np.asarray(padded.values()), expected, rtol=1e-5, atol=1e-6)


def test_bf16_tables_within_bf16_tolerance():
    rng = np.random.default_rng(3)
    case = random_case(rng, dims=[16, 32], data_type="BF16", weighted=True)
    ebc = EmbeddingBagCollection(case.tables, is_weighted=True)
    params = ebc.init(jax.random.key(0))
    assert all(p.dtype == jnp.bfloat16 for p in params.values())
    kt = ebc.apply(params, case.kjt.pad())
    assert kt.values().dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(kt.values()), _oracle(ebc, params, case), rtol=1e-2, atol=1e-3
    )


def test_empty_bags_pool_to_zero_and_mean_divides_by_true_length():
    t = EmbeddingBagConfig(
        name="t", num_embeddings=4, embedding_dim=2, feature_names=["f"], pooling="MEAN"
    )
    ebc = EmbeddingBagCollection([t])
    params = ebc.with_table_weights(
        ebc.init(jax.random.key(0)), {"t": np.arange(8, dtype=np.float32).reshape(4, 2)}
    )
    kjt = KeyedJaggedTensor(["f"], np.array([1, 3, 3]), lengths=np.array([0, 3, 0]))
    out = np.asarray(ebc.apply(params, kjt.pad()).values())
    np.testing.assert_allclose(out, [[0, 0], [(2 + 6 + 6) / 3, (3 + 7 + 7) / 3], [0, 0]])


def test_jit_of_apply_with_padded_kjt_and_long_bags():
    # a bag longer than the unroll limit takes the fori_loop form
    t = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=3, feature_names=["f"])
    ebc = EmbeddingBagCollection([t])
    params = ebc.init(jax.random.key(1))
    ids = np.arange(100) % 10
    kjt = KeyedJaggedTensor(["f"], ids, lengths=np.array([100, 0])).pad()
    assert kjt.length_caps() == (112,)  # length_cap(100)
    out = jax.jit(ebc.apply)(params, kjt).values()
    w = np.asarray(params["fp32_d3"], np.float64)
    np.testing.assert_allclose(np.asarray(out), [10 * w.sum(0), [0, 0, 0]], rtol=1e-5)


def test_table_weights_round_trip_and_errors():
    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=5, embedding_dim=4, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", num_embeddings=3, embedding_dim=4, feature_names=["fb"]),
        EmbeddingBagConfig(name="c", num_embeddings=2, embedding_dim=2, feature_names=["fc"]),
    ]
    ebc = EmbeddingBagCollection(tables)
    params = ebc.init(jax.random.key(0))
    assert set(params) == {"fp32_d4", "fp32_d2"} and params["fp32_d4"].shape == (8, 4)
    b = np.full((3, 4), 7.0, np.float32)
    params = ebc.with_table_weights(params, {"b": b})
    np.testing.assert_array_equal(ebc.table_weights(params)["b"], b)
    for t in tables:  # init respects TorchRec's default range +-sqrt(1/E)
        w = np.asarray(ebc.table_weights(params)[t.name])
        assert t.name == "b" or np.abs(w).max() <= np.sqrt(1 / t.num_embeddings)
    with pytest.raises(ValueError, match=r"table 'c' is \[2, 2\], got weights of shape \(3, 2\)"):
        ebc.with_table_weights(params, {"c": np.zeros((3, 2), np.float32)})
    with pytest.raises(ValueError, match="no table named 'z'"):
        ebc.with_table_weights(params, {"z": b})


def test_ids_out_of_range_error_clamp_skip():
    t = EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=2, feature_names=["f", "g"])
    kjt = KeyedJaggedTensor(["f", "g"], np.array([1, 2, 9, 0]), lengths=np.array([1, 0, 2, 1]))
    ebc = EmbeddingBagCollection([t])
    params = ebc.with_table_weights(
        ebc.init(jax.random.key(0)), {"t": np.arange(8, dtype=np.float32).reshape(4, 2)}
    )
    with pytest.raises(
        ValueError,
        match=r"feature 'g' \(table 't', num_embeddings=4\): id 9 at batch position 0, index 1",
    ):
        ebc.apply(params, kjt)
    for kernel in ("auto", "xla"):
        clamp = EmbeddingBagCollection([t], bounds_check="clamp", kernel=kernel)
        skip = EmbeddingBagCollection([t], bounds_check="skip", kernel=kernel)
        np.testing.assert_allclose(
            np.asarray(clamp.apply(params, kjt).values()), [[2, 3, 4 + 6, 5 + 7], [0, 0, 0, 1]]
        )
        np.testing.assert_allclose(
            np.asarray(skip.apply(params, kjt).values()), [[2, 3, 4, 5], [0, 0, 0, 1]]
        )
    negative = KeyedJaggedTensor(["f", "g"], np.array([-1]), lengths=np.array([1, 0, 0, 0]))
    with pytest.raises(ValueError, match="id -1 at batch position 0"):
        ebc.apply(params, negative)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: EmbeddingBagConfig(name="", num_embeddings=3, embedding_dim=2),
            "non-empty string name",
        ),
        (
            lambda: EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=0),
            "embedding_dim must be an integer >= 1",
        ),
        (
            lambda: EmbeddingBagConfig(
                name="t", num_embeddings=3, embedding_dim=2, feature_names="f"
            ),
            "write feature_names=\\['f'\\]",
        ),
        (
            lambda: EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=2, pooling="MAX"),
            "pooling='MAX' is not one of",
        ),
        (
            lambda: EmbeddingBagConfig(
                name="t", num_embeddings=3, embedding_dim=2, feature_names=["f", ""]
            ),
            "non-empty strings",
        ),
        (
            lambda: EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(
                        name="a", num_embeddings=3, embedding_dim=2, feature_names=["f"]
                    ),
                    EmbeddingBagConfig(
                        name="a", num_embeddings=3, embedding_dim=2, feature_names=["g"]
                    ),
                ]
            ),
            "table name 'a' is used by two tables",
        ),
        (
            lambda: EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=2, need_pos=True),
            "need_pos=True: position-weighted features .* leave it at False",
        ),
        (
            lambda: EmbeddingBagConfig(
                name="t", num_embeddings=3, embedding_dim=2, use_virtual_table=True
            ),
            "use_virtual_table=True: virtual",
        ),
        (
            lambda: EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=2, init_fn=0.5),
            "init_fn must be callable as init_fn\\(key, shape, dtype\\)",
        ),
        (
            lambda: EmbeddingBagCollection(
                [EmbeddingConfig(name="s", num_embeddings=3, embedding_dim=2)]
            ),
            "use EmbeddingCollection",
        ),
        (
            lambda: EmbeddingBagCollection(
                [EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=2)], kernel="fast"
            ),
            "kernel='fast'",
        ),
    ],
)
def test_config_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_missing_feature_and_missing_weights():
    t = EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=2, feature_names=["f", "g"])
    kjt = KeyedJaggedTensor(["f"], np.array([1]), lengths=np.array([1]))
    with pytest.raises(
        ValueError, match=r"feature\(s\) \['g'\] of tables \['t'\] are not in the KeyedJaggedTensor"
    ):
        EmbeddingBagCollection([t]).apply(EmbeddingBagCollection([t]).init(jax.random.key(0)), kjt)
    kjt2 = KeyedJaggedTensor(["f", "g"], np.array([1]), lengths=np.array([1, 0]))
    ebc = EmbeddingBagCollection([t], is_weighted=True)
    with pytest.raises(ValueError, match=r"is_weighted=True\) but the KJT has no weights"):
        ebc.apply(ebc.init(jax.random.key(0)), kjt2)
