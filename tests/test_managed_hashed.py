"""The hashed form of a managed-collision map (`sparse_jax.managed._hashed`), how a map trains
on CPU: every training call gives the sorted kernel's slots, counts and evicted rows bit for
bit (and the plain-loop oracle's slots), its sorted form (`to_sorted`) is the sorted kernel's
state after the same calls, the conversions are exact both ways, and a
`ManagedCollisionSparseModule` trains the same numbers with it and without it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionSparseModule,
    MCHManagedCollisionModule,
    MCHState,
    RawIds,
    _kernels,
)
from sparse_jax.managed import _hashed
from sparse_jax.optim import rowwise_adagrad
from tests.reference import ManagedCollisionLoop
from tests.test_managed_kernel import STREAM_CASES, _stream

pytestmark = pytest.mark.skipif(
    not _kernels.available(), reason="the CPU kernels cannot be built here"
)


@pytest.fixture
def two_threads():
    """The kernels' threaded passes run (torch's OpenMP runtime is theirs: the suite's one
    torch thread would leave them unrun)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _forms(mc):
    """(sorted training call, hashed training call, to_hashed, to_sorted, hashed eval), jitted."""
    return (
        jax.jit(mc.profile_remap),
        jax.jit(functools.partial(_hashed.profile_remap, mc), donate_argnums=0),  # in place
        jax.jit(functools.partial(_hashed.to_hashed, mc)),
        jax.jit(functools.partial(_hashed.to_sorted, mc)),
        jax.jit(functools.partial(_hashed.remap, mc)),
    )


