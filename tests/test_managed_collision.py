"""Managed collision (`sparse_jax.MCHManagedCollisionModule`): raw 64-bit ids to table slots,
against a plain-Python oracle (tests/reference.py) over long random streams, and against
TorchRec's own `MCHManagedCollisionModule` where torchrec is installed."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import MCHManagedCollisionModule, RawIds, hashed_slots, host_hashed_slots
from tests.reference import ManagedCollisionLoop

BATCH = 24


def _stream(seed, steps, pool=60):
    """Batches of raw int64 ids: a skewed pool of 64-bit values (high words set, negatives)."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-(2**62), 2**62, size=pool, dtype=np.int64)
    values[:3] = [5, 2**32 + 5, -1]  # equal low words, and the id -1
    weights = 1.0 / np.arange(1, pool + 1) ** 1.1
    for _ in range(steps):
        yield values[rng.choice(pool, size=BATCH, p=weights / weights.sum())]


def _compiled(mc):
    return jax.jit(mc.profile), jax.jit(mc.remap)


@pytest.mark.parametrize(
    ("policy", "settings", "interval", "threshold", "zch", "steps"),
    [
        ("lru", {}, 1, 1, 16, 150),
        ("lfu", {}, 1, 1, 16, 150),
        ("lru", {}, 3, 2, 12, 150),
        ("lfu", {}, 2, 3, 9, 150),
        # (the exponent 1.0 against TorchRec below, 0.5 through the collection)
        ("distance_lfu", {"decay_exponent": 2.0}, 3, 2, 12, 120),
        ("ttl", {"single_ttl": 2}, 1, 1, 16, 120),
        ("ttl", {"single_ttl": 5}, 2, 2, 12, 120),
        ("ttl", {"single_ttl": 1}, 3, 1, 9, 120),
    ],
)
def test_long_streams_match_the_loop_oracle(policy, settings, interval, threshold, zch, steps):
    """Slots, evicted slots (the rows a step resets) and remapped ids equal the oracle's every
    step, over a stream that fills the map (zch - 1 ids) and evicts from it."""
    mc = MCHManagedCollisionModule(
        zch,
        history_capacity=BATCH * interval,
        eviction_policy=policy,
        eviction_interval=interval,
        threshold=threshold,
        **settings,
    )
    oracle = ManagedCollisionLoop(zch, policy, interval, threshold, **settings)
    assert _against_the_oracle(mc, oracle, _stream(seed=zch, steps=steps)) >= zch


def test_ttl_takes_only_expired_rows():
    """Two rows for ids; 1 and 2 resident. 3 finds no expired row (the default row) until 1
    has gone unseen for more than single_ttl=2 steps; 2, seen every step, keeps its row."""
    mc = MCHManagedCollisionModule(3, history_capacity=4, eviction_policy="ttl", single_ttl=2)
    state, seen = mc.init(), []
    for batch in ([1, 2], [2, 3], [2, 3], [2, 3]):
        state, evicted = mc.profile(state, RawIds.from_int64(np.array(batch)))
        seen.append(np.asarray(mc.remap(state, RawIds.from_int64(np.array([1, 2, 3])))).tolist())
    # step 4: 1 was last seen at step 1 (4 - 1 > 2): 3 takes its slot 0, which is reset
    assert seen == [[0, 1, 2], [0, 1, 2], [0, 1, 2], [2, 1, 0]]
    assert np.asarray(evicted).tolist() == [True, False, False]


def _against_the_oracle(mc, oracle, batches) -> int:
    """Profile and remap every batch (raw int64 ids) with `mc` and `oracle`, asserting the
    same slots and evicted slots each step; the evictions counted."""
    profile, remap = _compiled(mc)
    state, evictions = mc.init(), 0
    for step, batch in enumerate(batches):
        ids = RawIds.from_int64(batch)
        state, evicted = profile(state, ids)
        expected = oracle.profile([int(i) for i in batch])
        assert set(np.flatnonzero(np.asarray(evicted)).tolist()) == expected, step
        np.testing.assert_array_equal(
            remap(state, ids), oracle.remap([int(i) for i in batch]), err_msg=str(step)
        )
        evictions += len(expected)
    return evictions


