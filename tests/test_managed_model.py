"""Managed-collision tables in `hybrid.Model`: raw 64-bit ids in, trained exactly as a plain
model fed the oracle's slots and reset the oracle's evicted rows (tests/reference.py)."""

import json
import zipfile

import jax
import numpy as np
import pytest
import torch

import dense_torch
import hybrid
from sparse_jax import EmbeddingBagConfig, MCHManagedCollisionModule
from sparse_jax.optim import adagrad, rowwise_adagrad
from tests.reference import ManagedCollisionLoop

Z, ITEMS, DIM = 6, 10, 4


def _zeros(key, shape, dtype):  # noqa: ARG001 (fresh rows the test knows)
    return jax.numpy.zeros(shape, dtype)


def _tables():
    return [
        EmbeddingBagConfig(
            name="users",
            num_embeddings=Z,
            embedding_dim=DIM,
            feature_names=["user"],
            init_fn=_zeros,
        ),
        EmbeddingBagConfig(
            name="items", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["item"]
        ),
    ]


def _dense(seed):
    torch.manual_seed(seed)
    return dense_torch.DLRM(DIM, 2, 3, [4, DIM], [4, 1])


def _batches(steps, seed=0, batch=4):
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**62), 2**62, size=15)
    for _ in range(steps):
        users = [pool[rng.integers(0, 15, rng.integers(0, 3))] for _ in range(batch)]
        items = [rng.integers(0, ITEMS, rng.integers(1, 3)) for _ in range(batch)]
        dense = torch.from_numpy(rng.normal(size=(batch, 3)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, batch).astype(np.float32))
        yield users, items, dense, labels


def _kjt(users, items, user_values):
    lengths = torch.tensor([len(b) for b in users] + [len(b) for b in items], dtype=torch.int32)
    values = torch.cat(
        [
            torch.as_tensor(np.asarray(user_values, np.int64)),
            torch.from_numpy(np.concatenate(items).astype(np.int64)),
        ]
    )
    return ("user", "item"), values, lengths


def _step(model, opt, sparse, dense, labels):
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        model(dense, sparse).squeeze(-1), labels
    )
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


@pytest.mark.parametrize(
    "rule", [rowwise_adagrad(lr=0.3), adagrad(lr=0.3)], ids=["rowwise_adagrad", "adagrad"]
)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_managed_table_trains_as_a_plain_table_fed_the_oracles_slots_and_resets(policy, rule):
    module = MCHManagedCollisionModule(Z, history_capacity=128, eviction_policy=policy)
    managed = hybrid.Model(
        _tables(), _dense(0), sparse_optimizer=rule, managed_collision_modules={"users": module}
    )
    plain = hybrid.Model(_tables(), _dense(0), sparse_optimizer=rule)
    plain.load_state_dict(managed.state_dict())
    opts = [torch.optim.SGD(m.dense_parameters(), lr=0.2) for m in (managed, plain)]
    oracle = ManagedCollisionLoop(Z, policy)
    resets = 0
    for users, items, dense, labels in _batches(30):
        raw = [int(i) for b in users for i in b]
        evicted = oracle.profile(raw)
        if evicted:  # what the managed model must do on its own: fresh (zero) rows, zero state
            resets += 1
            rows = sorted(evicted)
            weights = plain.table_weights()["users"].clone()
            weights[rows] = 0
            plain.load_state_dict({"embedding_bags.users.weight": weights}, strict=False)
            state = plain.sparse_opt_state
            group, offset = plain.sparse_module.layout.table_group["users"]
            tables = {
                g: {k: (np.asarray(v).copy()) for k, v in leaves.items()}
                for g, leaves in state.tables.items()
            }
            for leaf in tables[group].values():
                leaf[offset + np.array(rows)] = 0
            plain.load_sparse_opt_state(state._replace(tables=tables))
        want = _step(plain, opts[1], _kjt(users, items, oracle.remap(raw)), dense, labels)
        got = _step(managed, opts[0], _kjt(users, items, raw), dense, labels)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert resets >= 3
    for name, w in plain.table_weights().items():
        np.testing.assert_allclose(
            managed.table_weights()[name].numpy(), w.numpy(), rtol=1e-6, atol=1e-7, err_msg=name
        )
    occupancy, admitted, displaced = np.asarray(managed.managed_collision_stats()["users"]).tolist()
    assert occupancy == sum(e["raw"] is not None for e in oracle.entries) == Z - 1
    assert admitted > Z - 1 and displaced == admitted - (Z - 1)