def _same_state(a: MCHState, b: MCHState, what: str) -> None:
    for field, x, y in zip(MCHState._fields, a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{field} {what}")


def _marked(mask, mc) -> np.ndarray:
    """The sorted form's evicted mask as the hashed form gives it: the rows, then fill."""
    limit = min(mc.zch_size, mc.history_capacity)
    return np.asarray(jnp.nonzero(mask, size=limit, fill_value=mc.zch_size)[0])


def _run_both(mc, batches, *, oracle=None):
    """Every call of `batches` ((raw int64, valid) pairs) through both forms, compared; the
    last (counts, rows) of the hashed form."""
    sorted_call, hashed_call, to_hashed, to_sorted, hashed_eval = _forms(mc)
    s_state = mc.init()
    h_state = to_hashed(s_state)
    _same_state(to_sorted(h_state), s_state, "fresh")
    for step, (raw, valid) in enumerate(batches):
        ids = RawIds.from_int64(raw)
        s_state, mask, s_counts, s_slots = sorted_call(s_state, ids, valid)
        h_state, rows, h_counts, h_slots = hashed_call(h_state, ids, valid)
        np.testing.assert_array_equal(np.asarray(h_slots), np.asarray(s_slots), f"slots {step}")
        np.testing.assert_array_equal(np.asarray(h_counts), np.asarray(s_counts), f"counts {step}")
        np.testing.assert_array_equal(np.asarray(rows), _marked(mask, mc), f"rows {step}")
        _same_state(to_sorted(h_state), s_state, f"step {step}")
        np.testing.assert_array_equal(
            np.asarray(hashed_eval(h_state, ids)), np.asarray(mc.remap(s_state, ids)), str(step)
        )
        if oracle is not None:
            evicted = oracle.profile([int(i) for i, v in zip(raw, valid, strict=True) if v])
            assert set(np.asarray(rows)[np.asarray(rows) < mc.zch_size].tolist()) == evicted
            np.testing.assert_array_equal(np.asarray(h_slots), oracle.remap([int(i) for i in raw]))
    return h_counts, rows


@pytest.mark.parametrize(
    ("policy", "interval", "threshold", "zipf", "zch", "batch", "pool", "steps"), STREAM_CASES
)
def test_the_hashed_form_makes_the_sorted_forms_every_decision(
    two_threads, policy, interval, threshold, zipf, zch, batch, pool, steps
):
    """Every call: the batch's slots (padding included), the counts, the evicted rows, the
    eval lookup and the whole sorted state equal the sorted kernel's, and the slots and
    evicted rows the loop oracle's, as ids are admitted, evicted and come back (small maps:
    ties everywhere). "ttl:N": the TTL policy with single_ttl=N."""
    policy, _, ttl = policy.partition(":")
    settings = {"single_ttl": int(ttl)} if ttl else {}
    mc = MCHManagedCollisionModule(
        zch,
        history_capacity=batch * interval,
        eviction_policy=policy,
        eviction_interval=interval,
        threshold=threshold,
        **settings,
    )
    oracle = ManagedCollisionLoop(zch, policy, interval, threshold, **settings)
    _run_both(mc, _stream(zch, steps, batch, pool, zipf), oracle=oracle)


@pytest.mark.parametrize(
    ("policy", "zipf"), [("lru", False), ("lfu", False), ("lfu", True), ("ttl:3", False)]
)
def test_the_hashed_form_makes_the_sorted_forms_decisions_on_a_map_large_enough_to_sample(
    two_threads, policy, zipf
):
    """65,600 slots, 8192 ids a batch: the selection of the weakest slots samples a bound
    (empty entries all tied at first, then turnover), the lookups split over threads."""
    policy, _, ttl = policy.partition(":")
    settings = {"single_ttl": int(ttl)} if ttl else {}
    zch, batch = 65_600, 8192
    mc = MCHManagedCollisionModule(zch, history_capacity=batch, eviction_policy=policy, **settings)
    counts, _ = _run_both(mc, _stream(1, 14, batch, 3 * zch, zipf))
    assert zipf or int(counts[1]) == zch - 1  # uniform ids: the map filled and turned over


def test_the_hashed_form_selects_over_every_slot_when_its_sampled_bound_is_too_low(two_threads):
    """LFU over a full map of 65,599 ids: the ids at the slots the selection samples keep
    count 1 and every other id gets count 2, then 5,000 new ids seen 3 times each take the
    5,000 weakest slots. The sampled guess (count 1) has only the 4,096 sampled slots at it:
    too low, so the selection runs over every slot (the 4,096, then the 904 largest ids at
    count 2), as the sorted form's does."""
    zch = 65_600
    n = zch - 1
    mc = MCHManagedCollisionModule(zch, history_capacity=zch, eviction_policy="lfu")
    sampled_slots = (2 * np.arange(4096) + 1) * n // (2 * 4096)  # the selection's samples

    def padded(ids):
        raw, valid = np.zeros(zch, np.int64), np.zeros(zch, bool)
        raw[: len(ids)], valid[: len(ids)] = ids, True
        return raw, valid

    everyone = np.arange(n, dtype=np.int64) * 7919 - 2**40  # spread over the id range
    # where each id lands once the map is filled: the slots the first call gives them
    s_state, *_ = jax.jit(mc.profile_remap)(mc.init(), *_as_ids(*padded(everyone)))
    slot_of = np.asarray(mc.remap(s_state, RawIds.from_int64(everyone)))
    at_sampled = everyone[np.isin(slot_of, sampled_slots)]
    assert len(at_sampled) == 4096
    fresh = 2**41 + 13 * np.arange(5000)
    batches = [
        padded(everyone),
        padded(np.setdiff1d(everyone, at_sampled)),
        padded(np.repeat(fresh, 3)),
    ]
    _, rows = _run_both(mc, batches)
    assert int((np.asarray(rows) < zch).sum()) == 5000  # every new id won a slot


def _as_ids(raw, valid):
    return RawIds.from_int64(raw), valid


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl"])
def test_empty_entries_holding_metadata_lose_in_their_sorted_order(policy):
    """A loaded map whose empty entries hold metadata (scores tied with resident ids and with
    each other), not in slot order: the hashed form breaks the ties as the sorted form's
    places do (the larger id first, empty entries after every id, the later first)."""
    z, h = 40, 24
    settings = {"single_ttl": 3} if policy == "ttl" else {}
    mc = MCHManagedCollisionModule(z, history_capacity=h, eviction_policy=policy, **settings)
    rng = np.random.default_rng(3)
    ids = np.sort(rng.choice(2**40, size=20, replace=False).astype(np.int64) - 2**39)
    state = mc.init()
    hi = np.full(z, np.iinfo(np.int32).max, np.int32)
    lo = np.full(z, np.iinfo(np.uint32).max, np.uint32)
    words = RawIds.from_int64(ids)
    hi[:20], lo[:20] = np.asarray(words.hi), np.asarray(words.lo)
    slots = np.concatenate([rng.permutation(z - 1), [z - 1]]).astype(np.int32)
    kept = rng.integers(0, 3, size=z).astype(np.int32)  # ties with residents and empties
    kept[-1] = 0
    other = np.zeros(z, np.int32)
    columns = (kept, other) if policy == "lfu" else (other, kept)
    state = state._replace(
        sorted_hi=jnp.asarray(hi),
        sorted_lo=jnp.asarray(lo),
        slots=jnp.asarray(slots),
        counts=jnp.asarray(columns[0]),
        last_access=jnp.asarray(columns[1]),
        step=jnp.asarray(2, jnp.int32),
    )
    sorted_call, hashed_call, to_hashed, to_sorted, _ = _forms(mc)
    s_state, h_state = state, to_hashed(state)
    _same_state(to_sorted(h_state), s_state, "loaded")
    pool = np.concatenate([ids, 2**41 + np.arange(30)])
    for step in range(8):
        raw = pool[rng.integers(0, len(pool), size=h)]
        valid = rng.random(h) < 0.8
        args = (RawIds.from_int64(raw), valid)
        s_state, mask, s_counts, s_slots = sorted_call(s_state, *args)
        h_state, rows, h_counts, h_slots = hashed_call(h_state, *args)
        np.testing.assert_array_equal(np.asarray(h_slots), np.asarray(s_slots), str(step))
        np.testing.assert_array_equal(np.asarray(h_counts), np.asarray(s_counts), str(step))
        np.testing.assert_array_equal(np.asarray(rows), _marked(mask, mc), str(step))
        _same_state(to_sorted(h_state), s_state, f"step {step}")


def test_the_conversions_are_exact_both_ways_and_refuse_a_map_without_its_default_entry():
    mc = MCHManagedCollisionModule(300, history_capacity=128, eviction_policy="lru")
    _, _, to_hashed, to_sorted, _ = _forms(mc)
    state = mc.init()
    call = jax.jit(mc.profile_remap)
    rng = np.random.default_rng(0)
    for fill in range(6):  # fresh, partly filled, full and turning over
        _same_state(to_sorted(to_hashed(state)), state, f"after {fill} batches")
        raw = rng.integers(-(2**62), 2**62, size=128)
        state, *_ = call(state, RawIds.from_int64(raw), np.ones(128, bool))
    assert int(_hashed.to_hashed(mc, state).free_count) == 0  # the map is full
    assert _hashed.buckets(300) == 1024  # a power of two, at least twice the slots
    swapped = np.asarray(state.slots).copy()
    swapped[[0, -1]] = swapped[[-1, 0]]
    with pytest.raises(Exception, match="default slot"):
        jax.block_until_ready(to_hashed(state._replace(slots=jnp.asarray(swapped))))


def _module(hashed, policy="lru", items="distance_lfu"):
    tables = [
        EmbeddingBagConfig(name="users", num_embeddings=50, embedding_dim=4, feature_names=["u"]),
        EmbeddingBagConfig(name="items", num_embeddings=40, embedding_dim=4, feature_names=["i"]),
    ]
    modules = {
        "users": MCHManagedCollisionModule(50, history_capacity=64, eviction_policy=policy),
        "items": MCHManagedCollisionModule(40, history_capacity=64, eviction_policy=items),
    }
    mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables), modules)
    return ManagedCollisionSparseModule(mc, hashed=hashed)


