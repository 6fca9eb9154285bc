"""Managed-collision tables on a mesh (`sparse_jax.sharding.ShardedManagedCollisionModule`):
one replicated id map for any placement but row-wise blocks, which trains exactly as
the unsharded model; per-shard maps for a row-wise table, even or not (ids hashed to the
shards holding a map, each its block's rows, as TorchRec), checked against one plain-Python
oracle per shard (tests/reference.py)."""

import json

import jax
import numpy as np
import pytest
import torch

import dense_torch
import hybrid
from hybrid import checkpoint
from hybrid.serving._id_map import frozen_rows
from hybrid.serving._id_map import hashed_slots as serving_hash
from sparse_jax import (
    EmbeddingBagConfig,
    MCHManagedCollisionModule,
    RawIds,
    hashed_slots,
    host_hashed_slots,
)
from tests.reference import ManagedCollisionLoop
from tests.test_export import ROOT, _run
from tests.test_managed_model import _step

Z, ITEMS, DIM = 16, 12, 4
MESH = "data=2,model=4"


def _zeros(key, shape, dtype):  # noqa: ARG001 (fresh rows the test knows)
    return jax.numpy.zeros(shape, dtype)


def _tables(init_fn=None, z=Z):
    return [
        EmbeddingBagConfig(
            name="users",
            num_embeddings=z,
            embedding_dim=DIM,
            feature_names=["user"],
            init_fn=init_fn,
        ),
        EmbeddingBagConfig(
            name="items", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["item"]
        ),
    ]


def _model(plan=None, policy="lru", init_fn=None, managed=True, seed=0, z=Z, mesh=MESH):
    torch.manual_seed(seed)
    modules = (
        {"users": MCHManagedCollisionModule(z, history_capacity=256, eviction_policy=policy)}
        if managed
        else None
    )
    mesh = hybrid.make_mesh(mesh) if plan else None
    model = hybrid.Model(
        _tables(init_fn, z),
        dense_torch.DLRM(DIM, 2, 3, [4, DIM], [4, 1]),
        mesh=mesh,
        plan=plan,
        managed_collision_modules=modules,
        seed=seed,
    )
    return model, torch.optim.SGD(model.dense_parameters(), lr=0.2)


