"""Managed-collision tables in an `EmbeddingCollection` (TorchRec's
`ManagedCollisionEmbeddingCollection`), unsharded and on a mesh.

A sequence lookup is a pooled lookup in which every id is its own bag, so a managed sequence
collection must train exactly as the managed bag collection (itself checked against the
plain-Python oracle in test_managed_collision.py and test_managed_sharded.py) fed the same
ids as one-id bags: same slots, same evictions, same fresh rows, same updates. The slots are
also checked directly against the oracle."""

import jax
import numpy as np
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    ManagedCollisionSparseModule,
    MCHManagedCollisionModule,
    RawIds,
    make_update,
)
from sparse_jax.optim import rowwise_adagrad
from sparse_jax.sharding import ShardedManagedCollisionModule, shard
from tests.reference import ManagedCollisionLoop

Z, CATS, DIM = 16, 10, 4
FEATURES = ("item", "hist", "cat")  # item and hist feed the managed table: one stream


def _tables(kind):
    return [
        kind(name="items", num_embeddings=Z, embedding_dim=DIM, feature_names=["item", "hist"]),
        kind(name="cats", num_embeddings=CATS, embedding_dim=DIM, feature_names=["cat"]),
    ]


def _modules(policy):
    return {"items": MCHManagedCollisionModule(Z, history_capacity=256, eviction_policy=policy)}


def _stream(steps, seed=0, pool=40):
    """Per step {feature: int64 ids}: raw 64-bit ids for the managed features, rows for cat."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(-(2**62), 2**62, size=pool)
    for _ in range(steps):
        yield {
            "item": raw[rng.integers(0, pool, rng.integers(1, 9))],
            "hist": raw[rng.integers(0, pool, rng.integers(0, 12))],
            "cat": rng.integers(0, CATS, rng.integers(1, 6)),
        }


def _sequence_kjt(ids, stride=3):
    """The features' ids spread over `stride` samples (uneven lengths), as raw id words."""
    lengths = []
    for f in FEATURES:
        n = len(ids[f])
        cuts = np.sort(np.random.default_rng(n).integers(0, n + 1, stride - 1))
        lengths += np.diff(np.concatenate([[0], cuts, [n]])).tolist()
    values = RawIds.from_int64(np.concatenate([ids[f] for f in FEATURES]).astype(np.int64)).words()
    return KeyedJaggedTensor(list(FEATURES), values, lengths=np.asarray(lengths, np.int32))


