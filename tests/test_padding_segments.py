"""Padding and skipped ids go to an out-of-range segment that every scatter drops.

On a GPU an id routed to a real (or one shared) row or bag is an atomic add on that one
address, and a wrong index there is a wrong answer. So ids that contribute nothing must
never hold a real slot, row or bag: the dedup gives them slot N (and -1 as their unique
row), `id_stream` gives them bag `F_g * B`. The lookups and updates still equal the loops.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    make_update,
    optim,
)
from sparse_jax._lookup import id_stream, pooled_segment_sum
from sparse_jax.optim._apply import dedup_row_grads
from tests import reference
from tests.test_optim import RULES  # the same rules and hyperparameters

# Tables a and b share one stacked buffer (dim 4), c has its own (dim 8). Skipped ids:
# 7 in a's features (= a's num_rows: read unchecked, it would be b's first row), -2 and
# 100; 5 in b (MEAN still divides by the bag's full length); 6 in c.
TABLES = [
    EmbeddingBagConfig(name="a", num_embeddings=7, embedding_dim=4, feature_names=["fa0", "fa1"]),
    EmbeddingBagConfig(
        name="b", num_embeddings=5, embedding_dim=4, feature_names=["fb"], pooling="MEAN"
    ),
    EmbeddingBagConfig(name="c", num_embeddings=6, embedding_dim=8, feature_names=["fc"]),
]
FEATURES = [("fa0", "a", "SUM"), ("fa1", "a", "SUM"), ("fb", "b", "MEAN"), ("fc", "c", "SUM")]
NUM_ROWS = {t.name: t.num_embeddings for t in TABLES}
BAGS = {  # KJT key order differs from the output order
    "fc": [[], [2, 6, 2], [5]],
    "fa1": [[1, 2], [6, 6, 100], [0]],
    "fb": [[4, 5, 4], [1], []],  # b's row 0 (right after a's rows) stays untouched
    "fa0": [[1, 7, 1], [], [3, -2]],
}
B = 3
CAPACITY = 64


def _kjt(weighted=False):
    keys = list(BAGS)
    values = [i for k in keys for bag in BAGS[k] for i in bag]
    lengths = [len(bag) for k in keys for bag in BAGS[k]]
    weights = np.random.default_rng(7).uniform(0.5, 1.5, size=len(values)).astype(np.float32)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys, np.array(values, np.int64), np.array(lengths), weights=weights if weighted else None
    )
    return kjt.pad(capacity=CAPACITY), weights


def _bag_weights(weights):
    out, pos = {}, 0
    for k in BAGS:
        out[k] = []
        for bag in BAGS[k]:
            out[k].append([float(w) for w in weights[pos : pos + len(bag)]])
            pos += len(bag)
    return out


def _oracle_bags():
    """The bags for the loops: a skipped id reads row E, an extra zero row of its table (so
    it adds nothing, and MEAN still counts it)."""
    table_of = {f: t for f, t, _ in FEATURES}
    out = {}
    for k, bags in BAGS.items():
        e = NUM_ROWS[table_of[k]]
        out[k] = [[i if 0 <= i < e else e for i in bag] for bag in bags]
    return out


def _extended(ebc, params):
    """{table: [E + 1, D] float64}: the table's weights and one zero row."""
    return {
        t: np.concatenate([np.asarray(w, np.float64), np.zeros((1, w.shape[1]))])
        for t, w in ebc.table_weights(params).items()
    }


def _grad_blocks(grad):
    blocks, col = {}, 0
    for feature, table, _ in FEATURES:
        dim = next(t.embedding_dim for t in TABLES if t.name == table)
        blocks[feature] = grad[:, col : col + dim]
        col += dim
    return blocks


# ---------------------------------------------------------------- (a) dedup_row_grads


