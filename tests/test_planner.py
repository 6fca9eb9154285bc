"""Planner: topology, constraints, properties of every plan, errors, cost formulas, Criteo."""

import random
import time

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sparse_jax._configs import EmbeddingBagConfig, EmbeddingConfig
from sparse_jax.plan import _layout
from sparse_jax.planner import (
    ParameterConstraints,
    Planner,
    PlannerError,
    ShardingPlan,
    ShardingType,
    Topology,
    estimate_collective_bytes,
)
from sparse_jax.planner.__main__ import criteo_tables, main
from sparse_jax.planner._estimate import CostModel, _shard_traffic, _table_traffic

ST = ShardingType
GiB = 2**30


def table(name, rows=1000, dim=16, features=1, cls=EmbeddingBagConfig):
    return cls(
        name=name,
        num_embeddings=rows,
        embedding_dim=dim,
        feature_names=[f"{name}_f{i}" for i in range(features)],
    )


# Topology -----------------------------------------------------------------------------------


def test_topology_defaults_and_from_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    topo = Topology.from_mesh(mesh, device_memory_bytes=GiB)
    assert topo.axes == {"data": 2, "model": 4} and topo.num_devices == 8
    assert topo.intra_host_axes == ("model",) and topo.inter_host_axes == ("data",)
    assert topo.bandwidth("model") == 600 * GiB and topo.bandwidth("data") == 12.5 * GiB
    custom = Topology(
        axes={"data": 2, "model": 4},
        intra_host_axes=("data", "model"),
        axis_bandwidth={"model": 1e9},
    )
    assert custom.bandwidth("data") == 600 * GiB and custom.bandwidth("model") == 1e9
    with pytest.raises(ValueError, match=r"axis_bandwidth names \['tensor'\]"):
        Topology(axes={"model": 4}, axis_bandwidth={"tensor": 1.0})
    with pytest.raises(ValueError, match="device_memory_bytes must be a positive integer"):
        Topology(axes={"model": 4}, device_memory_bytes=0)


# Properties over random setups -------------------------------------------------------------

MESHES = [
    {"model": 4},
    {"data": 2, "model": 4},
    {"data": 2, "model": 2},
    {"a": 2, "b": 2, "c": 2},
    {"model": 1},
    {"data": 4, "model": 1},
]


def _bytes_in(msg: str, after: str) -> int:
    """The byte count written right after `after` in a planner message ("1,234 bytes")."""
    return int(msg.split(after, 1)[1].split(" bytes")[0].replace(",", ""))


def _setup(specs, mesh, budget_mib):
    tables = [
        table(f"t{i}", rows, dim, feats, EmbeddingBagConfig if pooled else EmbeddingConfig)
        for i, (rows, dim, feats, pooled, _) in enumerate(specs)
    ]
    pooling = {f"t{i}": p for i, (*_, p) in enumerate(specs)}
    return tables, pooling, Topology(axes=mesh, device_memory_bytes=budget_mib * 2**20)