def _batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**62), 2**62, size=120)
    for _ in range(steps):
        raw = pool[rng.integers(0, 120, 32)]
        yield KeyedJaggedTensor(
            ["u", "i"], RawIds.from_int64(raw).words(), lengths=np.ones(32, np.int32)
        )


@pytest.mark.parametrize(("policy", "items"), [("lru", "distance_lfu"), ("lfu", "lru")])
def test_a_managed_module_trains_the_same_numbers_with_and_without_the_hashed_form(policy, items):
    """Two modules over the same batches, one keeping every map sorted (`hashed=False`): the
    same rows looked up, the same parameters after the resets, the same maps and counters,
    with `mc_state` read between steps (a checkpoint's read), a map loaded midway, maps
    replaced as a whole, and eval batches between training batches. One hashed table beside
    a sorted one (distance_lfu has no kernel), then two hashed tables in one program."""
    modules = {flag: _module(flag, policy, items) for flag in (True, False)}
    hashed = {"users"} if items == "distance_lfu" else {"users", "items"}
    assert modules[True].hashed_tables == hashed
    assert _module(None, policy, items).hashed_tables == frozenset()  # small maps: sorted
    assert modules[False].hashed_tables == frozenset()
    rule = rowwise_adagrad(lr=0.1)
    runs = {}
    for flag, module in modules.items():
        params = module.init(jax.random.key(3))
        opt = rule.init(params)
        seen = []
        for step, kjt in enumerate(_batches(10)):
            batch = module.prepare(kjt)
            params, opt, mapped = module.remap(params, opt, batch)
            seen.append(np.asarray(mapped.kjt.values()))
            seen.append(np.asarray(module.remap_eval(batch).kjt.values()))
            if step == 4:
                saved = jax.tree.map(np.asarray, module.host_state())
            if step == 6:  # back to the map of step 4 (as a checkpoint restores it)
                module.load_mc_state(saved[0], saved[1])
            if step % 3 == 0:
                jax.block_until_ready(module.mc_state)
            if step == 8:  # the maps replaced as a whole (a read is a copy: edit, then assign)
                maps = module.mc_state
                maps["users"] = module.mc.modules["users"].init()
                module.mc_state = maps
        runs[flag] = (seen, params, jax.tree.map(np.asarray, module.host_state()))
        if flag:
            for name in hashed:
                assert isinstance(module._maps[name], _hashed.MCHHashState)  # trains hashed
    (seen_h, params_h, state_h), (seen_s, params_s, state_s) = runs[True], runs[False]
    for step, (a, b) in enumerate(zip(seen_h, seen_s, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"rows of call {step}")
    for name in params_h:
        np.testing.assert_array_equal(np.asarray(params_h[name]), np.asarray(params_s[name]))
    jax.tree.map(np.testing.assert_array_equal, state_h, state_s)


def test_a_ttl_map_trains_hashed_in_a_module():
    tables = [EmbeddingBagConfig(name="t", num_embeddings=30, embedding_dim=4, feature_names=["f"])]
    mc = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables),
        {
            "t": MCHManagedCollisionModule(
                30, history_capacity=16, eviction_policy="ttl", single_ttl=2
            )
        },
    )
    module = ManagedCollisionSparseModule(mc, hashed=True)
    assert module.hashed_tables == {"t"}
    plain = MCHManagedCollisionModule(30, history_capacity=16, eviction_policy="ttl", single_ttl=2)
    state, call = plain.init(), jax.jit(plain.profile_remap)
    params = module.init(jax.random.key(0))
    opt = rowwise_adagrad(lr=0.1).init(params)
    rng = np.random.default_rng(1)
    for _ in range(12):
        raw = rng.integers(0, 60, 16).astype(np.int64)
        kjt = KeyedJaggedTensor(
            ["f"], RawIds.from_int64(raw).words(), lengths=np.ones(16, np.int32)
        )
        params, opt, mapped = module.remap(params, opt, module.prepare(kjt))
        state, _, _, slots = call(state, RawIds.from_int64(raw), np.ones(16, bool))
        np.testing.assert_array_equal(np.asarray(mapped.kjt.values())[:16], np.asarray(slots))
    _same_state(module.mc_state["t"], state, "after 12 calls")