def test_dedup_gives_out_of_range_rows_no_slot():
    rng = np.random.default_rng(0)
    num_rows, nb, dim = 7, 5, 3
    rows = np.array([3, 7, 1, 3, 7, 0, 1, 7, 5, -1, 3, 7, 7, 6, 9], np.int32)
    inside = (rows >= 0) & (rows < num_rows)
    # padding carries scale 0 and an out-of-range bag (as id_stream gives it); one has an
    # in-range bag, as the old stream gave every padding id
    bag = np.where(inside, rng.integers(0, nb, size=rows.size), nb).astype(np.int32)
    bag[1] = 0
    scale = np.where(inside, rng.uniform(0.5, 1.5, size=rows.size), 0.0).astype(np.float32)
    bag_grads = rng.normal(size=(nb, dim)).astype(np.float32)
    unique, summed = jax.jit(dedup_row_grads, static_argnames="num_rows")(
        jnp.asarray(rows),
        jnp.asarray(bag),
        jnp.asarray(scale),
        jnp.asarray(bag_grads),
        num_rows=num_rows,
    )
    unique, summed = np.asarray(unique), np.asarray(summed)
    assert unique.shape == rows.shape and summed.shape == (rows.size, dim)
    assert np.isfinite(summed).all()
    # every slot is -1 or a real row, and each touched real row holds exactly one slot
    assert all(u == -1 or 0 <= u < num_rows for u in unique), unique
    real = [int(u) for u in unique if u != -1]
    assert sorted(real) == sorted(set(int(r) for r in rows if 0 <= r < num_rows))
    np.testing.assert_array_equal(summed[unique == -1], 0.0)
    expected: dict = {}
    for r, b, s in zip(rows, bag, scale, strict=True):
        if 0 <= r < num_rows:
            expected[int(r)] = expected.get(int(r), 0.0) + float(s) * bag_grads[b].astype(
                np.float64
            )
    for slot, u in enumerate(unique):
        if u != -1:
            np.testing.assert_allclose(summed[slot], expected[int(u)], rtol=1e-6, atol=1e-6)


def test_dedup_of_a_stream_of_only_padding_holds_no_row():
    rows = jnp.full(8, 4, jnp.int32)
    unique, summed = dedup_row_grads(
        rows,
        jnp.full(8, 2, jnp.int32),
        jnp.zeros(8, jnp.float32),
        jnp.ones((2, 3), jnp.float32),
        num_rows=4,
    )
    np.testing.assert_array_equal(np.asarray(unique), -1)
    np.testing.assert_array_equal(np.asarray(summed), 0.0)


# ---------------------------------------------------------------- (b) id_stream


@pytest.mark.parametrize("bounds_check", ["skip", "error", "clamp"])
def test_id_stream_routes_padding_and_skipped_ids_out_of_range(bounds_check):
    ebc = EmbeddingBagCollection(TABLES)
    layout = ebc.layout
    kjt, _ = _kjt()
    for group, (total_rows, _) in layout.groups.items():
        members = [s for s in layout.features if s.group == group]
        nb = len(members) * B
        rows, bag, scale = (
            np.asarray(x)
            for x in id_stream(kjt, layout, group, weighted=False, bounds_check=bounds_check)
        )
        assert rows.shape == bag.shape == scale.shape == (CAPACITY,)
        expected_rows, expected_bag = [], []
        for k, bags in BAGS.items():
            slot = next((s for s in members if s.feature == k), None)
            for b, ids in enumerate(bags):
                for i in ids:
                    if slot is not None and bounds_check == "clamp":
                        i = min(max(i, 0), slot.num_rows - 1)
                    if slot is not None and 0 <= i < slot.num_rows:
                        expected_rows.append(slot.row_offset + i)
                        expected_bag.append(members.index(slot) * B + b)
                    else:  # another group's feature, or a skipped id
                        expected_rows.append(total_rows)
                        expected_bag.append(nb)
        n = len(expected_rows)
        expected_rows += [total_rows] * (CAPACITY - n)  # padding past the last bag
        expected_bag += [nb] * (CAPACITY - n)
        np.testing.assert_array_equal(rows, expected_rows, err_msg=group)
        np.testing.assert_array_equal(bag, expected_bag, err_msg=group)
        real = rows < total_rows
        assert (bag[real] < nb).all() and (bag[~real] >= nb).all()
        np.testing.assert_array_equal(scale[~real], 0.0)