@pytest.mark.parametrize(
    ("policy", "interval", "zch", "batch", "pool"),
    [
        ("lru", 1, 1000, 256, 3000),
        ("lfu", 1, 1000, 256, 3000),
        ("lru", 3, 300, 200, 900),
        ("lfu", 2, 4096, 1500, 20000),
    ],
)
def test_large_maps_match_the_loop_oracle(policy, interval, zch, batch, pool):
    """Maps of many blocks (the two-level search), windows of many radix digits, and
    contests among thousands of tied scores (LFU counts of 1 and 2, LRU steps)."""
    mc = MCHManagedCollisionModule(
        zch, history_capacity=batch * interval, eviction_policy=policy, eviction_interval=interval
    )
    rng = np.random.default_rng(zch)
    values = rng.integers(-(2**63), 2**63 - 1, size=pool, dtype=np.int64)
    values[:4] = [0, -1, 2**32, -(2**63)]
    weights = 1.0 / np.arange(1, pool + 1) ** 0.8
    batches = (values[rng.choice(pool, size=batch, p=weights / weights.sum())] for _ in range(12))
    evictions = _against_the_oracle(mc, ManagedCollisionLoop(zch, policy, interval), batches)
    assert evictions > zch  # filled (zch - 1 ids), then resident ids evicted


def test_an_empty_batch_is_a_step_that_admits_nothing():
    mc = MCHManagedCollisionModule(4, history_capacity=6, eviction_interval=1)
    state, evicted = mc.profile(mc.init(), RawIds.from_int64(np.zeros(0, np.int64)))
    assert int(state.step) == 1 and int(state.last_eviction) == 1 and not np.asarray(evicted).any()
    assert int(state.window_used) == 0


def test_padding_is_not_seen():
    mc = MCHManagedCollisionModule(4, history_capacity=6, eviction_policy="lfu")
    ids = RawIds.from_int64(np.array([7, 7, 9, 9, 9, 9]))
    state, evicted = mc.profile(
        mc.init(), ids, valid=np.array([True, True, True, False, False, False])
    )
    # 7 seen twice, 9 once (the padded 9s are not counted): the free entries that lose to them
    # are the later ones, best new id first (TorchRec's order), so 7 -> 1 and 9 -> 2
    assert np.asarray(mc.remap(state, RawIds.from_int64(np.array([7, 9, 8])))).tolist() == [1, 2, 3]
    assert np.asarray(evicted).tolist() == [False, True, True, False]


def test_an_id_evicted_and_seen_again_gets_a_fresh_slot():
    mc = MCHManagedCollisionModule(3, history_capacity=2, eviction_policy="lru")  # two ids fit
    state = mc.init()
    seen = []
    # 3 evicts 2 (1 and 2 were last seen together: the earlier entry wins the tie); 2 comes
    # back and evicts 1, the least recent, taking slot 0: a slot the caller resets
    for batch in ([1, 2], [3, 3], [2, 2]):
        state, evicted = mc.profile(state, RawIds.from_int64(np.array(batch)))
        seen.append(
            (
                np.flatnonzero(np.asarray(evicted)).tolist(),
                np.asarray(mc.remap(state, RawIds.from_int64(np.array([1, 2, 3])))).tolist(),
            )
        )
    assert seen == [([0, 1], [0, 1, 2]), ([1], [0, 2, 1]), ([0], [2, 0, 1])]


def test_before_the_first_eviction_every_id_takes_the_default_slot():
    mc = MCHManagedCollisionModule(8, history_capacity=6, eviction_interval=2)
    state, evicted = mc.profile(mc.init(), RawIds.from_int64(np.array([1, 2, 3])))
    assert not np.asarray(evicted).any()
    assert np.asarray(mc.remap(state, RawIds.from_int64(np.array([1, 2, 3])))).tolist() == [7, 7, 7]
    assert mc.default_slot == 7


