"""Every plan trains the unsharded model: each sharding type on a 1-D and a 2-D mesh, with
every fused optimizer, 3 steps; tables and every state leaf equal the unsharded
collection's (rtol 1e-5), replicas stay identical, and the steady steps compile once (at
most one recompile, when the length cap first grows). Row-wise Adagrad under column splits included: its per-row
statistic is summed over the row's column blocks, so every block holds the unsharded
row's state (and a plain-loop oracle, independent of the library's rule code, agrees)."""

import numpy as np
import pytest

from sparse_jax import optim
from tests import reference
from tests.test_sharding import TWO_LEVEL, _check_replicas_identical, _check_tables, _run

RULES = {
    "sgd": dict(lr=0.3),
    "adagrad": dict(lr=0.3, eps=1e-8),
    # eps large next to sqrt(state): a statistic off by the block's share shows
    "rowwise_adagrad": dict(lr=0.3, eps=0.05),
    "adam": dict(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
}
KINDS = [
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
    "grid_shard",
]
CASES = [
    (k, m)
    for k in KINDS
    for m in (["2x4"] if k in TWO_LEVEL or k == "data_parallel" else ["8", "2x4"])
]
COLUMN_SPLITS = {"column_wise", "table_column_wise", "grid_shard"}


def _state_leaves(rule_name):
    return {
        "sgd": [],
        "adagrad": ["momentum1"],
        "rowwise_adagrad": ["momentum1"],
        "adam": ["momentum1", "momentum2"],
    }[rule_name]


@pytest.mark.parametrize("rule_name", sorted(RULES))
@pytest.mark.parametrize(("kind", "mesh_name"), CASES)
def test_every_plan_trains_the_unsharded_model(kind, mesh_name, rule_name):
    rule = getattr(optim, rule_name)(**RULES[rule_name])
    ebc, sharded, params, state, sparams, sstate, update = _run(
        {f"t{i}": kind for i in range(4)}, mesh_name, rule, seed=5
    )
    assert {sharded.plan[t.name].sharding_type.value for t in ebc.tables} == {kind}
    if kind in COLUMN_SPLITS:
        assert any(
            s.col_size < t.embedding_dim for t in ebc.tables for s in sharded.plan[t.name].shards
        )
    _check_tables(ebc, sharded, params, sparams)
    _check_replicas_identical(sparams)
    for key in _state_leaves(rule_name):
        got = sharded.table_state(sstate, key)
        for t in ebc.tables:
            group, off = ebc.layout.table_group[t.name]
            want = np.asarray(state.tables[group][key])[off : off + t.num_embeddings]
            blocks = got[t.name].values() if isinstance(got[t.name], dict) else [got[t.name]]
            for block in blocks:  # row-wise state: every column block holds the whole row's value
                np.testing.assert_allclose(
                    block, want, rtol=1e-5, atol=1e-7, err_msg=f"{key} of {t.name}"
                )
    assert update.compile_count() <= 2  # at most one recompile, when the length cap first grows


def test_column_split_rowwise_state_equals_the_loop_oracle():
    """The same statistic from plain loops (tests/reference.py), not from the library."""
    from tests.cases import random_case
    from tests.test_sharding import _mesh

    rule = optim.rowwise_adagrad(**RULES["rowwise_adagrad"])
    ebc, sharded, _, _, _, sstate, _ = _run(
        {f"t{i}": "column_wise" for i in range(4)}, "8", rule, seed=5, steps=1
    )
    n = _mesh("8").size
    case = random_case(
        np.random.default_rng(100),
        dims=[8, 8, 4, 16],
        batch=2 * n,
        weighted=True,
        rows=(20, 60),
        hot_rows=20,
        shuffle_keys=False,
    )
    rng = np.random.default_rng(5)  # as `_run` draws it: its first case, then the step's gradient
    random_case(rng, dims=[8, 8, 4, 16], batch=2 * n, weighted=True, rows=(20, 60), hot_rows=None)
    grad = rng.normal(size=(2 * n, sum(ebc.layout.output_dims))).astype(np.float32)
    blocks, col = {}, 0
    for feature, table, _ in case.features:
        dim = next(t.embedding_dim for t in case.tables if t.name == table)
        blocks[feature] = grad[:, col : col + dim]
        col += dim
    row_grads = reference.row_gradients(case.features, case.bag_ids, blocks, case.bag_weights)
    got = sharded.table_state(sstate, "momentum1")
    for t in ebc.tables:
        want = np.zeros(t.num_embeddings)
        for row, g in row_grads.get(t.name, {}).items():
            want[row] = float(np.mean(np.square(g)))
        assert len(got[t.name]) > 1, f"{t.name} is not column-split"
        for block in got[t.name].values():
            np.testing.assert_allclose(block, want, rtol=1e-5, atol=1e-8, err_msg=t.name)
