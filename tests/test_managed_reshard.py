"""Id maps saved with one split of a managed table loaded with another (`sparse_jax.reshard_id_maps`
and checkpoints): every resident id moves to the shard it hashes to with its count, last
access and row, the eviction windows move with their ids, and a shard that cannot hold its
ids keeps the strongest by the policy."""

import jax
import numpy as np
import pytest
import torch

import dense_torch
import hybrid
from hybrid import checkpoint
from sparse_jax import (
    EmbeddingBagConfig,
    MCHManagedCollisionModule,
    MCHState,
    RawIds,
    hashed_slots,
    reshard_id_maps,
)
from tests.reference import distance_lfu_score
from tests.test_managed_model import _step
from tests.test_managed_sharded import _batches as sharded_batches

Z, ITEMS, DIM = 64, 12, 4
EMPTY = np.iinfo(np.int64).max


def _trained_map(module, steps, seed=0, pool=60, batch=20):
    """A `module` id map after `steps` random training batches (numpy leaves, stacked [1, ...])."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-(2**62), 2**62, size=pool)
    profile = jax.jit(module.profile)
    state = module.init()
    for _ in range(steps):
        state, _ = profile(state, RawIds.from_int64(ids[rng.integers(0, pool, batch)]))
    return MCHState(*(np.asarray(x)[None] for x in state))


def _resident(state, s):
    """{raw id: (slot, count, last access)} of shard s's map."""
    raw = RawIds(state.sorted_hi[s], state.sorted_lo[s]).to_int64()
    return {
        int(r): (int(state.slots[s][i]), int(state.counts[s][i]), int(state.last_access[s][i]))
        for i, r in enumerate(raw)
        if r != EMPTY
    }


