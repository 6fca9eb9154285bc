"""Plan data types: layouts per type, from_types defaults, validate(), JSON round trip."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_jax._configs import EmbeddingBagConfig
from sparse_jax.sharding import (
    ParameterSharding,
    Shard,
    ShardingEstimate,
    ShardingPlan,
    ShardingType,
)

ST = ShardingType
MESH = {"data": 2, "model": 4}


def table(name="t", rows=10, dim=8):
    return EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim)


def shard(r0, rn, c0, cn, dev):
    return Shard(row_offset=r0, row_size=rn, col_offset=c0, col_size=cn, device=tuple(dev))


def test_sharding_type_values_are_torchrec_strings():
    assert [t.value for t in ST] == [
        "data_parallel",
        "table_wise",
        "row_wise",
        "table_row_wise",
        "column_wise",
        "table_column_wise",
        "grid_shard",
    ]
    assert ST.coerce("ROW_WISE") is ST.ROW_WISE and ST.coerce("row_wise") is ST.ROW_WISE
    with pytest.raises(ValueError, match="'rowwise' is not one of"):
        ST.coerce("rowwise")


def test_from_types_default_layouts():
    tables = [
        table("dp"),
        table("tw1"),
        table("tw2"),
        table("rw", rows=10),
        table("cw", dim=8),
        table("twrw", rows=9),
        table("twcw"),
        table("grid", rows=7),
    ]
    types = {
        "tw1": "table_wise",
        "tw2": ST.TABLE_WISE,
        "rw": "row_wise",
        "cw": "column_wise",
        "twrw": "table_row_wise",
        "twcw": "table_column_wise",
        "grid": "grid_shard",
    }
    plan = ShardingPlan.from_types(tables, MESH, types)
    assert plan["dp"].sharding_type is ST.DATA_PARALLEL and plan["dp"].axes == ()
    # table_wise over the model axes ("data" excluded), least loaded coordinate first.
    assert plan["tw1"].axes == ("model",) and plan["tw1"].shards[0].device == (0,)
    assert plan["tw2"].shards[0].device == (1,)
    # row_wise: ceil(10 / 4) = 3 rows per block, last block 1 row.
    assert [(s.row_offset, s.row_size, s.device) for s in plan["rw"].shards] == [
        (0, 3, (0,)),
        (3, 3, (1,)),
        (6, 3, (2,)),
        (9, 1, (3,)),
    ]
    assert [s.col_size for s in plan["cw"].shards] == [2, 2, 2, 2]
    assert plan["twrw"].axes == ("data", "model")
    assert [s.row_size for s in plan["twrw"].shards] == [3, 3, 3, 0]
    assert len({s.device[0] for s in plan["twcw"].shards}) == 1
    grid = plan["grid"].shards
    assert {(s.col_offset, s.device[0]) for s in grid} == {(0, 0), (4, 1)}
    plan.validate(tables)


def test_from_types_rejects_unknown_tables_and_two_level_on_one_axis():
    with pytest.raises(ValueError, match=r"\['nope'\] that are not among the tables"):
        ShardingPlan.from_types([table()], MESH, {"nope": "row_wise"})
    with pytest.raises(
        ValueError, match="table 't': table_row_wise needs a mesh with an inter-host"
    ):
        ShardingPlan.from_types([table()], {"model": 4}, {"t": "table_row_wise"})
    with pytest.raises(ValueError, match="table 't': sharding type 'bogus'"):
        ShardingPlan.from_types([table()], MESH, {"t": "bogus"})


def test_from_types_says_when_a_column_split_has_fewer_blocks_than_devices(caplog):
    """TorchRec refuses a column split that does not divide the dim; here the split takes
    fewer blocks, and says so."""
    with caplog.at_level("WARNING", logger="hybridrec.plan"):
        plan = ShardingPlan.from_types([table("even", dim=8)], MESH, {"even": "column_wise"})
    assert [s.col_size for s in plan["even"].shards] == [2, 2, 2, 2] and not caplog.records
    with caplog.at_level("WARNING", logger="hybridrec.plan"):
        plan = ShardingPlan.from_types([table("odd", dim=10)], MESH, {"odd": "column_wise"})
    assert [s.col_size for s in plan["odd"].shards] == [5, 5]
    (record,) = caplog.records
    assert (
        "table 'odd': column_wise splits its embedding_dim 10 into 2 block(s), not 4"
        in record.getMessage()
    )


def _one(ps, t=None):
    t = t or table()
    return ShardingPlan({t.name: ps}, mesh_axes=MESH), [t]


@pytest.mark.parametrize(
    ("ps", "message"),
    [
        (
            ParameterSharding(
                sharding_type="table_wise", axes=("model",), shards=(shard(0, 9, 0, 8, (0,)),)
            ),
            r"table 't': the shards cover 72 of the table's 10 x 8 = 80 elements",
        ),
        (
            ParameterSharding(
                sharding_type="column_wise",
                axes=("model",),
                shards=(shard(0, 10, 0, 5, (0,)), shard(0, 10, 4, 4, (1,))),
            ),
            "table 't': shards rows .* overlap",
        ),
        (
            ParameterSharding(
                sharding_type="table_wise", axes=("model",), shards=(shard(0, 11, 0, 8, (0,)),)
            ),
            "reaches outside the 10 x 8 table",
        ),
        (
            ParameterSharding(
                sharding_type="row_wise",
                axes=("model",),
                shards=tuple(
                    shard(i * 5 if i < 2 else 10, 5 if i < 2 else 0, 0, 8, (i,)) for i in range(4)
                ),
            ),
            r"table 't': row_wise over \['model'\] must have the shards rows \[0, 3\)",
        ),
        (
            ParameterSharding(
                sharding_type="data_parallel", axes=("model",), shards=(shard(0, 10, 0, 8, (0,)),)
            ),
            "data_parallel takes axes=()",
        ),
        (
            ParameterSharding(
                sharding_type="table_row_wise", axes=("model",), shards=(shard(0, 10, 0, 8, (0,)),)
            ),
            r"table_row_wise takes axes=\(inter_host_axis, intra_host_axis\)",
        ),
    ],
)
def test_validate_rejects_bad_layouts_naming_the_table(ps, message):
    plan, tables = _one(ps)
    with pytest.raises(ValueError, match=message):
        plan.validate(tables)


def test_plan_rejects_unknown_axes_and_out_of_range_devices():
    whole = shard(0, 10, 0, 8, (4,))
    with pytest.raises(ValueError, match=r"table 't': shard 0 is at device \[4\].*sizes \[4\]"):
        _one(ParameterSharding(sharding_type="table_wise", axes=("model",), shards=(whole,)))
    with pytest.raises(
        ValueError, match=r"table 't': axes \['tensor'\] name \['tensor'\], which the mesh"
    ):
        _one(ParameterSharding(sharding_type="table_wise", axes=("tensor",), shards=(whole,)))
    with pytest.raises(ValueError, match=r"mesh order; write \['data', 'model'\]"):
        _one(
            ParameterSharding(
                sharding_type="table_wise",
                axes=("model", "data"),
                shards=(shard(0, 10, 0, 8, (0, 0)),),
            )
        )


def test_validate_requires_every_table_exactly_once():
    plan = ShardingPlan.from_types([table("a")], MESH, {})
    with pytest.raises(ValueError, match=r"no entry for table\(s\) \['b'\]"):
        plan.validate([table("a"), table("b")])
    two = ShardingPlan.from_types([table("a"), table("b")], MESH, {})
    with pytest.raises(ValueError, match=r"names table\(s\) \['b'\] that are not among"):
        two.validate([table("a")])


def test_json_round_trip_with_estimates_and_hand_editing():
    tables = [table("a", rows=100, dim=16), table("b", rows=7)]
    plan = ShardingPlan.from_types(tables, MESH, {"a": "row_wise", "b": "table_wise"})
    est = ShardingEstimate(
        shard_bytes=(1, 2, 3, 4),
        shard_ms=(0.1, 0.2, 1 / 3, 0.0),
        input_dist_bytes=5,
        notes=("chosen: because",),
    )
    plan = ShardingPlan(
        {"a": dataclasses.replace(plan["a"], estimate=est), "b": plan["b"]},
        mesh_axes=MESH,
        device_memory_bytes=2**30,
    )
    text = plan.to_json()
    assert ShardingPlan.from_json(text) == plan
    assert (
        '{"row_offset": 0, "row_size": 25, "col_offset": 0, "col_size": 16, "device": [0]}' in text
    )
    # A person moves table b to model=3.
    doc = json.loads(text)
    doc["tables"]["b"]["shards"][0]["device"] = [3]
    edited = ShardingPlan.from_json(json.dumps(doc))
    assert edited["b"].shards[0].device == (3,)
    edited.validate(tables)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(extra=1), r"unknown key\(s\) \['extra'\]"),
        (lambda d: d["tables"]["a"].pop("axes"), r"table 'a' is missing key\(s\) \['axes'\]"),
        (
            lambda d: d["tables"]["a"]["shards"][0].update(row_size=-1),
            "table 'a' shard 0: .*row_size must be an integer >= 0",
        ),
        (
            lambda d: d["tables"]["a"].update(sharding_type="rows"),
            "table 'a': sharding type 'rows' is not one of",
        ),
        (
            lambda d: d["tables"]["a"]["shards"][0].update(device=[9]),
            r"table 'a': shard 0 is at device \[9\]",
        ),
        (
            lambda d: d.update(mesh_axes={"data": 0}),
            "mesh axis 'data' must have an integer size >= 1",
        ),
        (lambda d: d.update(version=7), "expected 'hybridrec.ShardingPlan' version 1"),
    ],
)
def test_from_json_errors_say_what_to_fix(edit, message):
    doc = json.loads(ShardingPlan.from_types([table("a")], MESH, {"a": "row_wise"}).to_json())
    edit(doc)
    with pytest.raises(ValueError, match=message):
        ShardingPlan.from_json(json.dumps(doc))
    with pytest.raises(ValueError, match="not valid JSON"):
        ShardingPlan.from_json("{")


def test_reports_of_a_hand_written_plan():
    plan = ShardingPlan.from_types([table("a"), table("b")], MESH, {"a": "row_wise"})
    stats = plan.stats_table()
    assert (
        "mesh data=2 x model=4 (8 devices)" in stats and "a (row_wise), b (data_parallel)" in stats
    )
    assert "no estimates" in plan.explain(
        "a"
    ) and "shard 3: rows [9, 10) cols [0, 8) at model=3" in plan.explain("a")
    with pytest.raises(KeyError, match="the plan has no table 'zz'"):
        plan.explain("zz")


meshes = st.sampled_from(
    [
        {"model": 4},
        {"data": 2, "model": 4},
        {"data": 2, "model": 2},
        {"a": 2, "b": 3, "c": 2},
        {"x": 1},
        {"data": 8},
    ]
)


@settings(max_examples=60, deadline=None)
@given(
    mesh=meshes,
    specs=st.lists(
        st.tuples(st.integers(1, 50), st.integers(1, 12), st.sampled_from(list(ST))),
        min_size=1,
        max_size=6,
    ),
)
def test_from_types_always_tiles_and_round_trips(mesh, specs):
    tables = [table(f"t{i}", rows, dim) for i, (rows, dim, _) in enumerate(specs)]
    types = {f"t{i}": kind for i, (*_, kind) in enumerate(specs)}
    two_level = {ST.TABLE_ROW_WISE, ST.TABLE_COLUMN_WISE, ST.GRID_SHARD}
    if len(mesh) < 2:
        types = {k: v for k, v in types.items() if v not in two_level}
    plan = ShardingPlan.from_types(tables, mesh, types)
    plan.validate(tables)  # tiles exactly, layouts per type, devices in range
    assert list(plan) == [t.name for t in tables]
    for t in tables:
        ps = plan[t.name]
        assert ps.sharding_type is ST.coerce(types.get(t.name, "data_parallel"))
        assert sum(s.num_elements for s in ps.shards) == t.num_embeddings * t.embedding_dim
    assert ShardingPlan.from_json(plan.to_json()) == plan
