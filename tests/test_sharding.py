"""Sharded collections equal the unsharded reference: every ShardingType, mixed plans,
meshes of 1, 2, 4 and 8 devices (1-D and 2-D); forward, then tables and optimizer state
after 3 fused updates; replicas stay identical; one compile across steady steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import EmbeddingBagCollection, make_update, optim
from sparse_jax.sharding import ShardingPlan, shard
from tests.cases import random_case

MESHES = {
    "1": ((1,), ("model",)),
    "2": ((2,), ("model",)),
    "4": ((4,), ("model",)),
    "8": ((8,), ("model",)),
    "2x4": ((2, 4), ("data", "model")),
    "4x2": ((4, 2), ("data", "model")),
}
TWO_LEVEL = {"table_row_wise", "table_column_wise", "grid_shard"}


def _mesh(name):
    shape, axes = MESHES[name]
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), axes)


def _run(
    types,
    mesh_name,
    rule,
    *,
    seed=0,
    weighted=True,
    hot_rows=None,
    steps=3,
    kernel="auto",
    **shard_kw,
):
    mesh = _mesh(mesh_name)
    n = mesh.size
    rng = np.random.default_rng(seed)
    case = random_case(
        rng, dims=[8, 8, 4, 16], batch=2 * n, weighted=weighted, rows=(20, 60), hot_rows=hot_rows
    )
    ebc = EmbeddingBagCollection(case.tables, is_weighted=weighted, kernel=kernel)
    sharded = shard(ebc, mesh, types, **shard_kw)
    params, sparams = ebc.init(jax.random.key(seed)), sharded.init(jax.random.key(seed))
    np.testing.assert_allclose(
        ebc.apply(params, case.kjt).values(),
        sharded.apply(sparams, case.kjt).values(),
        rtol=1e-5,
        atol=1e-6,
    )
    ref_update, sh_update = make_update(ebc, rule), make_update(sharded, rule)
    state, sstate = rule.init(params), rule.init(sparams)
    for step in range(steps):
        step_case = random_case(
            np.random.default_rng(100 + step),
            dims=[8, 8, 4, 16],
            batch=2 * n,
            weighted=weighted,
            rows=(20, 60),
            hot_rows=5 if hot_rows else 20,
            shuffle_keys=False,
        )
        kjt = step_case.kjt
        grad = jnp.asarray(rng.normal(size=(2 * n, sum(ebc.layout.output_dims))).astype(np.float32))
        params, state = ref_update(params, state, kjt.pad(capacity=256), grad)
        sparams, sstate = sh_update(sparams, sstate, kjt, grad)
    return ebc, sharded, params, state, sparams, sstate, sh_update


def _check_tables(ebc, sharded, params, sparams):
    want, got = ebc.table_weights(params), sharded.table_weights(sparams)
    for t in want:
        np.testing.assert_allclose(
            got[t], np.asarray(want[t]), rtol=1e-5, atol=1e-6, err_msg=f"table {t}"
        )


def _check_replicas_identical(sparams):
    for name, arr in sparams.items():
        by_index: dict = {}
        for s in arr.addressable_shards:
            key = tuple((sl.start, sl.stop) for sl in s.index)
            by_index.setdefault(key, []).append(np.asarray(s.data))
        for copies in by_index.values():
            for c in copies[1:]:
                np.testing.assert_array_equal(c, copies[0], err_msg=f"replicas of {name} diverged")


# Every ShardingType alone, on a 1-D and a 2-D mesh, trained 3 steps against the unsharded
# collection (tables, optimizer state, identical replicas, one steady compile): with every
# fused optimizer, Adagrad included, in tests/test_plan_independent.py.


MIXED = {"t0": "row_wise", "t1": "table_wise", "t2": "data_parallel", "t3": "table_wise"}


@pytest.mark.parametrize(
    ("mesh_name", "kernel"),
    [("1", "auto"), ("2", "xla"), ("4", "auto"), ("2x4", "xla"), ("4x2", "auto")],
)
def test_mixed_plan_rowwise_adagrad_on_meshes(mesh_name, kernel):
    rule = optim.rowwise_adagrad(lr=0.1)
    ebc, sharded, params, state, sparams, sstate, _ = _run(
        MIXED, mesh_name, rule, seed=3, kernel=kernel
    )
    _check_tables(ebc, sharded, params, sparams)
    _check_replicas_identical(sparams)
    got_state = sharded.table_state(sstate, "momentum1")
    for t in ebc.tables:
        group, off = ebc.layout.table_group[t.name]
        want = np.asarray(state.tables[group]["momentum1"])[off : off + t.num_embeddings]
        np.testing.assert_allclose(
            got_state[t.name][(0, t.embedding_dim)], want, rtol=1e-5, atol=1e-7
        )


def test_skewed_ids_all_in_one_row_block_and_mean_unweighted():
    rule = optim.sgd(lr=0.5)
    types = {"t0": "row_wise", "t1": "row_wise", "t2": "column_wise", "t3": "row_wise"}
    ebc, sharded, params, _, sparams, _, _ = _run(
        types, "2x4", rule, seed=7, weighted=False, hot_rows=3
    )
    _check_tables(ebc, sharded, params, sparams)


def test_hand_plan_json_round_trip_and_pretrained_weights():
    mesh = _mesh("2x4")
    case = random_case(np.random.default_rng(1), dims=[8, 4], batch=8)
    ebc = EmbeddingBagCollection(case.tables)
    plan = ShardingPlan.from_types(
        case.tables, dict(mesh.shape), {"t0": "row_wise", "t1": "column_wise"}
    )
    sharded = shard(ebc, mesh, ShardingPlan.from_json(plan.to_json()))
    pretrained = {
        t.name: np.arange(t.num_embeddings * t.embedding_dim, dtype=np.float32).reshape(
            t.num_embeddings, -1
        )
        for t in case.tables
    }
    sparams = sharded.with_table_weights(sharded.init(jax.random.key(0)), pretrained)
    for name, w in sharded.table_weights(sparams).items():
        np.testing.assert_array_equal(w, pretrained[name])
    params = ebc.with_table_weights(ebc.init(jax.random.key(0)), pretrained)
    np.testing.assert_allclose(
        sharded.apply(sparams, case.kjt).values(), ebc.apply(params, case.kjt).values(), rtol=1e-6
    )


def test_clear_errors():
    mesh = _mesh("2x4")
    case = random_case(np.random.default_rng(1), dims=[8], batch=6)
    ebc = EmbeddingBagCollection(case.tables)
    sharded = shard(ebc, mesh, {"t0": "row_wise"})
    with pytest.raises(ValueError, match="batch size 6 is not divisible by the 8 devices"):
        sharded.apply(sharded.init(jax.random.key(0)), case.kjt)
    good = random_case(np.random.default_rng(1), dims=[8], batch=8).kjt
    sparams = sharded.init(jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"pooled_grad has shape \(8, 3\); expected \[batch, sum of dims\] = \[8, 16\]",
    ):
        make_update(sharded, optim.sgd())(
            sparams, optim.sgd().init(sparams), good, jnp.ones((8, 3), jnp.float32)
        )
    other = ShardingPlan.from_types(case.tables, {"model": 8}, {"t0": "row_wise"})
    with pytest.raises(ValueError, match=r"the plan was made for mesh \{'model': 8\}"):
        shard(ebc, mesh, other)


def test_steady_loop_compiles_once():
    mesh = _mesh("4")
    case = random_case(np.random.default_rng(2), dims=[8], batch=8, max_len=4)
    ebc = EmbeddingBagCollection(case.tables)
    sharded = shard(ebc, mesh, {"t0": "row_wise"})
    rule = optim.rowwise_adagrad(lr=0.1)
    params = sharded.init(jax.random.key(0))
    state = rule.init(params)
    update = make_update(sharded, rule)
    grad = jnp.ones((8, 16), jnp.float32)
    for seed in range(5):
        kjt = random_case(
            np.random.default_rng(seed),
            dims=[8],
            batch=8,
            max_len=4,
            rows=(7, 8),
            shuffle_keys=False,
        ).kjt
        params, state = update(params, state, kjt, grad)
        sharded.apply(params, kjt)
    assert update.compile_count() == 1
    assert sharded._apply_jit._cache_size() == 1


def test_explicit_axes_mesh_from_jax_make_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axis types in JAX 0.10
    case = random_case(np.random.default_rng(4), dims=[8], batch=8)
    ebc = EmbeddingBagCollection(case.tables)
    sharded = shard(ebc, mesh, {"t0": "row_wise"})
    rule = optim.sgd(lr=0.5)
    params, sparams = ebc.init(jax.random.key(0)), sharded.init(jax.random.key(0))
    grad = jnp.ones((8, 16), jnp.float32)
    params, _ = make_update(ebc, rule)(params, rule.init(params), case.kjt, grad)
    sparams, _ = make_update(sharded, rule)(sparams, rule.init(sparams), case.kjt, grad)
    _check_tables(ebc, sharded, params, sparams)


@pytest.mark.parametrize(
    "kind", ["table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard"]
)
def test_all_to_all_input_dist_matches_unsharded(kind):
    rule = optim.adagrad(lr=0.1)
    ebc, sharded, params, state, sparams, sstate, _ = _run(
        {f"t{i}": kind for i in range(4)}, "2x4", rule, seed=5, input_dist="all_to_all"
    )
    assert sharded._route_high_water > 0
    _check_tables(ebc, sharded, params, sparams)
    _check_replicas_identical(sparams)


def test_all_to_all_route_capacity_grows_with_a_skewed_batch_and_never_drops_ids(caplog):
    from sparse_jax import make_ladder

    mesh = _mesh("2x4")
    types = {f"t{i}": "row_wise" for i in range(4)}
    spread = random_case(
        np.random.default_rng(8), dims=[8, 8, 4, 16], batch=16, rows=(40, 41), shuffle_keys=False
    )
    skewed = random_case(
        np.random.default_rng(9),
        dims=[8, 8, 4, 16],
        batch=16,
        rows=(40, 41),
        hot_rows=3,
        max_len=5,
        shuffle_keys=False,
    )  # every id in the first row block
    ebc = EmbeddingBagCollection(spread.tables)
    sharded = shard(ebc, mesh, types, ladder=make_ladder(8, 1 << 12), input_dist="all_to_all")
    rule = optim.rowwise_adagrad(lr=0.1)
    params, sparams = ebc.init(jax.random.key(0)), sharded.init(jax.random.key(0))
    state, sstate = rule.init(params), rule.init(sparams)
    update, supdate = make_update(ebc, rule), make_update(sharded, rule)
    grad = jnp.ones((16, sum(ebc.layout.output_dims)), jnp.float32)
    with caplog.at_level("INFO", logger="hybridrec.sharding"):
        for kjt in (spread.kjt, skewed.kjt):
            np.testing.assert_allclose(
                sharded.apply(sparams, kjt).values(),
                ebc.apply(params, kjt).values(),
                rtol=1e-5,
                atol=1e-6,
            )
            params, state = update(params, state, kjt.pad(capacity=512), grad)
            sparams, sstate = supdate(sparams, sstate, kjt, grad)
    assert any("exceed capacity" in r.getMessage() for r in caplog.records)  # counted on the host
    _check_tables(ebc, sharded, params, sparams)
    capped = shard(
        ebc,
        mesh,
        types,
        ladder=make_ladder(8, 1 << 12),
        input_dist="all_to_all",
        max_route_capacity=8,
    )
    with pytest.raises(ValueError, match="above max_route_capacity=8"):
        capped.apply(capped.init(jax.random.key(0)), skewed.kjt)
    with pytest.raises(ValueError, match="input_dist='scatter' is not one of"):
        shard(ebc, mesh, types, input_dist="scatter")


@pytest.mark.parametrize(
    "plan", [{"a": "row_wise", "b": "table_wise"}, {"a": "column_wise", "b": "data_parallel"}]
)
def test_a_feature_shared_by_two_tables_sharded_matches_unsharded(plan):
    """TorchRec's shared features: 'f' feeds tables a and b, its outputs are 'f@a' and 'f@b';
    forward and a fused update agree sharded and unsharded, and a variable batch per key
    (inverse indices) pools as its expanded batch does."""
    from sparse_jax import EmbeddingBagConfig, KeyedJaggedTensor

    tables = [
        EmbeddingBagConfig(40, 8, "a", feature_names=["f", "g"]),
        EmbeddingBagConfig(30, 4, "b", feature_names=["f"]),
    ]
    ebc = EmbeddingBagCollection(tables)
    sharded = shard(ebc, _mesh("2x4"), plan)
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4, size=16)
    kjt = KeyedJaggedTensor(
        ["f", "g"], rng.integers(0, 30, size=int(lengths.sum())), lengths=lengths
    )
    params, sparams = ebc.init(jax.random.key(0)), sharded.init(jax.random.key(0))
    out, sout = ebc.apply(params, kjt), sharded.apply(sparams, kjt)
    assert out.keys() == sout.keys() == ["f@a", "g", "f@b"]
    np.testing.assert_allclose(sout.values(), out.values(), rtol=1e-5, atol=1e-6)
    # 'f@a' is table a's rows for f's ids: an oracle that does not go through the collection
    weights = ebc.table_weights(params)
    f_ids = np.split(
        np.asarray(kjt.values())[: int(lengths[:8].sum())], np.cumsum(lengths[:8])[:-1]
    )
    want = np.stack(
        [np.asarray(weights["a"])[ids].sum(0) if len(ids) else np.zeros(8) for ids in f_ids]
    )
    np.testing.assert_allclose(out.to_dict()["f@a"], want, rtol=1e-5, atol=1e-6)
    rule = optim.rowwise_adagrad(lr=0.1)
    state, sstate = rule.init(params), rule.init(sparams)
    grad = jnp.asarray(rng.normal(size=(8, 20)).astype(np.float32))
    params, _ = make_update(ebc, rule)(params, state, kjt.pad(capacity=64), grad)
    sparams, _ = make_update(sharded, rule)(sparams, sstate, kjt, grad)
    _check_tables(ebc, sharded, params, sparams)
    vbe = KeyedJaggedTensor(
        ["f", "g"],
        np.array([1, 2, 3, 4, 5]),
        lengths=np.array([2, 1, 1, 1]),
        stride_per_key_per_rank=[[1], [3]],
        inverse_indices=(["f", "g"], np.array([[0] * 8, [0, 1, 2, 0, 1, 2, 0, 1]])),
    )
    expanded = ebc.apply(params, vbe.expand_to_batch()).values()
    np.testing.assert_allclose(ebc.apply(params, vbe).values(), expanded, rtol=1e-6)
    np.testing.assert_allclose(sharded.apply(sparams, vbe).values(), expanded, rtol=1e-5, atol=1e-6)


MIXED_PLANS = {
    # one kind for every table, then mixes: split and unsplit tables in one buffer (column
    # blocks of width 8 beside whole 8-wide tables), row offsets inside a split table
    # (grid, table_column_wise), a replicated table beside split ones
    "column_wise": ("column_wise",) * 4,
    "grid_shard": ("grid_shard",) * 4,
    "row_wise": ("row_wise",) * 4,
    "mixed": ("table_wise", "column_wise", "data_parallel", "grid_shard"),
    "mixed_2": ("column_wise", "table_column_wise", "row_wise", "table_row_wise"),
    # t0's column blocks (16 / 4 devices = 4 wide) and the whole 4-wide t1 share one buffer
    "split_beside_whole": ("column_wise", "table_wise", "data_parallel", "grid_shard"),
}
MIXED_DIMS = {"split_beside_whole": [16, 4, 8, 16]}  # else [8, 16, 8, 16]


@pytest.mark.parametrize(
    ("kinds", "data_type"),
    [(k, "FP32") for k in MIXED_PLANS] + [("mixed", "FP16"), ("mixed_2", "FP16")],
    ids=lambda v: v,
)
def test_sharded_rowwise_adagrad_matches_loops_not_only_the_unsharded_code(kinds, data_type):
    """The sharded update against `tests/reference.py`'s loops directly (the comparisons above
    go through the unsharded collection, which shares the rule code): eps large enough that
    sqrt(s + eps) for sqrt(s) + eps shows, and a column-split row's statistic is the mean of
    g * g over the whole row, not over its block. fp16 tables round to nearest once per
    step (the loops round after each step; one fp16 ulp apart at most)."""
    from tests import reference

    hp = dict(lr=0.5, eps=0.3)
    rule = optim.rowwise_adagrad(**hp, stochastic_rounding=False)
    mesh = _mesh("2x4")
    dims = MIXED_DIMS.get(kinds, [8, 16, 8, 16])
    case = random_case(
        np.random.default_rng(4),
        dims=dims,
        batch=8,
        weighted=True,
        rows=(20, 40),
        data_type=data_type,
    )
    ebc = EmbeddingBagCollection(case.tables, is_weighted=True)
    plan = dict(zip((t.name for t in case.tables), MIXED_PLANS[kinds], strict=True))
    sharded = shard(ebc, mesh, plan)
    sparams = sharded.init(jax.random.key(0))
    weights = {k: np.asarray(v, np.float64) for k, v in sharded.table_weights(sparams).items()}
    states: dict = {}
    sstate, update = rule.init(sparams), make_update(sharded, rule)
    rng = np.random.default_rng(9)
    for step in range(1, 4):
        c = random_case(
            np.random.default_rng(40 + step),
            dims=dims,
            batch=8,
            weighted=True,
            rows=(20, 40),
            hot_rows=4,
            shuffle_keys=False,
        )
        grad = rng.normal(size=(8, sum(ebc.layout.output_dims))).astype(np.float32)
        sparams, sstate = update(sparams, sstate, c.kjt, jnp.asarray(grad))
        blocks, col = {}, 0
        for feature, table, _ in c.features:
            dim = next(t.embedding_dim for t in case.tables if t.name == table)
            blocks[feature], col = grad[:, col : col + dim], col + dim
        reference.fused_step(
            "rowwise_adagrad",
            hp,
            weights,
            states,
            reference.row_gradients(c.features, c.bag_ids, blocks, c.bag_weights),
            step,
        )
        if data_type == "FP16":
            weights = {k: w.astype(np.float16).astype(np.float64) for k, w in weights.items()}
    got = sharded.table_weights(sparams)
    assert {t.name: sharded.plan[t.name].sharding_type.value for t in case.tables} == plan
    assert any(
        s.col_size < t.embedding_dim for t in case.tables for s in sharded.plan[t.name].shards
    ) == (kinds != "row_wise")  # some row really is split over column blocks
    for name, want in weights.items():
        have = np.asarray(got[name], np.float64)
        if data_type == "FP16":
            ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
            np.testing.assert_array_less(np.abs(have - want), ulp * 1.001, err_msg=f"table {name}")
        else:
            np.testing.assert_allclose(have, want, rtol=2e-5, atol=2e-6, err_msg=f"table {name}")


@pytest.mark.parametrize(
    "kinds", ["mixed", "mixed_2", "grid_shard", "column_wise", "split_beside_whole"]
)
def test_every_local_row_finds_its_tables_row_statistic(kinds, monkeypatch):
    """`_row_stat`'s index of each local row of each buffer and coordinate, against the
    buffer's block list read directly: split tables' rows get `base[table] + global row`,
    other tables' rows and the padding slot (-1) get `space.size` (no statistic); each row
    gets its table's full dim (the padding slot: the buffer width). A consistent but wrong
    index (a sign slip in the row offset) still trains right unless two rows collide, so the
    loop comparisons above cannot see it."""
    from sparse_jax.sharding import _row_stat

    dims = MIXED_DIMS.get(kinds, [8, 16, 8, 16])
    case = random_case(np.random.default_rng(4), dims=dims, batch=8, rows=(20, 40))
    ebc = EmbeddingBagCollection(case.tables)
    sharded = shard(
        ebc, _mesh("2x4"), dict(zip((t.name for t in case.tables), MIXED_PLANS[kinds], strict=True))
    )
    static = sharded.static
    space = _row_stat.row_space(static)
    full_dim = {t.name: t.embedding_dim for t in case.tables}
    split = [
        t.name
        for t in case.tables
        if any(s.col_size < t.embedding_dim for s in sharded.plan[t.name].shards)
    ]
    base, size = {}, 0
    for t in case.tables:  # split tables' rows one after another, in table order
        if t.name in split:
            base[t.name], size = size, size + t.num_embeddings
    assert (space.base, space.size, space.dims) == (base, size, {n: full_dim[n] for n in split})
    assert split and (kinds in ("column_wise", "grid_shard") or len(split) < len(case.tables))
    checked = 0
    for buf in static.buffers:
        for c in range(buf.group_size):
            want_index = np.full(buf.rows_per_device + 1, space.size)
            want_dim = np.full(buf.rows_per_device + 1, buf.width)
            for table, coord, local, r0, rn, _, _ in buf.blocks:
                if coord == c:
                    want_dim[1 + local : 1 + local + rn] = full_dim[table]
                    if table in space.base:
                        want_index[1 + local : 1 + local + rn] = (
                            space.base[table] + r0 + np.arange(rn)
                        )
            monkeypatch.setattr(jax.lax, "axis_index", lambda axes, c=c: c)
            unique = jnp.arange(-1, buf.rows_per_device, dtype=jnp.int32)
            index, dim = _row_stat._locate(space, static, buf, unique)
            np.testing.assert_array_equal(
                np.asarray(index), want_index, err_msg=f"{buf.name} coordinate {c}"
            )
            np.testing.assert_array_equal(
                np.asarray(dim), want_dim, err_msg=f"{buf.name} coordinate {c}"
            )
            checked += int((want_index < space.size).sum())
    assert checked >= space.size  # every split row is found at least once (replicas: more)


def test_column_split_rowwise_adagrad_rounds_fp16_rows_as_the_rule_says():
    """The column-split update writes narrow rows through the rule's rounding: a seed repeats
    it bit for bit; another seed, or round-to-nearest, gives other bits in the split table."""
    case = random_case(
        np.random.default_rng(4),
        dims=MIXED_DIMS["split_beside_whole"],
        batch=8,
        weighted=True,
        rows=(20, 40),
        data_type="FP16",
    )
    plan = dict(zip((t.name for t in case.tables), MIXED_PLANS["split_beside_whole"], strict=True))
    grad = np.random.default_rng(9).normal(
        size=(8, sum(t.embedding_dim * len(t.feature_names) for t in case.tables))
    )

    def run(**rounding):
        sharded = shard(EmbeddingBagCollection(case.tables, is_weighted=True), _mesh("2x4"), plan)
        params = sharded.init(jax.random.key(0))
        rule = optim.rowwise_adagrad(lr=0.5, eps=0.3, **rounding)
        state = rule.init(params)
        params, state = make_update(sharded, rule)(
            params, state, case.kjt, jnp.asarray(grad, jnp.float32)
        )
        return np.asarray(sharded.table_weights(params)["t0"]).view(np.uint16)

    seeded = run(seed=1)
    np.testing.assert_array_equal(seeded, run(seed=1))
    assert (seeded != run(seed=2)).any() and (seeded != run(stochastic_rounding=False)).any()


@pytest.mark.parametrize(
    "types",
    [
        {"t0": "row_wise", "t1": "column_wise", "t2": "data_parallel", "t3": "table_wise"},
        {f"t{i}": "grid_shard" for i in range(4)},
        {f"t{i}": "table_row_wise" for i in range(4)},
    ],
)
def test_sharded_init_draws_the_unsharded_weights_block_by_block(types, monkeypatch):
    case = random_case(np.random.default_rng(4), dims=[8, 8, 4, 16], batch=16, rows=(20, 60))
    ebc = EmbeddingBagCollection(case.tables)
    want = {k: np.asarray(v) for k, v in ebc.table_weights(ebc.init(jax.random.key(3))).items()}
    sharded = shard(ebc, _mesh("2x4"), types)

    def whole(*_):  # the sharded init must not build every table on the host first
        raise AssertionError("sharded init called the unsharded collection's init")

    monkeypatch.setattr(EmbeddingBagCollection, "init", whole)
    got = sharded.table_weights(sharded.init(jax.random.key(3)))
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)