def _window(state, s):
    used = int(state.window_used[s])
    raw = RawIds(state.window_hi[s][:used], state.window_lo[s][:used]).to_int64()
    return sorted(zip(raw.tolist(), state.window_step[s][:used].tolist(), strict=True))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_ids_rows_and_windows_move_to_the_shard_their_hash_names_and_back(policy):
    module = MCHManagedCollisionModule(
        Z, history_capacity=64, eviction_policy=policy, eviction_interval=3
    )
    state = _trained_map(
        module, 7, pool=30
    )  # 7 calls: evictions at 3 and 6, one batch in the window
    before = _resident(state, 0)
    assert len(before) >= 20 and int(state.window_used[0]) == 20
    counters = np.array([[len(before), 40, 9]], np.int32)
    split = reshard_id_maps(state, counters, module, 4)
    assert split.dropped == 0 and split.state.sorted_hi.shape == (4, Z // 4)
    owner = dict(
        zip(
            before,
            np.asarray(hashed_slots(RawIds.from_int64(np.array(list(before))), 4)).tolist(),
            strict=True,
        )
    )
    window = _window(state, 0)
    for s in range(4):
        mine = _resident(split.state, s)
        assert set(mine) == {i for i, o in owner.items() if o == s}
        raw = RawIds(split.state.sorted_hi[s], split.state.sorted_lo[s]).to_int64()
        k = len(mine)
        assert (np.diff(raw[:k]) > 0).all() and (
            raw[k:] == EMPTY
        ).all()  # ascending, then the empty entries
        for i, (slot, count, last) in mine.items():
            assert slot < Z // 4 - 1  # never the shard's default slot
            assert (
                split.row_source[s * (Z // 4) + slot] == before[i][0]
            )  # the row moves with its id
            assert (count, last) == before[i][1:]
        assert (
            split.row_source[s * (Z // 4) + Z // 4 - 1] == Z - 1
        )  # every default row: the saved one
        ids = [w for w in window if hashed_slots(RawIds.from_int64(np.array([w[0]])), 4)[0] == s]
        assert _window(split.state, s) == ids
        assert int(split.state.step[s]) == 7 and int(split.state.last_eviction[s]) == 6
    assert split.counters[:, 0].sum() == len(before) and split.counters[0, 1:].tolist() == [40, 9]
    assert split.counters[1:, 1:].sum() == 0
    merged = reshard_id_maps(
        split.state, split.counters, module, 1
    )  # and back: the same map up to slots
    after = _resident(merged.state, 0)
    assert {i: v[1:] for i, v in after.items()} == {i: v[1:] for i, v in before.items()}
    for i, (slot, _, _) in after.items():
        assert split.row_source[merged.row_source[slot]] == before[i][0]
    assert (
        _window(merged.state, 0) == window and merged.counters[0].tolist() == counters[0].tolist()
    )


def test_ids_move_between_even_and_uneven_splits_and_back():
    """50 rows: one map -> 8 shards (ceil blocks 7 x 7 and 1 row: 7 maps, the last block
    none) -> 2 even shards of 25 -> 4 shards of 13, 13, 13, 11 (maps of two sizes) -> one
    map. Each id sits in the map its hash names among the shards holding one, its row
    follows it through every move, and the windows, counts and step come back whole."""
    z = 50
    module = MCHManagedCollisionModule(z, history_capacity=64, eviction_interval=3)
    state = _trained_map(module, 7, pool=14)
    before = _resident(state, 0)
    window = _window(state, 0)
    assert len(before) == 14 and window
    counters = np.array([[len(before), 40, 9]], np.int32)
    moved, source = (state, counters), np.arange(z)
    for shards, sizes in (
        (8, [7] * 7 + [1]),
        (2, [25, 25]),
        (4, [13, 13, 13, 11]),
        (1, [z]),
    ):
        split = reshard_id_maps(*moved, module, shards)
        assert split.dropped == 0 and split.state.sorted_hi.shape == (shards, max(sizes))
        source = source[split.row_source]  # the original row each row now holds
        maps = sum(size >= 2 for size in sizes)
        offsets = np.cumsum([0, *sizes[:-1]])
        owner = (
            np.asarray(hashed_slots(RawIds.from_int64(np.array(list(before))), maps))
            if maps > 1
            else np.zeros(len(before), int)
        )
        for s in range(shards):
            mine = _resident(split.state, s)
            assert set(mine) == {i for i, o in zip(before, owner, strict=True) if o == s}
            for i, (slot, count, last) in mine.items():
                assert slot < sizes[s] - 1  # within its block, never its default slot
                assert source[offsets[s] + slot] == before[i][0]  # the row moved with its id
                assert (count, last) == before[i][1:]
            if sizes[s] >= 2:
                assert source[offsets[s] + sizes[s] - 1] == z - 1  # the saved default row
            assert int(split.state.step[s]) == 7 and int(split.state.last_eviction[s]) == 6
        assert sorted(w for s in range(shards) for w in _window(split.state, s)) == window
        assert split.counters[:, 0].sum() == len(before)
        assert split.counters[0, 1:].tolist() == [40, 9]
        moved = (split.state, split.counters)
    assert {i: v[1:] for i, v in _resident(split.state, 0).items()} == {
        i: v[1:] for i, v in before.items()
    }


@pytest.mark.parametrize(
    ("policy", "settings"),
    [
        ("lru", {}),
        ("lfu", {}),
        ("distance_lfu", {"decay_exponent": 2.0}),
        ("ttl", {"single_ttl": 1}),
    ],
)
def test_a_shard_too_small_for_its_ids_keeps_the_strongest_and_counts_the_rest_evicted(
    policy, settings
):
    """LFU keeps the highest count, LRU and TTL the latest seen, DistanceLFU the highest
    score at the saved step (tests/reference.py's); then the smaller id."""
    module = MCHManagedCollisionModule(16, history_capacity=64, eviction_policy=policy, **settings)
    state = _trained_map(module, 5, seed=3, pool=30)
    step = int(state.step[0])
    before = _resident(state, 0)
    split = reshard_id_maps(
        state, np.array([[len(before), len(before), 0]], np.int32), module, 8
    )  # 1 slot each
    owner = np.asarray(hashed_slots(RawIds.from_int64(np.array(list(before))), 8)).tolist()
    score = {
        i: (
            v[1]
            if policy == "lfu"
            else distance_lfu_score(v[1], v[2], step, 2.0)
            if policy == "distance_lfu"
            else v[2]
        )
        for i, v in before.items()
    }
    kept = set()
    for s in range(8):
        mine = [i for i, o in zip(before, owner, strict=True) if o == s]
        if mine:
            kept.add(min(mine, key=lambda i: (-score[i], i)))  # the strongest, then the smaller id
        assert set(_resident(split.state, s)) == {
            i for i in kept if owner[list(before).index(i)] == s
        }
    assert split.dropped == len(before) - len(kept) > 0
    assert split.counters[0, 2] == split.dropped and split.counters[:, 0].sum() == len(kept)


def _map_of(module, ids, step=3):
    """A one-shard map holding `ids` (after one eviction at `step`), empty window."""
    state = module.init()
    profile = jax.jit(module.profile)
    state = state._replace(step=jax.numpy.int32(step - 1), last_eviction=jax.numpy.int32(step - 1))
    state, _ = profile(state, RawIds.from_int64(np.asarray(ids, np.int64)))
    return MCHState(*(np.asarray(x)[None] for x in state))


def test_leaf_types_default_entries_and_edge_ids_survive_a_split_and_a_merge():
    module = MCHManagedCollisionModule(16, history_capacity=64)
    edge = [2**63 - 2, -(2**63), 0, -1, 2**32 - 1]  # 2**63 - 2: the empty marker's high word
    state = _map_of(module, edge)
    assert len(_resident(state, 0)) == 5
    four = reshard_id_maps(state, np.array([[5, 5, 0]], np.int32), module, 4)
    two = reshard_id_maps(
        four.state, four.counters, module, 2
    )  # shard 1 of 2 takes old shard 1's default row
    for moved, shards in ((four, 4), (two, 2)):
        assert [leaf.dtype for leaf in moved.state] == [np.asarray(leaf).dtype for leaf in state]
        assert moved.counters.dtype == np.int32 and moved.counters[:, 0].sum() == 5
        owners = np.asarray(hashed_slots(RawIds.from_int64(np.array(edge)), shards)).tolist()
        assert {i for s in range(shards) for i in _resident(moved.state, s)} == set(edge)
        for i, o in zip(edge, owners, strict=True):
            assert i in _resident(moved.state, o)
        for s in range(shards):  # the default entry (last) keeps the saved one's metadata
            assert (moved.state.counts[s][-1], moved.state.last_access[s][-1]) == (
                state.counts[0][-1],
                state.last_access[0][-1],
            )
    assert set(hashed_slots(RawIds.from_int64(np.array(edge)), 2).tolist()) == {0, 1}
    assert two.row_source[[7, 15]].tolist() == [
        3,
        7,
    ]  # shard s of 2: the saved default row of shard s of 4
    candidates = 2**40 + np.arange(8, dtype=np.int64)
    owners = np.asarray(hashed_slots(RawIds.from_int64(candidates), 4))
    lone, owner = (
        int(candidates[owners != 0][0]),
        int(owners[owners != 0][0]),
    )  # a map of one id, not shard 0's
    single = reshard_id_maps(_map_of(module, [lone]), np.zeros((1, 3), np.int32), module, 4)
    assert list(_resident(single.state, owner)) == [lone]


def test_splits_that_cannot_hold_the_map_are_refused():
    module = MCHManagedCollisionModule(12, history_capacity=64)
    state = _trained_map(module, 2)
    for shards in (12, 20):  # one row a block or none: no default row
        with pytest.raises(
            ValueError,
            match=rf"^id maps of a table of 12 rows cannot move from 1 to {shards} "
            r"shard\(s\): a map per row block needs at least 2 rows in the first block "
            r"\(one is its default row\); give the table more rows than shards$",
        ):
            reshard_id_maps(state, np.zeros((1, 3), np.int32), module, shards)
    for other in (
        MCHManagedCollisionModule(24, history_capacity=64),
        MCHManagedCollisionModule(12, history_capacity=32),
    ):
        with pytest.raises(
            ValueError,
            match=rf"^the saved id maps hold 12 rows and windows of 64 ids, this table "
            rf"{other.zch_size} rows and history_capacity={other.history_capacity}; "
            r"load them with the saved zch_size and history_capacity \(only the "
            r"split may change\)$",
        ):
            reshard_id_maps(state, np.zeros((1, 3), np.int32), other, 2)
    two = reshard_id_maps(state, np.zeros((1, 3), np.int32), module, 2)
    for field in ("step", "last_eviction"):
        torn = two.state._replace(**{field: np.array([4, 5], np.int32)})
        with pytest.raises(
            ValueError,
            match=r"^the saved id maps of one table disagree on their step or last "
            r"eviction; the checkpoint is not of one run$",
        ):
            reshard_id_maps(torn, two.counters, module, 1)
    small = MCHManagedCollisionModule(12, history_capacity=8, eviction_interval=4)
    ids = np.arange(6, dtype=np.int64) + 2**40
    owner = np.asarray(hashed_slots(RawIds.from_int64(ids), 2))
    ids = np.concatenate(
        [ids[owner == 0][:1].repeat(4), ids[owner == 1][:1].repeat(4)]
    )  # 4 ids a shard
    window = MCHManagedCollisionModule(
        6, history_capacity=8, eviction_interval=4
    ).init()  # a shard of 2
    window = window._replace(window_used=np.int32(8))
    window = window._replace(
        window_hi=RawIds.from_int64(ids).hi,
        window_lo=RawIds.from_int64(ids).lo,
        window_step=np.ones(8, np.int32),
    )
    stacked = MCHState(*(np.stack([np.asarray(x)] * 2) for x in window))
    stacked = stacked._replace(window_used=np.array([4, 4], np.int32))
    one = reshard_id_maps(stacked, np.zeros((2, 3), np.int32), small, 1)  # 4 + 4 fit a window of 8
    assert int(one.state.window_used[0]) == 8
    with pytest.raises(
        ValueError,
        match=r"^the saved eviction windows hold 9 ids for new shard 0, more than its "
        r"history_capacity=8; resume with the saved sharding until the next "
        r"eviction$",
    ):
        reshard_id_maps(
            stacked._replace(window_used=np.array([5, 4], np.int32)),
            np.zeros((2, 3), np.int32),
            small,
            1,
        )


def _model(plan, interval=1, seed=0, rows=Z, history=512, mesh="data=2,model=4"):
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name="users", num_embeddings=rows, embedding_dim=DIM, feature_names=["user"]
        ),
        EmbeddingBagConfig(
            name="items", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["item"]
        ),
    ]
    module = MCHManagedCollisionModule(rows, history_capacity=history, eviction_interval=interval)
    model = hybrid.Model(
        tables,
        dense_torch.DLRM(DIM, 2, 3, [4, DIM], [4, 1]),
        mesh=hybrid.make_mesh(mesh) if plan else None,
        plan=plan,
        managed_collision_modules={"users": module},
        seed=seed,
    )
    return model, torch.optim.SGD(model.dense_parameters(), lr=0.2)


def _id_rows(model):
    """(resident ids ascending, the table row of each) of `model`'s users map."""
    frozen = model.sparse_module.frozen_maps()["users"]
    return frozen.ids, frozen.rows


def _batches(steps, seed=0):
    return sharded_batches(steps, seed=seed, pool=24, shortest=1)


def _kjt(users, items):
    lengths = torch.tensor([len(b) for b in users] + [1] * len(items), dtype=torch.int32)
    values = torch.cat(
        [torch.as_tensor(np.concatenate(users).astype(np.int64)), torch.from_numpy(items)]
    )
    return ["user", "item"], values, lengths


ROW_WISE = {"users": "row_wise", "items": "data_parallel"}


@pytest.mark.parametrize(
    ("saved", "loaded", "rows"),
    [
        ((ROW_WISE,), (None,), Z),
        (({"users": "table_wise", "items": "data_parallel"},), (ROW_WISE,), Z),
        # 66 rows: over 2 shards 33 + 33, over 4 blocks of 17, 17, 17 and 15
        ((ROW_WISE, "data=4,model=2"), (ROW_WISE,), 66),
        ((ROW_WISE,), (ROW_WISE, "data=4,model=2"), 66),
        ((ROW_WISE,), (None,), 66),
    ],
    ids=[
        "row_wise_to_one_device",
        "replicated_to_row_wise",
        "even_to_uneven",
        "uneven_to_even",
        "uneven_to_one_device",
    ],
)
def test_a_checkpoint_loads_onto_another_split_and_reads_every_id_as_before(
    tmp_path, saved, loaded, rows
):
    model, opt = (
        _model(*saved, rows=rows) if len(saved) == 1 else _model(saved[0], rows=rows, mesh=saved[1])
    )
    splits = [getattr(model.sparse_module, "split", {}).get("users")]
    batches = list(_batches(10))
    for users, items, dense, labels in batches:
        _step(model, opt, _kjt(users, items), dense, labels)
    path = checkpoint.save_checkpoint(tmp_path, step=10, model=model, dense_optimizer=opt)
    resumed, ropt = (
        _model(loaded[0], seed=5, rows=rows)
        if len(loaded) == 1
        else _model(loaded[0], seed=5, rows=rows, mesh=loaded[1])
    )
    splits.append(getattr(resumed.sparse_module, "split", {}).get("users"))
    if rows == 66:  # one side even over 2 shards or one device, the other 17, 17, 17, 15
        blocks = {s.block_sizes for s in splits if s is not None}
        assert blocks <= {(33, 33), (17, 17, 17, 15)} and (17, 17, 17, 15) in blocks
    checkpoint.load_checkpoint(path, model=resumed, dense_optimizer=ropt)
    frozen, moved = _id_rows(model), _id_rows(resumed)
    np.testing.assert_array_equal(
        moved[0], frozen[0]
    )  # 24 ids, 8 slots or more per shard: none dropped
    users = [[int(i)] for i in frozen[0]]
    items = np.zeros(len(users), np.int64)
    dense = torch.zeros(len(users), 3)
    for m in (model, resumed):
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            resumed(dense, _kjt(users, items)), model(dense, _kjt(users, items))
        )
    stats = np.asarray(resumed.managed_collision_stats()["users"])
    assert stats.tolist() == np.asarray(model.managed_collision_stats()["users"]).tolist()
    state = checkpoint.sparse_state_arrays(resumed)  # the optimizer state moved with the rows
    want = checkpoint.sparse_state_arrays(model)
    for key in [k for k in want if k.startswith("state/users/")]:
        np.testing.assert_array_equal(state[key][moved[1]], want[key][frozen[1]], err_msg=key)
    resumed.train()
    for users, items, dense, labels in _batches(3, seed=1):  # and training goes on
        _step(resumed, ropt, _kjt(users, items), dense, labels)


def test_a_run_resumed_mid_window_on_another_split_admits_every_id_of_the_window(tmp_path):
    """Eviction every 3 calls: 2 calls on a row-wise mesh fill the window, the 3rd (after a
    resume on one device) admits all 24 ids, as a run on one device throughout does."""
    batches = list(_batches(3, seed=2))
    model, opt = _model(ROW_WISE, interval=3)
    for users, items, dense, labels in batches[:2]:
        _step(model, opt, _kjt(users, items), dense, labels)
    assert np.asarray(model.managed_collision_stats()["users"])[0] == 0  # nothing admitted yet
    path = checkpoint.save_checkpoint(tmp_path, step=2, model=model, dense_optimizer=opt)
    resumed, ropt = _model(None, interval=3)
    checkpoint.load_checkpoint(path, model=resumed, dense_optimizer=ropt)
    single, sopt = _model(None, interval=3)
    for users, items, dense, labels in batches:
        _step(single, sopt, _kjt(users, items), dense, labels)
    users, items, dense, labels = batches[2]
    _step(resumed, ropt, _kjt(users, items), dense, labels)
    want = single.sparse_module.frozen_maps()["users"].ids
    assert len(want) == len({int(i) for b in batches for u in b[0] for i in u})
    np.testing.assert_array_equal(resumed.sparse_module.frozen_maps()["users"].ids, want)


def test_a_checkpoint_of_another_table_size_or_window_is_refused_naming_both(tmp_path):
    model, opt = _model(ROW_WISE)
    for users, items, dense, labels in _batches(2):
        _step(model, opt, _kjt(users, items), dense, labels)
    path = checkpoint.save_checkpoint(tmp_path, step=2, model=model, dense_optimizer=opt)
    smaller, sopt = _model(None, rows=Z // 2)
    with pytest.raises(
        ValueError,
        match=rf"table 'users' is saved as \[{Z}, {DIM}\] but configured as "
        rf"\[{Z // 2}, {DIM}\]",
    ):
        checkpoint.load_checkpoint(path, model=smaller, dense_optimizer=sopt)
    narrower, nopt = _model(None, history=256)
    with pytest.raises(
        ValueError,
        match=rf"table 'users': the saved id maps hold {Z} rows and windows of 512 ids, "
        rf"this table {Z} rows and history_capacity=256",
    ):
        checkpoint.load_checkpoint(path, model=narrower, dense_optimizer=nopt)