def test_the_hashed_call_reads_a_prepared_batchs_words_as_raw_ids():
    """The training program hands the kernel the prepared batch's `[n, 2]` words as they are
    (no split by XLA): the same state, rows, counts and slots as the ids' two words."""
    mc = MCHManagedCollisionModule(64, history_capacity=32, eviction_policy="lfu")
    call = jax.jit(functools.partial(_hashed.profile_remap, mc))
    by_ids = by_words = _hashed.to_hashed(mc, mc.init())
    for raw, valid in _stream(2, 12, 32, 150, True):
        ids = RawIds.from_int64(raw)
        by_ids, *a = call(by_ids, ids, valid)
        by_words, *b = call(by_words, jnp.asarray(ids.words()), valid)
        for x, y in zip((*by_ids, *a), (*by_words, *b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_conversion_in_the_middle_of_a_window_continues_as_the_sorted_form():
    """Evictions every 3 calls: after every call the sorted map is converted afresh (its
    window part filled), and the next call from that conversion matches the sorted form's."""
    mc = MCHManagedCollisionModule(
        48, history_capacity=3 * 20, eviction_policy="lru", eviction_interval=3, threshold=2
    )
    sorted_call, hashed_call, to_hashed, to_sorted, _ = _forms(mc)
    state = mc.init()
    for step, (raw, valid) in enumerate(_stream(4, 18, 20, 120, True)):
        ids = RawIds.from_int64(raw)
        converted = to_hashed(state)
        _same_state(to_sorted(converted), state, f"converted before {step}")
        state, mask, counts, slots = sorted_call(state, ids, valid)
        converted, rows, h_counts, h_slots = hashed_call(converted, ids, valid)
        np.testing.assert_array_equal(np.asarray(h_slots), np.asarray(slots), str(step))
        np.testing.assert_array_equal(np.asarray(h_counts), np.asarray(counts), str(step))
        np.testing.assert_array_equal(np.asarray(rows), _marked(mask, mc), str(step))
        _same_state(to_sorted(converted), state, f"step {step}")


def test_a_conversion_refuses_slots_that_are_not_a_permutation():
    mc = MCHManagedCollisionModule(16, history_capacity=8)
    state = mc.init()
    twice = np.asarray(state.slots).copy()
    twice[3] = twice[4]  # slot 4 owned twice
    with pytest.raises(Exception, match="not a permutation"):
        jax.block_until_ready(_hashed.to_hashed(mc, state._replace(slots=jnp.asarray(twice))))


def test_the_hashed_training_program_updates_its_maps_in_place_without_copying_them(
    monkeypatch,
):
    """The module's CPU training program on hashed maps: the kernel updates the donated
    buffers in place (XLA would otherwise copy the table and the slot columns every step:
    44 MB at 2^20 slots)."""
    import re

    from benchmarks.gpu_readiness import managed_remap_case
    from sparse_jax.managed._unsharded import RemapSpec, _build

    module, _, _, args = managed_remap_case(history_capacity=64)
    spec = RemapSpec(
        (("u", module.mc.modules["u"], "", 0),), module.mc.reset_plan(module.managed_tables)
    )
    program = _build(spec)
    maps = program.hash(args[2], frozenset({"u"}))
    assert isinstance(maps["u"], _hashed.MCHHashState)
    lowered = program.train.trace(*args[:2], maps, *args[3:]).lower(lowering_platforms=("cpu",))
    text = lowered.compile().as_text()
    assert "HybridrecMchHashProfileRemap" in text
    assert "HybridrecMaskPositions" not in text  # the kernel hands the reset its rows
    buckets = 4 * _hashed.buckets(32)
    assert not re.search(rf"[su]32\[(32|64|{buckets})\]\{{0\}} copy\(", text), re.findall(
        r".*copy\(.*", text
    )


def test_a_reset_refuses_evicted_rows_of_another_length():
    from sparse_jax.managed._reset import RowBlock, reset_rows

    config = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=2, feature_names=["f"])
    params = {"w": jnp.zeros((10, 2))}
    with pytest.raises(ValueError, match=r"table 't'.*shape \(3,\), expected \(4,\)"):
        reset_rows(
            params,
            {},
            {"t": jnp.zeros(3, jnp.int32)},
            jax.random.key(0),
            configs={"t": config},
            limits={"t": 4},
            blocks={"t": [RowBlock("w", 0, 0, 10, 0, 2)]},
        )


def test_maps_of_2_20_slots_or_more_train_hashed_and_smaller_ones_sorted():
    """The default choice (`hashed=None`): the hashed form from `HASHED_MIN_SLOTS` slots on,
    for the kernel's policies; `hashed=True` any size, `False` none."""
    assert _hashed.HASHED_MIN_SLOTS == 1 << 20
    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=z, embedding_dim=2, feature_names=[n])
        for n, z in (("big", 1 << 20), ("small", (1 << 20) - 1), ("dist", 1 << 20))
    ]
    policies = {"big": "lfu", "small": "lru", "dist": "distance_lfu"}

    def build(hashed):
        modules = {
            t.name: MCHManagedCollisionModule(
                t.num_embeddings, history_capacity=8, eviction_policy=policies[t.name]
            )
            for t in tables
        }
        mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables), modules)
        return ManagedCollisionSparseModule(mc, hashed=hashed).hashed_tables

    assert build(None) == {"big"}
    assert build(True) == {"big", "small"}  # distance_lfu has no kernel
    assert build(False) == frozenset()