def test_raw_ids_round_trip_every_64_bit_value_and_refuse_what_does_not_fit():
    ids = np.array([0, 1, -1, 2**31, 2**32, -(2**63), 2**63 - 2, 123456789012345], np.int64)
    words = RawIds.from_int64(ids)
    assert words.hi.dtype == np.int32 and words.lo.dtype == np.uint32
    np.testing.assert_array_equal(words.to_int64(), ids)
    for bad, message in [
        (np.array([1.0]), "RawIds.from_int64: ids must be integers, got dtype float64"),
        (
            np.array([2**63], np.uint64),
            "RawIds.from_int64: uint64 ids above 2**63 - 1 do not fit int64",
        ),
        (
            np.array([3, 2**63 - 1], np.int64),
            "RawIds.from_int64: id 2**63 - 1 at position 1 is reserved (it marks an empty slot)",
        ),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            RawIds.from_int64(bad)


def test_settings_are_checked():
    name = "MCHManagedCollisionModule"
    for kwargs, message in [
        ({"zch_size": 1}, "zch_size=1 must be an int >= 2 (one row is the default row)"),
        ({"history_capacity": 0}, "history_capacity=0 must be an int >= 1"),
        ({"eviction_interval": True}, "eviction_interval=True must be an int >= 1"),
        ({"threshold": 0}, "threshold=0 must be an int >= 1"),
        (
            {"eviction_policy": "fifo"},
            "eviction_policy='fifo'; choose one of ['lru', 'lfu', 'distance_lfu', 'ttl']",
        ),
        (
            {"eviction_policy": "distance_lfu", "decay_exponent": -0.5},
            "decay_exponent=-0.5 must be a finite number >= 0",
        ),
        ({"decay_exponent": float("nan")}, "decay_exponent=nan must be a finite number >= 0"),
        ({"decay_exponent": True}, "decay_exponent=True must be a finite number >= 0"),
        (
            {"eviction_policy": "ttl"},
            "single_ttl=None must be an int >= 1 with eviction_policy='ttl' (training calls "
            "an id may go unseen before its row may be taken)",
        ),
        (
            {"eviction_policy": "ttl", "single_ttl": 0},
            "single_ttl=0 must be an int >= 1 with eviction_policy='ttl' (training calls "
            "an id may go unseen before its row may be taken)",
        ),
        (
            {"single_ttl": 3},
            "single_ttl=3 is for eviction_policy='ttl', not 'lru'; leave it out",
        ),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(f"{name}: {message}") + "$"):
            MCHManagedCollisionModule(**{"zch_size": 4, "history_capacity": 4, **kwargs})
    mc = MCHManagedCollisionModule(4, history_capacity=5, eviction_interval=2)
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            f"{name}: 2 batches of 3 id positions (padding to the capacity rung included) may exceed "
            "history_capacity=5; give history_capacity >= positions per batch * eviction_interval (nothing a window "
            "holds is ever dropped)"
        )
        + "$",
    ):
        mc.profile(mc.init(), RawIds.from_int64(np.array([1, 2, 3])))


def test_hashed_slots_stay_in_range_and_spread_ids_that_differ_only_in_the_high_word():
    ids = RawIds.from_int64((np.arange(4000, dtype=np.int64) << 32) | 7)  # one low word
    slots = np.asarray(hashed_slots(ids, 100))
    assert slots.dtype == np.int32 and slots.min() >= 0 and slots.max() < 100
    assert np.bincount(slots, minlength=100).max() < 80  # ~40 per slot, not one slot
    np.testing.assert_array_equal(hashed_slots(ids, 100), slots)  # deterministic
    assert (np.asarray(hashed_slots(ids, 100, seed=1)) != slots).mean() > 0.9
    with pytest.raises(
        ValueError,
        match="^" + re.escape("hashed_slots: num_embeddings=0 must be an int >= 1") + "$",
    ):
        hashed_slots(ids, 0)
    some = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, 4096, dtype=np.int64)
    some[:3] = [0, -1, -(2**63)]
    for n, seed in [
        (2, 0),
        (7, 0),
        (100, 1),
        (2**31 - 1, 2**32 - 1),
    ]:  # numpy on the host: the same slots
        got = host_hashed_slots(some, n, seed=seed)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, hashed_slots(RawIds.from_int64(some), n, seed=seed))


@pytest.mark.parametrize(
    ("policy", "decay_exponent"),
    [("lru", 1.0), ("lfu", 1.0), ("distance_lfu", 1.0), ("distance_lfu", 2.0)],
)
def test_matches_torchrec_mch_module(policy, decay_exponent):
    """The same stream through TorchRec's MCHManagedCollisionModule (CPU) with its LRU, LFU
    and DistanceLFU policies: after every batch the same slot for every id of the batch (so
    the same resident ids where the batch has them) and the same slots evicted (no threshold:
    TorchRec's filters are relative, not a fixed count)."""
    torch = pytest.importorskip("torch")
    mc_modules = pytest.importorskip("torchrec.modules.mc_modules")
    from torchrec.sparse.jagged_tensor import JaggedTensor

    zch = 16
    eviction = {
        "lru": mc_modules.LRU_EvictionPolicy,
        "lfu": mc_modules.LFU_EvictionPolicy,
        "distance_lfu": lambda: mc_modules.DistanceLFU_EvictionPolicy(decay_exponent),
    }[policy]()
    theirs = mc_modules.MCHManagedCollisionModule(
        zch_size=zch, device=torch.device("cpu"), eviction_policy=eviction, eviction_interval=2
    )
    theirs.train()
    mc = MCHManagedCollisionModule(
        zch,
        history_capacity=2 * BATCH,
        eviction_policy=policy,
        eviction_interval=2,
        decay_exponent=decay_exponent,
    )
    profile, remap = _compiled(mc)
    state = mc.init()
    for step, batch in enumerate(_stream(seed=7, steps=60)):
        values = torch.from_numpy(batch)
        out = theirs(
            {"t": JaggedTensor(values=values, lengths=torch.ones_like(values, dtype=torch.int32))}
        )
        state, evicted = profile(state, RawIds.from_int64(batch))
        np.testing.assert_array_equal(
            remap(state, RawIds.from_int64(batch)), out["t"].values().numpy(), err_msg=str(step)
        )
        gone = theirs.evict()
        assert set(np.flatnonzero(np.asarray(evicted)).tolist()) == set(
            () if gone is None else gone.tolist()
        ), step