def test_eval_reads_the_id_maps_and_leaves_tables_and_maps_as_they_were():
    module = MCHManagedCollisionModule(Z, history_capacity=128)
    model = hybrid.Model(_tables(), _dense(0), managed_collision_modules={"users": module})
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    batches = list(_batches(3))
    for users, items, dense, labels in batches:
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    before = {k: v.clone() for k, v in model.table_weights().items()}
    stats = np.asarray(model.managed_collision_stats()["users"]).tolist()
    model.eval()
    users, items, dense, _ = batches[0]
    unseen = [[2**62 + 1], [], [5], [-(2**63)]]
    with torch.no_grad():
        seen = model(dense, _kjt(users, items, [int(i) for b in users for i in b]))
        fresh = model(dense, _kjt(unseen, items, [2**62 + 1, 5, -(2**63)]))
    assert seen.shape == fresh.shape == (4, 1)
    assert np.asarray(model.managed_collision_stats()["users"]).tolist() == stats
    for name, w in model.table_weights().items():
        torch.testing.assert_close(w, before[name], rtol=0, atol=0)


def test_raw_ids_of_an_unmanaged_table_are_refused():
    module = MCHManagedCollisionModule(Z, history_capacity=128)
    model = hybrid.Model(_tables(), _dense(0), managed_collision_modules={"users": module})
    keys, values, lengths = _kjt([[1]], [np.array([2**40])], [1])
    with pytest.raises(
        ValueError,
        match=r"^id 1099511627776 at feature 'item', batch position 0, index 0 in the bag "
        r"is a raw 64-bit id but its table has no managed-collision module; give the "
        r"table one "
        r"\(managed_collision_modules\) or map its ids into the table's rows$",
    ):
        model(torch.zeros(1, 3), (keys, values, lengths))
    with pytest.raises(
        ValueError,
        match=r"^feature 'item' \(table 'items', num_embeddings=10\): id 10 at batch "
        r"position 0, index 0 in the bag is outside \[0, 10\)",
    ):
        model(torch.zeros(1, 3), _kjt([[1]], [np.array([ITEMS])], [1]))


def test_the_pipelined_step_remaps_one_batch_ahead_and_trains_as_the_plain_loop():
    """The pipeline prepares (profiles, remaps) batch i+1 while step i runs; batch i+1's
    evicted rows are reset only at its own lookup, after step i's update."""
    module = MCHManagedCollisionModule(Z, history_capacity=128, eviction_policy="lru")
    batches = [
        (dense, _kjt(users, items, [int(i) for b in users for i in b]), labels)
        for users, items, dense, labels in _batches(25, seed=4)
    ]
    loss_fn = lambda logits, labels: torch.nn.functional.binary_cross_entropy_with_logits(  # noqa: E731
        logits.squeeze(-1), labels
    )
    plain = hybrid.Model(_tables(), _dense(1), managed_collision_modules={"users": module}, seed=5)
    piped = hybrid.Model(_tables(), _dense(1), managed_collision_modules={"users": module}, seed=5)
    opt = torch.optim.SGD(plain.dense_parameters(), lr=0.2)
    want = []
    for dense, sparse, labels in batches:
        want.append(_step(plain, opt, sparse, dense, labels))
    pipeline = hybrid.TrainPipeline(
        piped, torch.optim.SGD(piped.dense_parameters(), lr=0.2), loss_fn
    )
    it, got = iter(batches), []
    while True:
        try:
            got.append(float(pipeline.progress(it).detach()))
        except StopIteration:
            break
    pipeline.close()
    assert got == want
    for name, w in plain.table_weights().items():
        torch.testing.assert_close(piped.table_weights()[name], w, rtol=0, atol=0)
    assert np.asarray(piped.managed_collision_stats()["users"])[2] > 0  # resident ids were evicted