def _batches(steps, seed=0, batch=8, pool=40, shortest=0):
    """(user bags of raw ids, `shortest` to 2 each; item rows; dense; labels) per step."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-(2**62), 2**62, size=pool)
    for _ in range(steps):
        users = [ids[rng.integers(0, pool, rng.integers(shortest, 3))] for _ in range(batch)]
        items = rng.integers(0, ITEMS, batch)
        yield (
            users,
            items,
            torch.from_numpy(rng.normal(size=(batch, 3)).astype(np.float32)),
            torch.from_numpy(rng.integers(0, 2, batch).astype(np.float32)),
        )


def _kjt(users, items, user_values):
    lengths = torch.tensor([len(b) for b in users] + [1] * len(items), dtype=torch.int32)
    values = torch.cat(
        [
            torch.as_tensor(np.asarray(user_values, np.int64)),
            torch.from_numpy(items.astype(np.int64)),
        ]
    )
    return ["user", "item"], values, lengths


@pytest.mark.parametrize(
    "plan",
    [
        {"users": "data_parallel", "items": "table_wise"},
        {"users": "table_wise", "items": "row_wise"},
        {"users": "column_wise", "items": "data_parallel"},
    ],
    ids=["data_parallel", "table_wise", "column_wise"],
)
def test_one_replicated_map_trains_as_the_unsharded_model(plan):
    sharded, sopt = _model(plan)
    assert sharded.sparse_module.split["users"].shards == 1
    single, uopt = _model()
    for users, items, dense, labels in _batches(14):
        sparse = _kjt(users, items, [int(i) for b in users for i in b])
        assert _step(sharded, sopt, sparse, dense, labels) == pytest.approx(
            _step(single, uopt, sparse, dense, labels), rel=1e-5
        )
    for name, w in single.table_weights().items():
        np.testing.assert_allclose(
            sharded.table_weights()[name].numpy(), w.numpy(), rtol=1e-5, atol=1e-6
        )
    assert (
        np.asarray(sharded.managed_collision_stats()["users"]).tolist()
        == np.asarray(single.managed_collision_stats()["users"]).tolist()
    )


@pytest.mark.parametrize(
    ("policy", "z", "mesh", "sizes"),
    [
        ("lru", Z, MESH, (4, 4, 4, 4)),
        ("lfu", Z, MESH, (4, 4, 4, 4)),
        ("lru", 10, MESH, (3, 3, 3, 1)),  # uneven: the last block's one row holds no map
        ("lfu", 18, MESH, (5, 5, 5, 3)),  # uneven: maps of two sizes
        ("lru", 13, "model=8", (2, 2, 2, 2, 2, 2, 1, 0)),  # an empty block too
    ],
    ids=["even_lru", "even_lfu", "10_over_4", "18_over_4_lfu", "13_over_8"],
)
def test_a_row_wise_table_keeps_one_map_per_shard_as_one_oracle_per_shard(policy, z, mesh, sizes):
    """Shard s owns the ids hashing to s (over the shards of at least 2 rows) and its row
    block (TorchRec's ceil(Z / shards) rows a block, even or not), its last row its
    default; a plain model fed the oracles' rows, with the evicted rows reset by hand
    (zero init, zero state), trains to the same tables."""
    plan = {"users": "row_wise", "items": "table_wise"}
    managed, mopt = _model(plan, policy, init_fn=_zeros, z=z, mesh=mesh)
    split = managed.sparse_module.split["users"]
    assert (split.shards, split.rows, split.block_sizes) == (len(sizes), sizes[0], sizes)
    assert split.axes == ("model",)
    offsets = np.cumsum((0, *sizes[:-1])).tolist()
    mapped = sum(size >= 2 for size in sizes)
    plain, popt = _model(plan, policy, init_fn=_zeros, managed=False, z=z, mesh=mesh)
    oracles = [ManagedCollisionLoop(size, policy) for size in sizes[:mapped]]
    resets = 0
    for users, items, dense, labels in _batches(20, seed=1):
        raw = [int(i) for b in users for i in b]
        owner = (
            np.asarray(hashed_slots(RawIds.from_int64(np.array(raw, np.int64)), mapped)).tolist()
            if raw
            else []
        )
        evicted = []
        for s, oracle in enumerate(oracles):
            evicted += [
                offsets[s] + slot
                for slot in oracle.profile([i for i, o in zip(raw, owner, strict=True) if o == s])
            ]
        rows = [offsets[o] + oracles[o].remap([i])[0] for i, o in zip(raw, owner, strict=True)]
        if evicted:
            resets += 1
            weights = plain.table_weights()["users"].clone()
            weights[sorted(evicted)] = 0
            plain.load_state_dict({"embedding_bags.users.weight": weights}, strict=False)
            state = plain.sparse_opt_state
            host = {
                b: {k: np.asarray(v).copy() for k, v in leaves.items()}
                for b, leaves in state.tables.items()
            }
            for buffer, table, start, r0, rn, _, _ in plain.sparse_module.stored_blocks():
                if table == "users":
                    for leaf in host[buffer].values():
                        for r in evicted:
                            if r0 <= r < r0 + rn:
                                leaf[start + r - r0] = 0
            plain.load_sparse_opt_state(state._replace(tables=host))
        want = _step(plain, popt, _kjt(users, items, rows), dense, labels)
        assert _step(managed, mopt, _kjt(users, items, raw), dense, labels) == pytest.approx(
            want, rel=1e-5
        )
    assert resets >= 3
    for name, w in plain.table_weights().items():
        np.testing.assert_allclose(
            managed.table_weights()[name].numpy(), w.numpy(), rtol=1e-5, atol=1e-6
        )
    occupancy = sum(sum(e["raw"] is not None for e in o.entries) for o in oracles)
    assert np.asarray(managed.managed_collision_stats()["users"])[0] == occupancy


def test_the_planners_uneven_row_wise_plan_gets_a_map_per_shard():
    """The planner places a managed table as it places any table: asked for row_wise over
    the model axis, its 10 rows go out as 3, 3, 3, 1, and the table is managed per shard
    (it used to fall back to one replicated map)."""
    from sparse_jax.planner import ParameterConstraints, Planner, Topology

    plan = Planner(
        Topology(axes={"data": 2, "model": 4}),
        {"users": ParameterConstraints(sharding_types=["row_wise"], axes=["model"])},
    ).plan(_tables(z=10), batch_size=8)
    assert [s.row_size for s in plan["users"].shards] == [3, 3, 3, 1]
    model, opt = _model(plan, z=10)
    split = model.sparse_module.split["users"]
    assert (split.shards, split.block_sizes, split.mapped) == (4, (3, 3, 3, 1), 3)
    for users, items, dense, labels in _batches(3, seed=7):
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    assert 0 < int(np.asarray(model.managed_collision_stats()["users"])[0]) <= 6


@pytest.mark.parametrize("z", [Z, 18], ids=["even", "uneven"])
def test_eval_and_a_checkpoint_of_sharded_maps(tmp_path, z):
    plan = {"users": "row_wise", "items": "data_parallel"}
    model, opt = _model(plan, z=z)
    batches = list(_batches(16, seed=2))
    for users, items, dense, labels in batches[:7]:
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    path = checkpoint.save_checkpoint(tmp_path, step=7, model=model, dense_optimizer=opt)
    saved = checkpoint.sparse_state_arrays(model)
    assert saved["mc/users/sorted_hi"].shape == (4, -(-z // 4)) and saved[
        "mc/users/counters"
    ].shape == (4, 3)
    model.eval()
    users, items, dense, _ = batches[0]
    with torch.no_grad():
        model(dense, _kjt(users, items, [int(i) for b in users for i in b]))
    for key, value in checkpoint.sparse_state_arrays(model).items():  # eval changed nothing
        np.testing.assert_array_equal(value, saved[key], err_msg=key)
    model.train()
    for users, items, dense, labels in batches[7:]:
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    resumed, ropt = _model(plan, seed=3, z=z)
    checkpoint.load_checkpoint(path, model=resumed, dense_optimizer=ropt)
    for users, items, dense, labels in batches[7:]:
        _step(resumed, ropt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    want = checkpoint.sparse_state_arrays(model)
    for key, value in checkpoint.sparse_state_arrays(resumed).items():
        np.testing.assert_allclose(value, want[key], rtol=1e-6, atol=1e-7, err_msg=key)


def test_an_export_of_per_shard_maps_serves_raw_ids_as_eval_does(tmp_path):
    """The shards' maps frozen into one: a resident id reads its row, an id no shard holds
    reads the default row of the shard it hashes to, as the sharded model reads them."""
    model, opt = _model({"users": "row_wise", "items": "data_parallel"})
    batches = list(_batches(12, seed=4))
    for users, items, dense, labels in batches:
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    frozen = model.sparse_module.frozen_maps()["users"]
    assert (frozen.default_row, frozen.shards) == (Z // 4 - 1, 4) and len(frozen.ids) > Z // 2
    assert (np.diff(frozen.ids) > 0).all() and len(set(frozen.rows.tolist())) == len(frozen.rows)
    assert all(
        r % (Z // 4) != Z // 4 - 1 for r in frozen.rows.tolist()
    )  # no id holds a shard's default row
    unseen = np.arange(2**40, 2**40 + 64, dtype=np.int64)
    owner = np.asarray(hashed_slots(RawIds.from_int64(unseen), 4))
    assert set(owner.tolist()) == {0, 1, 2, 3}
    np.testing.assert_array_equal(frozen_rows(frozen, unseen), owner * (Z // 4) + Z // 4 - 1)
    some = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, 4096, dtype=np.int64)
    for shards in (
        2,
        3,
        4,
        7,
        2**31 - 1,
    ):  # the server's numpy hash is the training hash, bit for bit
        np.testing.assert_array_equal(
            serving_hash(some, shards), hashed_slots(RawIds.from_int64(some), shards)
        )
    np.testing.assert_array_equal(frozen_rows(frozen, frozen.ids), frozen.rows)
    dense, sparse, want = _eval_request(model, batches[-1], unseen, frozen)
    path = hybrid.export(model, tmp_path / "export", example=(dense, sparse))
    manifest = json.loads((path / "manifest.json").read_text())
    entry = {t["name"]: t for t in manifest["tables"]}["users"]["managed_collision"]
    assert (entry["shards"], entry["default_row"], entry["resident"], entry["default_rows"]) == (
        4,
        Z // 4 - 1,
        len(frozen.ids),
        [3, 7, 11, 15],
    )
    predictor = hybrid.serving.load(path)
    torch.testing.assert_close(predictor(dense, sparse), want, rtol=1e-6, atol=1e-6)
    table = model.table_weights()["users"]
    pooled = predictor.pooled({"user": [[int(i)] for i in unseen[:8]], "item": [[1]] * 8})
    torch.testing.assert_close(
        pooled[:, :DIM], table[torch.from_numpy(owner[:8] * (Z // 4) + Z // 4 - 1)]
    )
    manifest_path = path / "manifest.json"
    del entry["default_rows"]  # as written before default_rows: blocks of default_row + 1 rows
    manifest_path.write_text(json.dumps(manifest))
    assert torch.equal(hybrid.serving.load(path)(dense, sparse), predictor(dense, sparse))
    bad = manifest_path.read_text().replace('"shards": 4', '"shards": 3')
    manifest_path.write_text(bad)
    with pytest.raises(
        hybrid.serving.ArtifactError,
        match=r"table 'users''s id map names 3 shard\(s\) with default "
        r"row 3, which does not split its 16 rows",
    ):
        hybrid.serving.load(path)


def _eval_request(model, batch, unseen, frozen):
    """A request of the last batch's first users, ids never seen, a resident id beside an
    unseen one and the lowest int64, with what the model in eval mode scores for it."""
    users, items, dense, _ = batch
    users = [*users[:5], unseen[:3], [int(frozen.ids[0]), int(unseen[5])], [-(2**63)]]
    sparse = _kjt(users, items, [int(i) for b in users for i in b])
    model.eval()
    with torch.no_grad():
        want = model(dense, sparse)
    return dense, sparse, want


def test_an_export_of_an_uneven_split_serves_raw_ids_as_eval_does(tmp_path):
    """10 rows over 4 shards: maps of 3, 3 and 3 rows (ids hashed over those 3) and a last
    block of one row that holds none; frozen as 3 shards of 3 rows, served as eval reads."""
    z = 10
    model, opt = _model({"users": "row_wise", "items": "data_parallel"}, z=z)
    assert model.sparse_module.split["users"].block_sizes == (3, 3, 3, 1)
    batches = list(_batches(12, seed=4))
    for users, items, dense, labels in batches:
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    frozen = model.sparse_module.frozen_maps()["users"]
    assert (frozen.default_row, frozen.shards) == (2, 3) and len(frozen.ids) == 6
    assert all(r < 9 and r % 3 != 2 for r in frozen.rows.tolist())
    unseen = np.arange(2**40, 2**40 + 64, dtype=np.int64)
    owner = np.asarray(hashed_slots(RawIds.from_int64(unseen), 3))
    np.testing.assert_array_equal(frozen_rows(frozen, unseen), owner * 3 + 2)
    dense, sparse, want = _eval_request(model, batches[-1], unseen, frozen)
    path = hybrid.export(model, tmp_path / "export", example=(dense, sparse))
    entry = {t["name"]: t for t in json.loads((path / "manifest.json").read_text())["tables"]}
    assert (entry["users"]["managed_collision"]["shards"], entry["users"]["num_embeddings"]) == (
        3,
        z,
    )
    torch.testing.assert_close(hybrid.serving.load(path)(dense, sparse), want, rtol=1e-6, atol=1e-6)
    quantized = hybrid.quantize(model, "fp16")  # the same frozen maps, in process
    torch.testing.assert_close(quantized(dense, sparse), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("plan", "z"),
    [
        (None, Z),
        ({"users": "row_wise", "items": "table_wise"}, Z),
        ({"users": "row_wise", "items": "table_wise"}, 18),
    ],
    ids=["one_device", "row_wise", "row_wise_uneven"],
)
def test_steady_managed_steps_read_nothing_prepare_once_and_compile_nothing(plan, z):
    from tests.host_reads import count_host_reads

    model, opt = _model(plan, z=z)
    batches = [
        (dense, _kjt(users, items, [int(i) for b in users for i in b]), labels)
        for users, items, dense, labels in _batches(14, seed=5)
    ]
    loss_fn = lambda logits, labels: torch.nn.functional.binary_cross_entropy_with_logits(  # noqa: E731
        logits.squeeze(-1), labels
    )
    for dense, sparse, labels in batches[
        :4
    ]:  # warm-up: compiles, capacities reach their high-water marks
        _step(model, opt, sparse, dense, labels)
    warm = hybrid.TrainPipeline(model, opt, loss_fn)  # its guarded update is a program of its own
    it = iter(batches[12:])
    for _ in range(2):
        warm.progress(it)
    warm.close()
    model.wait_for_sparse_update()
    counts, before = model.compile_counts(), model.sparse_module.prepare_count
    assert counts["remap"] >= 1
    with count_host_reads() as reads:
        for dense, sparse, labels in batches[4:8]:
            loss = loss_fn(model(dense, sparse), labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
        pipeline = hybrid.TrainPipeline(model, opt, loss_fn)
        it = iter(batches[8:12])
        for _ in range(4):
            pipeline.progress(it)
        with pytest.raises(StopIteration):
            pipeline.progress(it)
    assert reads.sites == [], (
        f"device values read on the host in steady managed steps: {reads.sites}"
    )
    assert model.sparse_module.prepare_count - before == 8
    model.wait_for_sparse_update()
    assert model.compile_counts() == counts


@pytest.mark.parametrize(
    ("plan", "z"),
    [
        ({"users": "row_wise", "items": "row_wise"}, Z),
        ({"users": "row_wise", "items": "row_wise"}, 18),  # blocks of 5, 5, 5, 3
        ({"users": "table_wise", "items": "row_wise"}, Z),
    ],
    ids=["per_shard", "per_shard_uneven", "one_map"],
)
def test_the_all_to_all_input_dist_trains_managed_tables_as_all_gather(plan, z):
    """Each id of a table managed per shard is routed to the shard its hash names, counted
    exactly on the host. The ids are skewed so that an id counted at the wrong shard would
    undercount: every user id hashes to shard 1 and every item row lies in shard 1's block,
    so shard 1 receives both streams."""
    models = []
    for input_dist in ("all_gather", "all_to_all"):
        torch.manual_seed(0)
        model = hybrid.Model(
            _tables(z=z),
            dense_torch.DLRM(DIM, 2, 3, [4, DIM], [4, 1]),
            mesh=hybrid.make_mesh(MESH),
            plan=plan,
            input_dist=input_dist,
            seed=0,
            managed_collision_modules={"users": MCHManagedCollisionModule(z, history_capacity=256)},
        )
        models.append((model, torch.optim.SGD(model.dense_parameters(), lr=0.2)))
    rng = np.random.default_rng(6)
    pool = rng.integers(-(2**62), 2**62, size=400)
    pool = pool[host_hashed_slots(pool, 4) == 1][:40]
    for step in range(12):  # 8 samples a device: 16 user ids and 8 items, all sent to shard 1
        users = [
            pool[rng.integers(2 * step, 2 * step + 8, 2)] for _ in range(64)
        ]  # the ids drift: evictions
        items = rng.integers(ITEMS // 4, 2 * ITEMS // 4, 64)  # shard 1's rows
        dense = torch.from_numpy(rng.normal(size=(64, 3)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, 64).astype(np.float32))
        sparse = _kjt(users, items, [int(i) for b in users for i in b])
        losses = [_step(m, o, sparse, dense, labels) for m, o in models]
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    (gather, _), (routed, _) = models
    for name, w in gather.table_weights().items():
        np.testing.assert_allclose(
            routed.table_weights()[name].numpy(), w.numpy(), rtol=1e-5, atol=1e-6
        )
    assert np.asarray(routed.managed_collision_stats()["users"])[2] > 0
    local = routed.prepare(_kjt(users, items, [int(i) for b in users for i in b])).inner
    # per shard: 16 user ids and 8 items from one device to shard 1; one map: the user ids go
    # to the table's owner, the items to shard 1
    assert local.route_capacity >= (24 if plan["users"] == "row_wise" else 16)


@pytest.mark.parametrize("rows", [4, 3])
def test_a_row_wise_managed_table_of_no_more_rows_than_shards_is_refused_with_all_to_all(rows):
    """4 rows over 4 shards (one a block) or 3 (one, one, one, none): no block holds a map
    (its default row and one more); with all_gather the table keeps one replicated map."""
    tables = [
        EmbeddingBagConfig(
            name="users", num_embeddings=rows, embedding_dim=DIM, feature_names=["user"]
        ),
        _tables()[1],
    ]

    def build(input_dist):
        return hybrid.Model(
            tables,
            dense_torch.DLRM(DIM, 2, 3, [4, DIM], [4, 1]),
            mesh=hybrid.make_mesh(MESH),
            plan={"users": "row_wise", "items": "row_wise"},
            input_dist=input_dist,
            managed_collision_modules={
                "users": MCHManagedCollisionModule(rows, history_capacity=256)
            },
        )

    with pytest.raises(
        ValueError,
        match=r"^managed table 'users' splits its rows into blocks .* without an id map "
        rf"per block \(a map per row block needs at least 2 rows in each of the first "
        rf"blocks: its num_embeddings={rows} must exceed its 4 shards; give it more rows or "
        r"shard it over fewer devices\); .* input_dist='all_gather'$",
    ):
        build("all_to_all")
    assert build("all_gather").sparse_module.split["users"].shards == 1


# an artifact scored where `hybrid` is a bare namespace (its training library never imported)
_FRESH = """
import json, sys, types
hybrid = types.ModuleType("hybrid")
hybrid.__path__ = [sys.argv[1] + "/hybrid"]
sys.modules["hybrid"] = hybrid
import numpy as np, torch
import hybrid.serving
request = json.load(open(sys.argv[2]))
predictor = hybrid.serving.load(request["path"])
np.save(request["out"] + "/scores.npy", predictor(torch.tensor(request["dense"]), request["sparse"]).numpy())
json.dump(sorted(sys.modules), open(request["out"] + "/modules.json", "w"))
"""


@pytest.mark.parametrize(
    ("z", "mesh", "sizes"),
    [
        (18, MESH, (5, 5, 5, 3)),
        (17, "model=8", (3, 3, 3, 3, 3, 2, 0, 0)),  # two empty blocks too
    ],
    ids=["18_over_4", "17_over_8"],
)
def test_quantize_and_export_of_maps_of_two_sizes_serve_raw_ids_as_eval_does(
    tmp_path, z, mesh, sizes
):
    """Maps of two sizes: each shard's unseen ids read its own block's last row (18 over 4:
    rows 4, 9, 14 and 17), in the frozen map, the float export (as eval scores, to 1e-6 as
    an even split's), the quantized model and its export (int8: bit for bit)."""
    model, opt = _model({"users": "row_wise", "items": "data_parallel"}, z=z, mesh=mesh)
    split = model.sparse_module.split["users"]
    assert split.block_sizes == sizes
    for users, items, dense, labels in _batches(12, seed=4):
        _step(model, opt, _kjt(users, items, [int(i) for b in users for i in b]), dense, labels)
    mapped = [s for s, size in enumerate(sizes) if size >= 2]
    defaults = [split.offsets[s] + sizes[s] - 1 for s in mapped]
    frozen = model.sparse_module.frozen_maps()["users"]
    assert frozen.default_rows.tolist() == defaults and frozen.shards == len(mapped)
    assert frozen.default_row == sizes[0] - 1
    assert not set(frozen.rows.tolist()) & set(defaults) and max(frozen.rows) < defaults[-1]
    np.testing.assert_array_equal(frozen_rows(frozen, frozen.ids), frozen.rows)
    unseen = np.arange(2**40, 2**40 + 64, dtype=np.int64)
    owner = np.asarray(hashed_slots(RawIds.from_int64(unseen), len(mapped)))
    np.testing.assert_array_equal(frozen_rows(frozen, unseen), np.asarray(defaults)[owner])
    held = np.asarray(hashed_slots(RawIds.from_int64(frozen.ids), len(mapped)))
    resident = [int(frozen.ids[held == s][0]) for s in mapped]  # one resident id per shard
    fresh = [int(unseen[owner == s][0]) for s in mapped]  # one unseen id per shard
    users = [[r, f] for r, f in zip(resident, fresh, strict=True)]
    users += [[fresh[1]], [-(2**63)], [], [resident[2]]][: 8 - len(users)]
    _, items, dense, _ = next(_batches(1, seed=5))
    sparse = _kjt(users, items, [i for b in users for i in b])
    model.eval()
    with torch.no_grad():
        want = model(dense, sparse)

    path = hybrid.export(model, tmp_path / "float", example=(dense, sparse))
    manifest_path = path / "manifest.json"
    entry = {t["name"]: t for t in json.loads(manifest_path.read_text())["tables"]}["users"]
    assert {
        k: entry["managed_collision"][k] for k in ("shards", "default_row", "default_rows")
    } == {
        "shards": len(mapped),
        "default_row": sizes[0] - 1,
        "default_rows": defaults,
    }
    predictor = hybrid.serving.load(path)
    torch.testing.assert_close(predictor(dense, sparse), want, rtol=1e-6, atol=1e-6)
    table = model.table_weights()["users"]
    for ids, rows in ((resident, frozen_rows(frozen, resident)), (fresh, defaults)):
        pooled = predictor.pooled({"user": [[i] for i in ids], "item": [[1]] * len(ids)})
        torch.testing.assert_close(pooled[:, :DIM], table[torch.as_tensor(rows)], rtol=0, atol=0)

    with torch.no_grad():
        fp16 = hybrid.quantize(model, "fp16")(dense, sparse)
    torch.testing.assert_close(fp16, want, rtol=2e-3, atol=2e-3)
    qmodel = hybrid.quantize(model, "int8")
    assert qmodel.id_maps["users"].default_rows.tolist() == defaults
    with torch.no_grad():
        got = qmodel(dense, sparse)
    qpath = hybrid.export(qmodel, tmp_path / "int8", example=(dense, sparse))
    assert torch.equal(hybrid.serving.load(qpath)(dense, sparse), got)
    request = {  # and in a process without the training library (serving's own id hash)
        "path": str(qpath),
        "out": str(tmp_path),
        "dense": dense.tolist(),
        "sparse": {"user": users, "item": [[int(i)] for i in items]},
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    _run(_FRESH, tmp_path, str(ROOT), str(tmp_path / "request.json"))
    assert torch.equal(torch.from_numpy(np.load(tmp_path / "scores.npy")), got)
    assert not {"sparse_jax", "hybrid.model"} & set(
        json.loads((tmp_path / "modules.json").read_text())
    )

    manifest = json.loads(manifest_path.read_text())  # as an artifact written before default_rows
    del {t["name"]: t for t in manifest["tables"]}["users"]["managed_collision"]["default_rows"]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(
        hybrid.serving.ArtifactError,
        match=rf"table 'users''s id map names {len(mapped)} shard\(s\) with default row "
        rf"{sizes[0] - 1}, which does not split its {z} rows",
    ):
        hybrid.serving.load(path)


@pytest.mark.parametrize("z", [Z, 18], ids=["even", "uneven"])
def test_the_sharded_training_remap_lowered_for_cuda_has_no_conditional(z):
    """18 rows over 4 shards: maps of 5 and 3 rows, both run on every device and one kept by
    a select; the program a GPU would run keeps no `case` and no data-dependent loop."""
    from tests.test_gpu_lowering import audit

    model, opt = _model({"users": "row_wise", "items": "table_wise"}, z=z)
    users, items, dense, labels = next(_batches(1))
    sparse = _kjt(users, items, [int(i) for b in users for i in b])
    _step(model, opt, sparse, dense, labels)
    module, batch = model.sparse_module, model.prepare(sparse)
    program = module._program(True, model.sparse_opt_state)
    args = (
        model.sparse_params,
        model.sparse_opt_state.tables,
        module.mc_state,
        module.mc_counters,
        module.draw_key,
        batch.inner.values,
        batch.words,
        batch.positions,
    )
    got = audit(program.remap.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    assert got["case_or_if"] == 0 and got["dynamic_loops"] == 0, got
    assert got["cpu_custom_calls"] == 0, got