def _one_id_bags(ids, devices=1):
    """The same ids as one-id bags (every feature padded with empty bags to one batch size,
    a multiple of the device count)."""
    bags = -(-max(len(ids[f]) for f in FEATURES) // devices) * devices
    lengths = np.concatenate(
        [np.r_[np.ones(len(ids[f])), np.zeros(bags - len(ids[f]))] for f in FEATURES]
    )
    values = RawIds.from_int64(np.concatenate([ids[f] for f in FEATURES]).astype(np.int64)).words()
    return KeyedJaggedTensor(list(FEATURES), values, lengths=lengths.astype(np.int32)), bags


def _pooled_grad(grads, bags):
    """The per-id gradients laid out as the one-id bags' pooled gradient."""
    pooled = np.zeros((bags, DIM * len(FEATURES)), np.float32)
    for k, f in enumerate(FEATURES):
        pooled[: len(grads[f]), k * DIM : (k + 1) * DIM] = grads[f]
    return pooled


def _pair(policy, plan=None):
    """(managed sequence module, managed bag module) over the same tables, unsharded or on a
    mesh with `plan`, with their params and optimizer states from one key."""
    ec = EmbeddingCollection(_tables(EmbeddingConfig))
    ebc = EmbeddingBagCollection(_tables(EmbeddingBagConfig))
    if plan is None:
        seq = ManagedCollisionSparseModule(
            ManagedCollisionEmbeddingCollection(ec, _modules(policy))
        )
        bag = ManagedCollisionSparseModule(
            ManagedCollisionEmbeddingBagCollection(ebc, _modules(policy))
        )
    else:
        mesh = jax.make_mesh(
            (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
        )
        seq = ShardedManagedCollisionModule(shard(ec, mesh, plan), _modules(policy))
        bag = ShardedManagedCollisionModule(shard(ebc, mesh, plan), _modules(policy))
    rule = rowwise_adagrad(lr=0.3)
    sides = []
    for module in (seq, bag):
        params = module.init(jax.random.key(7))
        sides.append([module, make_update(module, rule), params, rule.init(params)])
    return sides


@pytest.mark.parametrize(
    ("policy", "plan"),
    [("lru", None), ("lfu", None), ("lfu", {"items": "row_wise", "cats": "table_wise"})],
    ids=["lru", "lfu", "row_wise"],
)
def test_a_managed_sequence_collection_trains_as_the_bag_collection_on_one_id_bags(policy, plan):
    (seq, seq_update, sp, so), (bag, bag_update, bp, bo) = _pair(policy, plan)
    rng = np.random.default_rng(1)
    oracle = ManagedCollisionLoop(Z, policy) if plan is None else None
    shapes, repeats = set(), 0
    for step, ids in enumerate(_stream(18)):
        batch = seq.prepare(_sequence_kjt(ids))
        shape = repr(
            jax.tree.map(
                np.shape,
                (
                    seq._targets(batch.inner) if plan is None else batch.rows.inner.values,
                    batch.rows.words if plan else batch.words,
                ),
            )
        )
        compiled = seq.remap_compile_count()
        sp, so, rows = seq.remap(sp, so, batch)
        if (
            step >= 3 and shape in shapes
        ):  # past warm-up, a batch shape seen before compiles nothing
            assert seq.remap_compile_count() == compiled
            repeats += 1
        shapes.add(shape)
        out = seq.apply(sp, rows)
        bag_kjt, bags = _one_id_bags(ids, 1 if plan is None else 8)
        bp, bo, bag_rows = bag.remap(bp, bo, bag.prepare(bag_kjt))
        pooled = np.asarray(bag.apply(bp, bag_rows).values())
        for k, f in enumerate(FEATURES):
            got = np.asarray(out[f].values())
            np.testing.assert_allclose(
                got, pooled[: len(ids[f]), k * DIM : (k + 1) * DIM], rtol=1e-6, atol=1e-7
            )
            assert np.asarray(out[f].lengths()).sum() == len(ids[f])
        if oracle is not None:  # the rows read are the oracle's slots' rows
            raw = [int(i) for i in np.concatenate([ids["item"], ids["hist"]])]
            oracle.profile(raw)
            items = np.asarray(seq.table_weights(sp)["items"])
            want = items[oracle.remap(raw)]
            np.testing.assert_array_equal(
                np.concatenate([out["item"].values(), out["hist"].values()]), want
            )
        grads = {f: rng.normal(size=(len(ids[f]), DIM)).astype(np.float32) for f in FEATURES}
        sp, so = seq_update(sp, so, rows, grads)
        bp, bo = bag_update(bp, bo, bag_rows, _pooled_grad(grads, bags))
    assert repeats >= 8
    for name, w in bag.table_weights(bp).items():
        np.testing.assert_allclose(
            np.asarray(seq.table_weights(sp)[name]), np.asarray(w), rtol=1e-5, atol=1e-6
        )
    stats = np.asarray(seq.stats()["items"])
    assert stats.tolist() == np.asarray(bag.stats()["items"]).tolist()
    assert stats[2] > 0  # ids were evicted: fresh rows were drawn and trained on
    if oracle is not None:
        assert stats[0] == sum(e["raw"] is not None for e in oracle.entries)


def test_eval_maps_without_changing_the_id_maps():
    (seq, _, sp, so), _ = _pair("lru")
    ids = next(_stream(1))
    before = jax.tree.map(np.asarray, seq.mc_state)
    out = seq.apply(sp, _sequence_kjt(ids))  # a raw batch: mapped read-only
    default = np.asarray(seq.table_weights(sp)["items"])[Z - 1]
    np.testing.assert_array_equal(
        np.asarray(out["item"].values()), np.tile(default, (len(ids["item"]), 1))
    )
    np.testing.assert_array_equal(
        np.asarray(out["cat"].values()), np.asarray(seq.table_weights(sp)["cats"])[ids["cat"]]
    )
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, seq.mc_state), before)
    sp, so, _ = seq.remap(sp, so, seq.prepare(_sequence_kjt(ids)))
    out = seq.apply(sp, seq.prepare(_sequence_kjt(ids)))
    items = np.asarray(seq.table_weights(sp)["items"])
    resident = ManagedCollisionLoop(Z)
    resident.profile([int(i) for i in np.concatenate([ids["item"], ids["hist"]])])
    np.testing.assert_array_equal(
        np.asarray(out["item"].values()), items[resident.remap(ids["item"].tolist())]
    )


def test_what_a_managed_sequence_collection_refuses():
    modules = _modules("lru")
    with pytest.raises(ValueError, match="need_indices=True"):
        ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(_tables(EmbeddingConfig), need_indices=True), modules
        )
    shared = [
        EmbeddingConfig(name="items", num_embeddings=Z, embedding_dim=DIM, feature_names=["item"]),
        EmbeddingConfig(
            name="more", num_embeddings=CATS, embedding_dim=DIM, feature_names=["item"]
        ),
    ]
    with pytest.raises(ValueError, match="feature 'item' feeds tables"):
        ManagedCollisionEmbeddingCollection(EmbeddingCollection(shared), modules)
    with pytest.raises(TypeError, match="wraps an EmbeddingCollection, got EmbeddingBagCollection"):
        ManagedCollisionEmbeddingCollection(
            EmbeddingBagCollection(_tables(EmbeddingBagConfig)), modules
        )
    with pytest.raises(TypeError, match="wraps an EmbeddingBagCollection, got EmbeddingCollection"):
        ManagedCollisionEmbeddingBagCollection(
            EmbeddingCollection(_tables(EmbeddingConfig)), modules
        )
    seq = ManagedCollisionSparseModule(
        ManagedCollisionEmbeddingCollection(EmbeddingCollection(_tables(EmbeddingConfig)), modules)
    )
    bad = _sequence_kjt({"item": np.array([3]), "hist": np.array([4]), "cat": np.array([CATS])})
    with pytest.raises(ValueError, match="cat"):  # an unmanaged feature's ids are still checked
        seq.prepare(bad)