# ---------------------------------------------------------------- (c) pooled lookup


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kernel", ["reference", "xla"])
def test_lookup_with_padding_and_skipped_ids_matches_loops(kernel, weighted):
    ebc = EmbeddingBagCollection(TABLES, is_weighted=weighted, kernel=kernel, bounds_check="skip")
    params = ebc.init(jax.random.key(3))
    kjt, weights = _kjt(weighted)
    expected = reference.pooled_lookup(
        _extended(ebc, params),
        FEATURES,
        _oracle_bags(),
        _bag_weights(weights) if weighted else None,
    )
    np.testing.assert_allclose(
        np.asarray(ebc.apply(params, kjt).values()), expected, rtol=1e-5, atol=1e-6
    )
    traced = jax.jit(ebc.apply)(params, kjt).values()
    np.testing.assert_allclose(np.asarray(traced), expected, rtol=1e-5, atol=1e-6)
    if kernel == "reference":
        blocks = jax.jit(
            lambda p, k: pooled_segment_sum(
                p, k, ebc.layout, weighted=weighted, bounds_check="skip"
            )
        )(params, kjt)
        np.testing.assert_allclose(
            np.concatenate([np.asarray(x) for x in blocks], axis=1), expected, rtol=1e-5, atol=1e-6
        )


# ---------------------------------------------------------------- (d) fused update


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize(("weighted", "kernel"), [(False, "xla"), (True, "xla"), (True, "ffi")])
def test_update_with_padding_and_skipped_ids_matches_loops_and_spares_other_rows(
    rule, weighted, kernel
):
    ebc = EmbeddingBagCollection(TABLES, is_weighted=weighted, kernel=kernel, bounds_check="skip")
    params = ebc.init(jax.random.key(4))
    before = {g: np.asarray(p).copy() for g, p in params.items()}
    opt = getattr(optim, rule)(**RULES[rule])
    opt_state = opt.init(params)
    update = make_update(ebc, opt)
    kjt, weights = _kjt(weighted)
    bag_weights = _bag_weights(weights) if weighted else None
    oracle, states = _extended(ebc, params), {}
    rng = np.random.default_rng(sum(map(ord, rule)))
    for step in (1, 2):
        grad = rng.normal(size=(B, sum(ebc.layout.output_dims))).astype(np.float32)
        params, opt_state = update(params, opt_state, kjt, jnp.asarray(grad))
        row_grads = reference.row_gradients(
            FEATURES, _oracle_bags(), _grad_blocks(grad), bag_weights
        )
        reference.fused_step(rule, RULES[rule], oracle, states, row_grads, step)
    got = ebc.table_weights(params)
    for table, w in oracle.items():  # the extra zero row (skipped ids) is the oracle's own
        np.testing.assert_allclose(
            np.asarray(got[table]), w[:-1], rtol=1e-5, atol=1e-6, err_msg=f"table {table}"
        )
        group, off = ebc.layout.table_group[table]
        for key in reference.initial_row_state(rule, 1):
            fresh = reference.initial_row_state(rule, w.shape[1])[key]
            expected = np.array(
                [states.get(table, {}).get(i, {key: fresh})[key] for i in range(NUM_ROWS[table])]
            )
            leaf = np.asarray(opt_state.tables[group][key])[off : off + NUM_ROWS[table]]
            np.testing.assert_allclose(
                leaf, expected, rtol=1e-5, atol=1e-7, err_msg=f"table {table} {key}"
            )
    touched = {g: set() for g in params}
    for feature, table, _ in FEATURES:
        group, off = ebc.layout.table_group[table]
        touched[group] |= {
            off + i for bag in BAGS[feature] for i in bag if 0 <= i < NUM_ROWS[table]
        }
    for group, p in params.items():
        spared = sorted(set(range(p.shape[0])) - touched[group])
        assert spared, group
        np.testing.assert_array_equal(np.asarray(p)[spared], before[group][spared], err_msg=group)
        for leaf in jax.tree_util.tree_leaves(
            opt_state.tables[group]
        ):  # per-row state (none for sgd)
            assert not np.asarray(leaf)[spared].any(), group