def test_an_export_serves_raw_ids_through_the_frozen_map_as_eval_does(tmp_path):
    """The exported artifact maps raw ids with the id map as it was at export (ids it does
    not hold read the default row), and scores requests as the model in eval mode."""
    module = MCHManagedCollisionModule(Z, history_capacity=128)
    model = hybrid.Model(_tables(), _dense(0), managed_collision_modules={"users": module})
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    batches = list(_batches(12, seed=2))
    for users, items, dense, labels in batches:
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    users, items, dense, _ = batches[-1]
    users = [
        *users[:2],
        [2**62 + 1, int(users[0][0]) if len(users[0]) else 5],
        [-(2**63)],
    ]  # unseen ids too
    sparse = _kjt(users, items, [int(i) for b in users for i in b])
    model.eval()
    with torch.no_grad():
        want = model(dense, sparse)
    ids, rows, defaults = model.sparse_module.frozen_maps()["users"]
    assert (
        len(ids) == Z - 1
        and sorted(rows.tolist()) == list(range(Z - 1))
        and defaults.tolist() == [Z - 1]
    )
    path = hybrid.export(model, tmp_path / "mc", example=(dense, sparse))
    manifest = json.loads((path / "manifest.json").read_text())
    entry = {t["name"]: t for t in manifest["tables"]}
    assert entry["users"]["managed_collision"] == {
        "file": "id_maps/00_users.npz",
        "resident": Z - 1,
        "default_row": Z - 1,
        "shards": 1,
        "default_rows": [Z - 1],
    }
    assert entry["items"]["managed_collision"] is None
    predictor = hybrid.serving.load(path)
    torch.testing.assert_close(predictor(dense, sparse), want, rtol=1e-6, atol=1e-6)
    pooled = predictor.pooled({"user": [[2**62 + 3]] * 4, "item": [[1]] * 4})
    table = model.table_weights()["users"]
    torch.testing.assert_close(
        pooled[:, :DIM], table[Z - 1].expand(4, DIM)
    )  # unseen: the default row
    with zipfile.ZipFile(
        path / "id_maps/00_users.npz", "a"
    ) as z:  # a changed map is refused by its checksum
        z.writestr("extra.npy", b"")
    with pytest.raises(hybrid.serving.ArtifactError, match=r"id_maps/00_users\.npz"):
        hybrid.serving.load(path)


def test_an_eval_batch_larger_than_any_training_batch_leaves_training_running():
    """The per-table id capacity grows with eval batches too, but a training window only
    ever gets the training shape (a window of 32 ids, eval batches of 64 ids)."""
    module = MCHManagedCollisionModule(Z, history_capacity=32)
    model = hybrid.Model(_tables(), _dense(0), managed_collision_modules={"users": module})
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    small = list(_batches(3, batch=4))
    for users, items, dense, labels in small[:2]:
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    users, items, dense, _ = next(_batches(1, seed=9, batch=40))
    model.eval()
    with torch.no_grad():
        model(dense, _kjt(users, items, [int(i) for b in users for i in b]))
    model.train()
    users, items, dense, labels = small[2]
    _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    users, items, dense, labels = next(
        _batches(1, seed=9, batch=40)
    )  # a training batch that large is refused
    with pytest.raises(
        ValueError,
        match=r"1 batches of 64 id positions \(padding to the capacity rung included\) "
        r"may exceed history_capacity=32",
    ):
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)


@pytest.mark.parametrize(
    "plan", [None, {"users": "row_wise", "items": "data_parallel"}], ids=["one_device", "row_wise"]
)
def test_a_quantized_copy_maps_raw_ids_through_the_frozen_maps_and_exports_them(tmp_path, plan):
    """fp16 rows: the quantized model reads what the float model reads in eval (a resident
    id its row, an unseen id its shard's default row), and its export serves the same."""
    module = MCHManagedCollisionModule(16, history_capacity=128)
    tables = [
        EmbeddingBagConfig(
            name="users", num_embeddings=16, embedding_dim=DIM, feature_names=["user"]
        ),
        _tables()[1],
    ]
    mesh = hybrid.make_mesh("data=2,model=4") if plan else None
    model = hybrid.Model(
        tables, _dense(0), mesh=mesh, plan=plan, managed_collision_modules={"users": module}
    )
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    batches = list(_batches(8, seed=4, batch=8))
    for users, items, dense, labels in batches:
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    users, items, dense, _ = batches[-1]
    users = [*users[:5], [2**62 + 1, 2**40 + 7], [-(2**63)], []]  # unseen ids, an empty bag
    sparse = _kjt(users, items, [int(i) for b in users for i in b])
    model.eval()
    with torch.no_grad():
        want = model(dense, sparse)
    qmodel = hybrid.quantize(model, "fp16")
    assert set(qmodel.id_maps) == {"users"} and qmodel.id_maps["users"].shards == (4 if plan else 1)
    with torch.no_grad():
        got = qmodel(dense, sparse)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    path = hybrid.export(qmodel, tmp_path / "q", example=(dense, sparse))
    torch.testing.assert_close(hybrid.serving.load(path)(dense, sparse), got, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"^id 2\*\*63 - 1 at feature 'user'"):
        qmodel(dense, _kjt([[2**63 - 1]] * 8, items, [2**63 - 1] * 8))