specs_strategy = st.lists(
    st.tuples(
        st.integers(1, 300_000),
        st.sampled_from([4, 12, 16, 64, 256]),
        st.integers(1, 3),
        st.booleans(),
        st.floats(0.0, 30.0),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(  # the refusal once compared t2's need with the most free memory on ANY device
    specs=[
        (1, 4, 1, False, 0.0),
        (1, 4, 1, False, 1.0),
        (3, 4, 1, False, 15.0),
        (67, 256, 2, False, 3.0),
        (3, 4, 1, False, 0.0),
        (1, 4, 1, False, 0.0),
        (2, 64, 2, True, 2.0),
    ],
    mesh={"a": 2, "b": 2, "c": 2},
    budget_mib=8,
    batch=8192,
    seed=0,
)
@given(
    specs=specs_strategy,
    mesh=st.sampled_from(MESHES),
    budget_mib=st.sampled_from([8, 64, 4096]),
    batch=st.sampled_from([8, 1000, 8192]),
    seed=st.integers(0, 2**16),
)
def test_every_plan_places_each_table_once_within_budget_and_is_deterministic(
    specs, mesh, budget_mib, batch, seed
):
    tables, pooling, topo = _setup(specs, mesh, budget_mib)
    constraints = {t.name: ParameterConstraints(min_partition=4) for t in tables[::2]}
    planner = Planner(topo, constraints)
    budget = topo.device_memory_bytes
    try:
        plan = planner.plan(tables, batch_size=batch, pooling_factors=pooling)
    except PlannerError as e:
        # The refusal must be true by its own numbers: what it says the table needs is more
        # than the budget (or than what the device it names has left beside the tables placed
        # before it), and at least the weights + row-wise state of its most split layout,
        # counted here by hand.
        msg = str(e)
        if "needs at least" in msg:
            need, left = _bytes_in(msg, "needs at least "), budget
            assert "the budget is" in msg, msg
        else:
            need, left = _bytes_in(msg, "needs "), _bytes_in(msg, "which has only ")
            assert " on device " in msg, msg
        assert need > left, msg
        assert left <= budget and "To fit" in msg
        name = msg.split("'")[1]
        t = next(t for t in tables if t.name == name)
        assert need >= t.num_embeddings * (t.embedding_dim + 1) * 4 / topo.num_devices, msg
        return
    assert list(plan) == [t.name for t in tables]
    plan.validate(tables)  # shards tile each table exactly; layouts follow the conventions
    # Independent oracle: every device holds at least its shards' weights (4 bytes an entry)
    # and row-wise Adagrad state (4 bytes a row), counted from the plan's shards by hand;
    # the planner's totals (which add lookup buffers) cover that and stay within the budget.
    held = [0] * topo.num_devices
    for t in tables:
        ps = plan[t.name]
        for shard in ps.shards:
            for d in _layout.devices_holding(shard.device, ps.axes, topo.axes):
                held[d] += shard.row_size * (shard.col_size + 1) * 4
    totals = plan.device_totals()[0]
    assert all(h <= m <= budget for h, m in zip(held, totals, strict=True)), (held, totals, budget)
    # and the planner's totals are what its cost model charges (stored = recomputed)
    model = CostModel(topology=topo, batch_size=batch)
    mem = sum(model.device_vectors(t, plan[t.name], pooling[t.name])[0] for t in tables)
    assert totals == pytest.approx(list(mem))
    # Same input, same plan; the table order does not matter either.
    assert planner.plan(tables, batch_size=batch, pooling_factors=pooling) == plan
    shuffled = list(tables)
    random.Random(seed).shuffle(shuffled)
    again = planner.plan(shuffled, batch_size=batch, pooling_factors=pooling)
    assert {n: again[n] for n in plan} == dict(plan)
    assert ShardingPlan.from_json(plan.to_json()) == plan


# Constraints -------------------------------------------------------------------------------


def test_constraints_types_axes_pin_and_min_partition():
    topo = Topology(axes={"data": 2, "model": 4})
    tables = [table("a", dim=64), table("b"), table("c"), table("d", dim=64)]
    constraints = {
        "a": ParameterConstraints(sharding_types=["column_wise"], min_partition=16),
        "b": ParameterConstraints(sharding_types=["row_wise"], axes=["model"]),
        "c": ParameterConstraints(pin={"data": 1, "model": 2}),
        "d": ParameterConstraints(sharding_types=["column_wise", "table_wise"], min_partition=64),
    }
    plan = Planner(topo, constraints).plan(tables, batch_size=512)
    assert plan["a"].sharding_type is ST.COLUMN_WISE and all(
        s.col_size >= 16 for s in plan["a"].shards
    )
    assert plan["b"].sharding_type is ST.ROW_WISE and plan["b"].axes == ("model",)
    c = plan["c"]
    assert c.axes == ("data", "model") and c.shards[0].device == (1, 2)
    assert plan["d"].sharding_type is ST.TABLE_WISE  # 64 columns cannot split into blocks of >= 64
    assert "constraints on 'a': sharding_types=['column_wise'], min_partition=16" in plan.explain(
        "a"
    )


def test_group_keeps_tables_on_the_same_devices():
    topo = Topology(axes={"data": 2, "model": 4})
    tables = [table(n, rows=5000) for n in "abcd"]
    group = ParameterConstraints(group="g", sharding_types=["table_wise"])
    plan = Planner(topo, {"a": group, "c": group}).plan(tables, batch_size=1024)
    assert (plan["a"].axes, plan["a"].shards[0].device) == (
        plan["c"].axes,
        plan["c"].shards[0].device,
    )


def test_pooling_factors_change_the_cost_and_are_checked():
    topo = Topology(axes={"model": 4})
    t = [table("a", features=2)]
    light = Planner(topo).plan(t, batch_size=4096, pooling_factors={"a": 1.0})
    heavy = Planner(topo, {"a": ParameterConstraints(pooling_factors=[20.0, 30.0])}).plan(
        t, batch_size=4096
    )
    assert max(heavy.device_totals()[1]) > max(light.device_totals()[1])
    with pytest.raises(PlannerError, match=r"pooling_factors names table\(s\) \['zz'\]"):
        Planner(topo).plan(t, batch_size=8, pooling_factors={"zz": 1.0})
    with pytest.raises(
        PlannerError, match="table 'a': pooling_factors has 1 values for the table's 2 features"
    ):
        Planner(topo, {"a": ParameterConstraints(pooling_factors=[1.0])}).plan(t, batch_size=8)
    with pytest.raises(PlannerError, match="table 'a': constraint pin names \\['tensor'\\]"):
        Planner(topo, {"a": ParameterConstraints(pin={"tensor": 0})}).plan(t, batch_size=8)
    with pytest.raises(PlannerError, match="table 'a': no layout on mesh"):
        Planner(topo, {"a": ParameterConstraints(sharding_types=["grid_shard"])}).plan(
            t, batch_size=8
        )


def test_an_option_that_exactly_fills_a_device_fits():
    # Two table_wise tables on a 2-device mesh with a budget of exactly one table's bytes:
    # the only plan puts one table on each device, filling both to the byte. A byte less
    # and nothing fits.
    tables = [table("a", rows=5000), table("b", rows=5000)]
    pooling = {"a": 1.0, "b": 1.0}
    tw = ParameterConstraints(sharding_types=["table_wise"])
    probe = CostModel(topology=Topology(axes={"model": 2}), batch_size=256)
    one = probe.device_vectors(tables[0], _layout.table_wise(5000, 16, ("model",), (0,)), 1.0)[0]
    exact = int(one.max())
    assert exact == one.max() and exact > 5000 * 17 * 4  # whole bytes, weights + state at least
    fits = Topology(axes={"model": 2}, device_memory_bytes=exact)
    plan = Planner(fits, {"a": tw, "b": tw}).plan(tables, batch_size=256, pooling_factors=pooling)
    assert plan.device_totals()[0] == [exact, exact]
    assert {plan["a"].shards[0].device, plan["b"].shards[0].device} == {(0,), (1,)}
    short = Topology(axes={"model": 2}, device_memory_bytes=exact - 1)
    with pytest.raises(PlannerError, match="needs at least"):
        Planner(short, {"a": tw, "b": tw}).plan(tables, batch_size=256, pooling_factors=pooling)


# Errors ------------------------------------------------------------------------------------


def test_planner_error_names_table_bytes_budget_and_remedy():
    topo = Topology(axes={"data": 2, "model": 4}, device_memory_bytes=64 * 2**20)
    big = table("huge", rows=2_000_000, dim=64)  # 512 MB of fp32 weights
    with pytest.raises(PlannerError) as err:
        Planner(
            topo, {"huge": ParameterConstraints(sharding_types=["table_wise", "data_parallel"])}
        ).plan([big, table("small")], batch_size=1024)
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    # weights 2e6 x 64 x 4 + rowwise state 2e6 x 4 = 520,000,000, plus the lookup buffers
    needed = int(msg.split("needs at least ")[1].split(" bytes")[0].replace(",", ""))
    assert 520_000_000 < needed < 521_000_000
    assert "the budget is 67,108,864 bytes (64.00 MiB) per device" in msg
    assert "To fit: allow row_wise for 'huge' (over ['data', 'model'] it needs" in msg
    assert (
        f"raise device_memory_bytes above 67,108,864 bytes (64.00 MiB) to at least {needed:,}"
        in msg
    )
    # Even row_wise over all 8 devices is too small: the remedy is more devices.
    with pytest.raises(
        PlannerError,
        match=r"table 'larger' needs at least .* To fit: use a mesh of at least "
        r"16 devices \(its weights and optimizer state alone are 1,040,000,000 bytes",
    ):
        Planner(topo).plan([table("larger", rows=4_000_000, dim=64)], batch_size=1024)


def test_planner_error_when_tables_do_not_fit_together():
    topo = Topology(axes={"model": 2}, device_memory_bytes=8 * 2**20)
    tables = [table(f"t{i:02}", rows=40_000, dim=16) for i in range(12)]  # 2.72 MB each with state
    with pytest.raises(PlannerError) as err:
        Planner(topo).plan(tables, batch_size=64)
    msg = str(err.value)
    assert (
        "does not fit beside the tables placed before it: its closest allowed layout, row_wise"
        in msg
    )
    # The device it names is short by its own numbers (each layout needs its bytes on its
    # own devices, not on whichever device has the most room).
    assert " on device model=" in msg and "(of 8,388,608 bytes (8.00 MiB))" in msg
    assert _bytes_in(msg, "needs ") > _bytes_in(msg, "which has only ")
    assert (
        "use a mesh of at least 4 devices (all tables' weights and optimizer state alone are 32,640,000"
        in msg
    )


def test_planner_error_names_the_device_that_falls_short():
    # Both tables are pinned to model=0: 'b' does not fit there beside 'a', though model=1
    # is nearly empty. The refusal must name model=0 and what model=0 has left, not compare
    # b's need with the room on model=1.
    topo = Topology(axes={"model": 2}, device_memory_bytes=16 * 2**20)
    pin = ParameterConstraints(pin={"model": 0})
    tables = [table("a", rows=200_000), table("b", rows=100_000)]
    with pytest.raises(PlannerError) as err:
        Planner(topo, {"a": pin, "b": pin}).plan(tables, batch_size=64)
    msg = str(err.value)
    assert msg.startswith("table 'b' does not fit beside the tables placed before it"), msg
    assert "table_wise over ['model'] at model=0" in msg and " on device model=0, " in msg, msg
    need, left = _bytes_in(msg, "needs "), _bytes_in(msg, "which has only ")
    # counted by hand: fp32 weights + a row-wise Adagrad word per row, 17 x 4 bytes a row
    assert need >= 100_000 * 17 * 4 > left
    assert left <= topo.device_memory_bytes - 200_000 * 17 * 4, msg
    assert "To fit: move or drop the pin={'model': 0} of 'b'" in msg


# Cost formulas -----------------------------------------------------------------------------


def test_estimate_collective_bytes_by_hand():
    mesh = {"data": 2, "model": 4}
    t = table("t", rows=1000, dim=16, features=2)
    b, L, F, D = 800 / 8, 3.0, 2, 16  # local batch 100
    cap = 368  # the smallest capacity rung holding b * L = 300 ids
    lc = 4  # length cap: `length_cap` of twice the average bag, 2 * L / F = 3
    kjt = cap * 4 + F * b * 4  # one device's values + lengths (int32)

    def comm(ps, **kw):
        return estimate_collective_bytes(t, ps, mesh, 800, L, **kw)

    dp = _layout.data_parallel(1000, 16)  # n = 1, r = 8, M = F
    assert comm(dp) == {
        "input_dist": 0,
        "output_dist": 0,
        "backward": 7 * F * b * (lc * 12 + D * 4),
    }
    tw = _layout.table_wise(1000, 16, ("model",), (2,))  # n = 4, r = 2, M = F
    assert comm(tw) == {
        "input_dist": 3 * kjt,
        "output_dist": 3 * F * b * D * 4,
        "backward": 3 * kjt + 3 * F * b * D * 4 + 1 * 4 * F * b * (lc * 12 + D * 4),
    }
    rw = _layout.row_wise(1000, 16, ("data", "model"), mesh)  # n = 8, r = 1
    assert comm(rw) == {
        "input_dist": 7 * kjt,
        "output_dist": 7 * F * b * D * 4,
        "backward": 7 * kjt + 7 * F * b * D * 4,
    }
    # Weights travel with the ids; a given longest bag sets the length cap (5 -> 8).
    assert comm(rw, weighted=True)["input_dist"] == 7 * (kjt + cap * 4)
    assert comm(tw, max_bag_length=5)["backward"] == (
        3 * kjt + 3 * F * b * D * 4 + 1 * 4 * F * b * (8 * 12 + D * 4)
    )
    cw = _layout.column_wise(1000, [8, 8], ("model",), [(0,), (0,)])  # both blocks on one device
    assert comm(cw)["output_dist"] == 3 * (2 * F) * b * 8 * 4  # one buffer, M = 2 blocks x F
    seq = table("s", rows=1000, dim=16, features=2, cls=EmbeddingConfig)  # a row per position
    assert estimate_collective_bytes(seq, tw, mesh, 800, L)["output_dist"] == 3 * F * b * lc * D * 4


def test_two_level_types_move_what_one_level_types_over_the_same_axes_move():
    # The sharded collection has no hierarchical reduce: table_row_wise over (data, model)
    # runs the same collectives as row_wise over (data, model), so the same bytes on each axis.
    topo = Topology(axes={"data": 2, "model": 4})
    t = table("t", rows=100_000, dim=64)
    rw = _layout.row_wise(100_000, 64, ("data", "model"), topo.axes)
    twrw = _layout.table_row_wise(100_000, 64, ("data", "model"), 0, topo.axes)
    assert estimate_collective_bytes(t, rw, topo.axes, 8192, 1.0) == estimate_collective_bytes(
        t, twrw, topo.axes, 8192, 1.0
    )
    assert _table_traffic(t, rw, topo.axes, 8192, 1.0) == _table_traffic(
        t, twrw, topo.axes, 8192, 1.0
    )
    # Only holders are charged: each of twrw's 4 holders carries 2 devices' worth (8 / 4).
    model = CostModel(topology=topo, batch_size=8192)

    def charged(ps):
        return [
            sum(v for phase in shard.values() for v in phase.values())
            for shard in _shard_traffic(t, ps, topo.axes, 8192, 1.0)
        ]

    per_rw, per_twrw = charged(rw), charged(twrw)
    assert per_twrw == pytest.approx([2 * per_rw[0]] * 4)
    assert sum(per_twrw) == pytest.approx(sum(per_rw))
    assert max(model.shard_costs(t, twrw, 1.0)[1]) > max(model.shard_costs(t, rw, 1.0)[1])


def test_memory_counts_optimizer_state():
    topo = Topology(axes={"model": 1})
    t = table("t", rows=1000, dim=16)
    ps = _layout.data_parallel(1000, 16)
    sizes = {
        opt: CostModel(topology=topo, batch_size=1, optimizer=opt).shard_costs(t, ps, 0.0)[0][0]
        for opt in ("sgd", "rowwise_adagrad", "adagrad", "adam")
    }
    weights = 1000 * 16 * 4
    assert (
        sizes["sgd"] - weights
        == sizes["rowwise_adagrad"] - weights - 4000
        == sizes["adam"] - 3 * weights
    )
    with pytest.raises(ValueError, match="optimizer 'lamb' is not one of"):
        Planner(topo, optimizer="lamb")


# Output ------------------------------------------------------------------------------------


def test_criteo_plans_fast_and_prints_stats(capsys):
    topo = Topology(axes={"data": 2, "model": 4}, device_memory_bytes=8 * GiB)
    tables = criteo_tables()
    # CPU time of this process, not wall time: other processes on a loaded machine do not
    # count. About 0.1 s here; the bound catches a search that blows up, not a slow host.
    start = time.process_time()
    plan = Planner(topo).plan(tables, batch_size=16384)
    assert time.process_time() - start < 3.0
    assert len(plan) == 26
    mem, ms = plan.device_totals()
    assert max(mem) <= 8 * GiB and max(ms) > 0
    main()
    out = capsys.readouterr().out
    assert "26 tables on mesh data=2 x model=4 (8 devices), budget 8.00 GiB per device" in out
    assert "memory used / budget" in out and "ms/step" in out and "t_cat_2" in out
    explain = plan.explain("t_cat_2")
    assert "chosen:" in explain and "runner-up:" in explain and "collectives per step" in explain


def test_estimate_fills_a_hand_written_plan():
    topo = Topology(axes={"data": 2, "model": 4}, device_memory_bytes=GiB)
    tables = [table("a"), table("b")]
    hand = ShardingPlan.from_types(tables, topo.axes, {"a": "row_wise"})
    filled = Planner(topo).estimate(hand, tables, batch_size=256)
    assert filled["a"].estimate is not None and filled["a"].shards == hand["a"].shards
    assert None not in filled.device_totals()[1]
    assert "GiB (" in filled.stats_table() or "MiB / " in filled.stats_table()
    assert np.isfinite(max(filled.device_totals()[1]))


def test_group_without_a_common_layout_is_an_error():
    topo = Topology(axes={"model": 4})
    constraints = {
        "a": ParameterConstraints(group="g", sharding_types=["table_wise"]),
        "b": ParameterConstraints(group="g", sharding_types=["row_wise"]),
    }
    with pytest.raises(
        PlannerError, match=r"tables \['a', 'b'\] \(group 'g'\) have no sharding type"
    ):
        Planner(topo, constraints).plan([table("a"), table("b")], batch_size=64)
