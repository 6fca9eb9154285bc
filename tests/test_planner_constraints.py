"""`ParameterConstraints`: what each field accepts, how it is normalized, and the error for
each bad value (matched on the words that name the field and the value). Found by mutation
testing: every case kills a mutant of `planner/_constraints.py` that `test_planner` left
alive."""

import re

import pytest

from sparse_jax._configs import EmbeddingBagConfig
from sparse_jax.planner import ParameterConstraints, PlannerError, ShardingType

TABLE = EmbeddingBagConfig(
    name="t", num_embeddings=100, embedding_dim=8, feature_names=["f0", "f1"]
)
MESH = {"data": 2, "model": 4}


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(sharding_types="table_wise"),
            "sharding_types must be a list, got 'table_wise'; write ['table_wise']",
        ),
        (dict(sharding_types=ShardingType.ROW_WISE), "sharding_types must be a list, got "),
        (
            dict(sharding_types=[]),
            "sharding_types=[] allows nothing; leave it None to allow every type",
        ),
        (dict(min_partition=0), "min_partition must be an integer >= 1, got 0"),
        (dict(min_partition=-1), "min_partition must be an integer >= 1, got -1"),
        (dict(min_partition=True), "min_partition must be an integer >= 1, got True"),
        (dict(min_partition=2.5), "min_partition must be an integer >= 1, got 2.5"),
        (
            dict(pooling_factors=3.0),
            "pooling_factors must be a list of numbers >= 0, one per feature, got 3.0",
        ),
        (
            dict(pooling_factors=2),
            "pooling_factors must be a list of numbers >= 0, one per feature, got 2",
        ),
        (
            dict(pooling_factors=[1.0, -1.0]),
            "pooling_factors must be a list of numbers >= 0, one per feature, got [1.0, -1.0]",
        ),
        (dict(pooling_factors=[-1]), "pooling_factors must be a list of numbers >= 0"),
        (dict(pooling_factors=[True]), "pooling_factors must be a list of numbers >= 0"),
        (dict(pooling_factors=["1"]), "pooling_factors must be a list of numbers >= 0"),
        (dict(axes="model"), "axes must be a list of mesh axis names, got the string 'model'"),
        (
            dict(pin=[("model", 1)]),
            "pin must map mesh axis names to indices >= 0, got [('model', 1)]",
        ),
        (
            dict(pin={"model": -1}),
            "pin must map mesh axis names to indices >= 0, got {'model': -1}",
        ),
        (dict(pin={"model": True}), "pin must map mesh axis names to indices >= 0"),
        (dict(pin={"model": 1.0}), "pin must map mesh axis names to indices >= 0"),
        (dict(group=""), "group must be a non-empty string, got ''"),
        (dict(group=3), "group must be a non-empty string, got 3"),
    ],
)
def test_bad_values_are_refused_by_name(kw, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        ParameterConstraints(**kw)


def test_boundaries_accepted_and_values_normalized():
    pin = {"model": 0}
    c = ParameterConstraints(
        sharding_types=["row_wise", ShardingType.ROW_WISE, "table_wise"],
        min_partition=1,
        pooling_factors=[0, 0.5],
        axes=["model"],
        pin=pin,
        group="g",
    )
    assert c.sharding_types == (
        ShardingType.ROW_WISE,
        ShardingType.TABLE_WISE,
    )  # deduplicated, in order
    assert c.min_partition == 1
    assert c.pooling_factors == (0.0, 0.5) and all(type(x) is float for x in c.pooling_factors)
    assert c.axes == ("model",) and isinstance(c.axes, tuple)
    pin["model"] = 3  # the constraint keeps its own copy
    assert c.pin == {"model": 0}
    assert c.group == "g"
    assert c == ParameterConstraints(
        sharding_types=("row_wise", "table_wise"),
        min_partition=1,
        pooling_factors=(0.0, 0.5),
        axes=("model",),
        pin={"model": 0},
        group="g",
    )
    empty = ParameterConstraints()
    assert (
        empty.sharding_types,
        empty.min_partition,
        empty.pooling_factors,
        empty.axes,
        empty.pin,
        empty.group,
    ) == (None, None, None, None, None, None)
    with pytest.raises(TypeError):
        hash(c)


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(axes=["model", "tensor"]),
            "table 't': constraint axes names ['tensor'], which are not mesh axes ['data', 'model']",
        ),
        (
            dict(pin={"rack": 0}),
            "table 't': constraint pin names ['rack'], which are not mesh axes ['data', 'model']",
        ),
        (dict(pin={"model": 4}), "table 't': pin model=4 is out of range; axis 'model' has size 4"),
        (
            dict(pin={"data": 0, "model": 9}),
            "table 't': pin model=9 is out of range; axis 'model' has size 4",
        ),
        (
            dict(pooling_factors=[1.0]),
            "table 't': pooling_factors has 1 values for the table's 2 features ['f0', 'f1']; give one per feature",
        ),
    ],
)
def test_check_against_the_mesh_and_table(kw, message):
    with pytest.raises(PlannerError, match="^" + re.escape(message)):
        ParameterConstraints(**kw).check_against(TABLE, MESH)


def test_check_against_accepts_the_last_index_and_matching_factors():
    ParameterConstraints(
        pin={"data": 1, "model": 3}, axes=["model"], pooling_factors=[1, 2]
    ).check_against(TABLE, MESH)
    ParameterConstraints().check_against(TABLE, MESH)