def test_reserved_ids_a_quantized_copy_and_a_map_loaded_onto_another_device_are_handled(tmp_path):
    from hybrid import checkpoint

    module = MCHManagedCollisionModule(Z, history_capacity=128)
    model = hybrid.Model(_tables(), _dense(0), managed_collision_modules={"users": module})
    with pytest.raises(
        ValueError,
        match=r"^id 2\*\*63 - 1 at feature 'user', batch position 1, index 0 in the bag is "
        r"reserved \(it marks an empty slot of a managed-collision table\); map it "
        r"to another id$",
    ):
        model(
            torch.zeros(2, 3),
            _kjt([[5], [2**63 - 1]], [np.array([1]), np.array([2])], [5, 2**63 - 1]),
        )
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    for users, items, dense, labels in _batches(4):
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    path = checkpoint.save_checkpoint(tmp_path, step=4, model=model, dense_optimizer=opt)
    elsewhere = jax.sharding.Mesh(np.array(jax.devices()[1:2]), ("data",))  # the tables on device 1
    other = hybrid.Model(
        _tables(), _dense(0), mesh=elsewhere, managed_collision_modules={"users": module}
    )
    oopt = torch.optim.SGD(other.dense_parameters(), lr=0.1)
    checkpoint.load_checkpoint(path, model=other, dense_optimizer=oopt)  # before any step
    users, items, dense, labels = next(_batches(1, seed=3))
    _step(other, oopt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    assert {
        d.id for leaf in jax.tree.leaves(other.sparse_module.mc_state) for d in leaf.devices()
    } == {1}


def test_the_host_split_of_raw_ids_matches_a_plain_loop_and_names_bad_ids():
    """`split_managed` (the prepare's host split, by feature spans): every position's owner,
    placeholder and raw id as a loop over the batch says; a reserved id and an unmanaged id
    that does not fit int32 are refused at the first such position."""
    from hybrid.model._batch import as_host_kjt
    from sparse_jax.managed import ManagedCollisionEmbeddingBagCollection
    from sparse_jax.managed._batch import raw_words_into, split_managed, split_raw_ids

    module = MCHManagedCollisionModule(Z, history_capacity=128)
    model = hybrid.Model(_tables(), _dense(0), managed_collision_modules={"users": module})
    mc = model.sparse_module.managed().mc
    assert isinstance(mc, ManagedCollisionEmbeddingBagCollection)
    for users, items, _, _ in _batches(6, seed=4, batch=5):
        user_values = [int(i) for b in users for i in b]
        kjt = as_host_kjt(_kjt(users, items, user_values))
        split = split_managed(kjt, mc)
        item_values = [int(i) for b in items for i in b]
        want_owner = ["users"] * len(user_values) + [""] * len(item_values)
        assert split.owner().tolist() == want_owner
        assert split.raw.tolist() == user_values + item_values
        assert split.ids.values().tolist() == [0] * len(user_values) + item_values
        assert split.positions("users").tolist() == list(range(len(user_values)))
        assert split.raw_of("users").tolist() == user_values
        assert split.positions("items").tolist() == []  # not managed
        ids, raw, owner = split_raw_ids(kjt, mc)
        assert owner.tolist() == want_owner and raw.tolist() == split.raw.tolist()
        words = np.full((len(user_values) + 2, 2), 7, np.int32)
        raw_words_into(words, split.raw_of("users"))
        want = [
            [v >> 32, np.int64(v & 0xFFFFFFFF).astype(np.uint32).view(np.int32)]
            for v in user_values
        ]
        assert words[: len(user_values)].tolist() == want and (words[len(user_values) :] == 7).all()
    items = [np.array([1]), np.array([2**40]), np.array([-(2**40)])]
    with pytest.raises(
        ValueError,
        match=r"^id 1099511627776 at feature 'item', batch position 1, index 0 in the bag is a "
        r"raw 64-bit id but its table has no managed-collision module",
    ):
        split_managed(as_host_kjt(_kjt([[5], [6], [7]], items, [5, 6, 7])), mc)
    with pytest.raises(ValueError, match=r"^id 2\*\*63 - 1 at feature 'user', batch position 2"):
        split_managed(as_host_kjt(_kjt([[5], [6], [2**63 - 1]], items, [5, 6, 2**63 - 1])), mc)