def _fmix64(k: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer (the kernel's `Mix`), on uint64."""
    with np.errstate(over="ignore"):
        k = k ^ (k >> np.uint64(33))
        k = k * np.uint64(0xFF51AFD7ED558CCD)
        k = k ^ (k >> np.uint64(33))
        k = k * np.uint64(0xC4CEB9FE1A85EC53)
        return k ^ (k >> np.uint64(33))


def test_ids_that_collide_unseeded_spread_over_a_seeded_table_and_the_seed_changes_nothing():
    """A map's hash is seeded when it is hashed: ids chosen so that the unseeded hash sends
    every one of them to bucket 0 (a single probe run as long as they are many) land in short
    runs; and two conversions of one map (two seeds) train the same slots and state."""
    z = 4096
    mc = MCHManagedCollisionModule(z, history_capacity=1024, eviction_policy="lru")
    bits = (_hashed.buckets(z) - 1).bit_length()
    rng = np.random.default_rng(0)
    draws = rng.integers(1, 2**62, size=12_000_000, dtype=np.int64)
    flood = draws[(_fmix64(draws.view(np.uint64)) >> np.uint64(64 - bits)) == 0][:1024]
    assert len(flood) == 1024  # every one in bucket 0 without a seed
    sorted_call, hashed_call, to_hashed, to_sorted, _ = _forms(mc)
    a = to_hashed(mc.init())
    b = to_hashed(mc.init())
    assert not np.array_equal(np.asarray(a.table)[:8], np.asarray(b.table)[:8])  # two seeds
    s_state = mc.init()
    args = (RawIds.from_int64(flood), np.ones(1024, bool))
    s_state, _, _, s_slots = sorted_call(s_state, *args)
    for h_state in (a, b):
        h_state, _, _, h_slots = hashed_call(h_state, *args)
        np.testing.assert_array_equal(np.asarray(h_slots), np.asarray(s_slots))
        _same_state(to_sorted(h_state), s_state, "flooded")
        occupied = np.asarray(h_state.table).reshape(-1, 4)[:, 2] >= 0
        edges = np.flatnonzero(np.diff(np.concatenate([[0], occupied.astype(np.int8), [0]])))
        assert int((edges[1::2] - edges[::2]).max()) < 64  # no run near the 1,024 ids
