"""EmbeddingCollection: unpooled rows per id (tables of different dims), fused update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor, make_update, optim
from tests import reference

TABLES = [
    EmbeddingConfig(
        name="seq", num_embeddings=20, embedding_dim=8, feature_names=["clicks", "views"]
    ),
    EmbeddingConfig(name="cat", num_embeddings=7, embedding_dim=3, feature_names=["category"]),
]


def _kjt(rng, batch=4):
    keys = ["category", "clicks", "views"]
    rows = {"category": 7, "clicks": 20, "views": 20}
    lengths = rng.integers(0, 4, size=3 * batch)
    values = np.concatenate(
        [
            rng.integers(0, rows[k], size=lengths[i * batch : (i + 1) * batch].sum())
            for i, k in enumerate(keys)
        ]
    )
    return KeyedJaggedTensor(keys, values, lengths=lengths)


def test_rows_per_id_with_different_dims():
    ec = EmbeddingCollection(TABLES)
    params = ec.init(jax.random.key(0))
    kjt = _kjt(np.random.default_rng(0))
    out = ec.apply(params, kjt)
    weights = ec.table_weights(params)
    for feature, table in [("clicks", "seq"), ("views", "seq"), ("category", "cat")]:
        ids = np.asarray(kjt[feature].values())
        np.testing.assert_array_equal(
            np.asarray(out[feature].values()), np.asarray(weights[table])[ids]
        )
        np.testing.assert_array_equal(
            np.asarray(out[feature].lengths()), np.asarray(kjt[feature].lengths())
        )


@pytest.mark.parametrize("rule_name", ["sgd", "rowwise_adagrad", "adam"])
def test_fused_update_matches_loops(rule_name):
    hp = {
        "sgd": dict(lr=0.1),
        "rowwise_adagrad": dict(lr=0.1, eps=1e-8),
        "adam": dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0),
    }[rule_name]
    rule = getattr(optim, rule_name)(**hp)
    ec = EmbeddingCollection(TABLES)
    params = ec.init(jax.random.key(1))
    state = rule.init(params)
    update = make_update(ec, rule)
    weights = {k: np.asarray(v, np.float64) for k, v in ec.table_weights(params).items()}
    states: dict = {}
    rng = np.random.default_rng(2)
    for step in range(1, 4):
        kjt = _kjt(rng)
        grads = {
            s.feature: rng.normal(size=(len(kjt[s.feature].values()), s.dim)).astype(np.float32)
            for s in ec.layout.features
        }
        params, state = update(params, state, kjt, grads)
        row_grads: dict = {}
        for s in ec.layout.features:  # a sequence id's gradient is its own row's
            for i, g in zip(np.asarray(kjt[s.feature].values()), grads[s.feature], strict=True):
                row_grads.setdefault(s.table, {})
                row_grads[s.table][int(i)] = row_grads[s.table].get(int(i), 0.0) + g.astype(
                    np.float64
                )
        reference.fused_step(rule_name, hp, weights, states, row_grads, step)
    for table, w in ec.table_weights(params).items():
        np.testing.assert_allclose(np.asarray(w), weights[table], rtol=1e-5, atol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="use EmbeddingBagCollection for pooled tables"):
        from sparse_jax import EmbeddingBagConfig

        EmbeddingCollection([EmbeddingBagConfig(name="p", num_embeddings=3, embedding_dim=2)])
    ec = EmbeddingCollection(TABLES)
    params = ec.init(jax.random.key(0))
    kjt = _kjt(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"grads has no entry for feature\(s\) \['views'\]"):
        make_update(ec, optim.sgd())(
            params,
            optim.sgd().init(params),
            kjt,
            {"clicks": jnp.zeros((1, 8)), "category": jnp.zeros((1, 3))},
        )


@pytest.mark.parametrize(
    ("plan", "input_dist"),
    [
        ({"seq": "row_wise", "cat": "table_wise"}, "all_gather"),
        ({"seq": "column_wise", "cat": "data_parallel"}, "all_to_all"),
    ],
)
def test_sharded_sequence_collection_matches_unsharded(plan, input_dist):
    from sparse_jax.sharding import shard

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    ec = EmbeddingCollection(TABLES)
    sharded = shard(ec, mesh, plan, input_dist=input_dist)
    params, sparams = ec.init(jax.random.key(3)), sharded.init(jax.random.key(3))
    rule = optim.adagrad(lr=0.1)
    state, sstate = rule.init(params), rule.init(sparams)
    update, supdate = make_update(ec, rule), make_update(sharded, rule)
    rng = np.random.default_rng(4)
    for _ in range(3):
        kjt = _kjt(rng)
        want, got = ec.apply(params, kjt), sharded.apply(sparams, kjt)
        for f in want:
            np.testing.assert_allclose(
                np.asarray(got[f].values()), np.asarray(want[f].values()), rtol=1e-6
            )
            np.testing.assert_array_equal(
                np.asarray(got[f].lengths()), np.asarray(want[f].lengths())
            )
        grads = {
            s.feature: rng.normal(size=(len(kjt[s.feature].values()), s.dim)).astype(np.float32)
            for s in ec.layout.features
        }
        params, state = update(params, state, kjt, grads)
        sparams, sstate = supdate(sparams, sstate, kjt, grads)
    for name, w in ec.table_weights(params).items():
        np.testing.assert_allclose(
            sharded.table_weights(sparams)[name], np.asarray(w), rtol=1e-5, atol=1e-6
        )