def test_words_carry_every_64_bit_id_through_a_kjt():
    ids = np.array([-(2**63), -1, 0, 2**32 - 1, 2**63 - 2], np.int64)
    words = RawIds.from_int64(ids).words()
    assert words.dtype == np.int32 and words.shape == (5, 2)
    back = jax.jit(RawIds.from_words)(words)
    np.testing.assert_array_equal(RawIds(*back).to_int64(), ids)


def _words_kjt(u, v, p):
    """KJT (keys u, v, p; one bag per sample) of raw id words: u and v raw ids, p plain rows."""
    from sparse_jax import KeyedJaggedTensor

    bags = [*u, *v, *p]
    flat = np.concatenate([np.asarray(b, np.int64) for b in bags])
    return KeyedJaggedTensor(
        ["u", "v", "p"],
        RawIds.from_int64(flat).words(),
        lengths=np.array([len(b) for b in bags], np.int32),
    ), flat


@pytest.mark.parametrize(
    ("policy", "settings"),
    [("lfu", {}), ("distance_lfu", {"decay_exponent": 0.5}), ("ttl", {"single_ttl": 2})],
)
def test_the_collection_remaps_each_managed_table_as_one_stream_and_resets_what_it_evicts(
    policy, settings
):
    from sparse_jax import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        ManagedCollisionEmbeddingBagCollection,
        optim,
    )

    tables = [
        EmbeddingBagConfig(8, 4, "m", feature_names=["u", "v"]),
        EmbeddingBagConfig(5, 4, "plain", feature_names=["p"]),
    ]
    ebc = EmbeddingBagCollection(tables)
    module = MCHManagedCollisionModule(8, history_capacity=16, eviction_policy=policy, **settings)
    mc = ManagedCollisionEmbeddingBagCollection(ebc, {"m": module})
    params = ebc.init(jax.random.key(0))
    rule = optim.adagrad(lr=0.1)
    opt = rule.init(params)
    opt = opt._replace(
        tables=jax.tree_util.tree_map(lambda x: x + 1.0, opt.tables)
    )  # state to be reset
    oracle = ManagedCollisionLoop(8, policy, **settings)
    remap = jax.jit(mc.remap)
    state = mc.init_state()
    rng = np.random.default_rng(3)
    pool = rng.integers(-(2**60), 2**60, size=12)
    for step in range(12):
        u = [pool[rng.integers(0, 12, rng.integers(0, 3))] for _ in range(2)]
        v = [pool[rng.integers(0, 12, rng.integers(1, 3))] for _ in range(2)]
        p = [rng.integers(0, 5, 2) for _ in range(2)]
        kjt, flat = _words_kjt(u, v, p)
        slots, state, evicted = remap(kjt.pad(capacity=16), state)
        managed = [int(i) for b in [*u, *v] for i in b]
        want_evicted = oracle.profile(managed)
        want = oracle.remap(managed) + [int(i) for b in p for i in b]
        np.testing.assert_array_equal(
            np.asarray(slots.values())[: len(flat)], want, err_msg=str(step)
        )
        assert set(np.flatnonzero(np.asarray(evicted["m"])).tolist()) == want_evicted, step
        new_params, new_opt = mc.reset_evicted(params, opt, evicted, jax.random.key(1000 + step))
        group, offset = ebc.layout.table_group["m"]
        rows = offset + np.array(sorted(want_evicted), int)
        kept = np.setdiff1d(np.arange(params[group].shape[0]), rows)
        np.testing.assert_array_equal(
            np.asarray(new_params[group])[kept], np.asarray(params[group])[kept]
        )
        state_leaf = np.asarray(new_opt.tables[group]["momentum1"])
        assert (state_leaf[rows] == 0).all() and (
            state_leaf[kept] == np.asarray(opt.tables[group]["momentum1"])[kept]
        ).all()
        fresh = np.asarray(new_params[group])[rows]
        bound = tables[0].weight_init_max
        assert (np.abs(fresh) <= bound).all() and not np.isin(
            fresh, np.asarray(params[group])
        ).any()
        params, opt = new_params, new_opt
    assert (
        len(oracle.remap(list(pool))) == 12 and sum(s != 7 for s in oracle.remap(list(pool))) == 7
    )  # full table


def test_the_collection_refuses_what_it_cannot_manage():
    from sparse_jax import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        ManagedCollisionEmbeddingBagCollection,
    )

    name = "ManagedCollisionEmbeddingBagCollection"
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(8, 4, "a", feature_names=["f"]),
            EmbeddingBagConfig(6, 4, "b", feature_names=["f", "g"]),
        ]
    )
    for modules, message in [
        (
            {"z": MCHManagedCollisionModule(8, history_capacity=4)},
            "no table 'z' in the collection (tables: ['a', 'b'])",
        ),
        (
            {"a": MCHManagedCollisionModule(9, history_capacity=4)},
            "table 'a' has 8 rows but its module's zch_size is 9; make them equal",
        ),
        (
            {"a": MCHManagedCollisionModule(8, history_capacity=4)},
            "feature 'f' feeds tables ['a', 'b']; a managed table "
            "needs features of its own (one slot per id and table)",
        ),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(f"{name}: {message}") + "$"):
            ManagedCollisionEmbeddingBagCollection(ebc, modules)


def test_lfu_counts_saturate_instead_of_wrapping():
    mc = MCHManagedCollisionModule(4, history_capacity=8, eviction_policy="lfu")
    ids = RawIds.from_int64(np.array([11, 12, 13]))
    state, _ = mc.profile(mc.init(), ids)  # all three admitted
    state = state._replace(
        counts=jnp.where(
            state.counts < np.iinfo(np.int32).max, np.iinfo(np.int32).max - 1, state.counts
        )
    )
    state, _ = mc.profile(state, RawIds.from_int64(np.array([11, 11, 11, 12])))
    top = np.iinfo(np.int32).max
    assert sorted(np.asarray(state.counts).tolist()) == [
        top - 1,
        top,
        top,
        top,
    ]  # 13 unseen; 11, 12 saturated
    assert sorted(np.asarray(mc.remap(state, ids)).tolist()) == [0, 1, 2]  # nobody evicted


def test_a_map_switched_to_another_policy_on_load_keeps_its_residents():
    """`adopt_metadata`: a map saved under LRU loaded for LFU has counts 1 at its resident
    entries (not 0, below every new id), and one saved under LFU loaded for TTL has last
    access at its step (not 0, expired); the unkept column is zeroed. So the next eviction
    admits no new id over the loaded residents, as it would after one more sighting."""
    ids = RawIds.from_int64(np.array([11, 12, 13, 14, 15]))
    new = RawIds.from_int64(np.array([21, 22, 23]))
    for saved_as, loaded_as, settings in (("lru", "lfu", {}), ("lfu", "ttl", {"single_ttl": 1})):
        saved = MCHManagedCollisionModule(8, history_capacity=8, eviction_policy=saved_as)
        state, _ = saved.profile(saved.init(), ids)
        state, _ = saved.profile(state, RawIds(ids.hi[:2], ids.lo[:2]))
        loaded = MCHManagedCollisionModule(
            8, history_capacity=8, eviction_policy=loaded_as, **settings
        )
        adopted = loaded.adopt_metadata(state)
        resident = np.asarray(state.sorted_hi) != np.iinfo(np.int32).max
        assert resident.sum() == 5
        if loaded_as == "lfu":
            kept, dropped = adopted.counts, adopted.last_access
            np.testing.assert_array_equal(kept[resident], 1)
        else:
            kept, dropped = adopted.last_access, adopted.counts
            np.testing.assert_array_equal(kept[resident], int(state.step))
        assert not kept[~resident].any() and not dropped.any()
        # 7 entries, 5 held: the two free ones go to new ids, no resident loses its slot
        after, evicted = loaded.profile(jax.tree.map(jnp.asarray, adopted), new)
        assert np.asarray(evicted).sum() == 2, (saved_as, loaded_as)
        assert int(loaded.remap(after, ids).max()) < 7  # every loaded id still resident
