"""The Pallas (Triton) kernels in interpret mode against the plain loops of `tests/reference.py`.

On a machine without a GPU, `interpret=True` runs each kernel's own body (the same program a
GPU compiles) with XLA: every kernel is checked here over shapes x dtypes x rules, ids -1, 0,
E-1, E under clamp / skip, empty and long bags, duplicates and Zipf ids; a bug planted in a
kernel's indexing, masking or rule fails these. On a GPU (`JAX_PLATFORMS=cuda python -m pytest
tests/test_pallas_kernels.py`) the same tests compile the kernels with Triton instead."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sparse_jax import optim
from sparse_jax._kernels import _pallas
from sparse_jax._row_update import update_rows
from tests import reference

INTERPRET = jax.default_backend() not in ("gpu", "cuda", "rocm")  # compiled on a GPU
NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def _bags(rng, n_bags, E, *, zipf=False, edge=False, long_bag=0):
    lengths = rng.integers(0, 6, n_bags)
    lengths[0] = 0  # an empty bag
    if long_bag:
        lengths[-1] = long_bag
    ids = (rng.zipf(1.2, lengths.sum()) - 1) % E if zipf else rng.integers(0, E, lengths.sum())
    if edge and ids.size >= 4:
        ids[:4] = [-1, 0, E - 1, E]
    return lengths, ids


@pytest.mark.parametrize(
    "dtype,dim,bounds",
    [("fp32", 4, "skip"), ("fp32", 32, "clamp"), ("fp16", 32, "skip"), ("bf16", 4, "clamp")],
)  # each dtype, dim and bounds mode
def test_jagged_pooled_sum_equals_the_loops(dtype, dim, bounds):
    rng = np.random.default_rng(dim + len(dtype) + len(bounds))
    E, B = 20, 5
    keys = ["a", "b", "c"]  # b and c read the buffer at row offset E, c with MEAN
    lengths, ids = _bags(rng, len(keys) * B, E, edge=True, long_bag=40, zipf=dtype == "bf16")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    weights = rng.uniform(0.5, 1.5, ids.size).astype(np.float32)
    table = rng.normal(size=(2 * E, dim)).astype(NP_DTYPES[dtype])
    for weighted in (False, True):
        out = _pallas.jagged_pooled_sum(
            jnp.asarray(table),
            jnp.asarray(ids.astype(np.int32)),
            jnp.asarray(offsets),
            jnp.asarray(weights) if weighted else None,
            stride=B,
            keys=[0, 1, 2],
            row_offsets=[0, E, E],
            num_rows=[E, E, E],
            mean=[False, False, True],
            clamp=bounds == "clamp",
            interpret=INTERPRET,
        )
        bag_ids, bag_w = {}, {}
        for k, key in enumerate(keys):
            bag_ids[key], bag_w[key] = [], []
            for b in range(B):
                a, z = offsets[k * B + b], offsets[k * B + b + 1]
                kept = [
                    (int(i), float(w))
                    for i, w in zip(ids[a:z], weights[a:z], strict=True)
                    if bounds == "clamp" or 0 <= i < E
                ]
                bag_ids[key].append([min(max(i, 0), E - 1) + (E if k else 0) for i, _ in kept])
                # MEAN divides by the bag's true length, skipped ids included
                scale = 1.0 if k < 2 or z == a else len(kept) / (z - a)
                bag_w[key].append([(w if weighted else 1.0) * scale for _, w in kept])
        want = reference.pooled_lookup(
            {"t": table.astype(np.float64)},
            [("a", "t", "SUM"), ("b", "t", "SUM"), ("c", "t", "MEAN")],
            bag_ids,
            bag_w,
        )
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def test_pooled_positions_equals_the_loops():
    rng = np.random.default_rng(1)
    table = rng.normal(size=(30, 16)).astype(np.float32)
    rows = rng.integers(0, 30, (7, 5)).astype(np.int32)
    w = rng.uniform(size=(7, 5)).astype(np.float32)
    w[2, 3:] = 0  # padding positions
    w[4] = 0  # an empty bag
    out = _pallas.pooled_positions(
        jnp.asarray(table), jnp.asarray(rows), jnp.asarray(w), interpret=INTERPRET
    )
    want = np.array(
        [
            [sum(w[b, p] * table[rows[b, p]].astype(np.float64) for p in range(5))][0]
            for b in range(7)
        ]
    )
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)


def test_sorted_runs_sort_stably_and_put_outside_rows_last():
    rows = jnp.asarray([5, 2, 9, 2, -1, 5, 7, 2], jnp.int32)  # 9 and -1 lie outside 8 rows
    rows_s, perm = _pallas.sorted_runs(rows, 8)
    assert rows_s.tolist() == [2, 2, 2, 5, 5, 7, 8, 8]
    assert perm.tolist() == [1, 3, 7, 0, 5, 6, 2, 4]  # stable: stream order within a run


RULES = {
    "sgd": dict(lr=0.1),
    "adagrad": dict(lr=0.1, eps=1e-6),
    "rowwise_adagrad": dict(lr=0.1, eps=1e-6),
    "adam": dict(lr=0.05, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.01),
}


def _stream(rng, n, E, n_bags, zipf):
    rows = ((rng.zipf(1.3, n) - 1) % E if zipf else rng.integers(0, E, n)).astype(np.int32)
    rows[:3] = [-1, E, E]  # outside the buffer (skipped ids, padding)
    bag = rng.integers(0, n_bags, n).astype(np.int32)
    bag[1] = n_bags  # padding's out-of-range bag
    scale = rng.uniform(0.5, 1.5, n).astype(np.float32)
    return rows, bag, scale


@pytest.mark.parametrize(
    "rule,zipf",
    [
        ("sgd", False),
        ("adagrad", True),
        ("rowwise_adagrad", False),
        ("rowwise_adagrad", True),
        ("adam", True),
    ],
)
def test_sorted_run_update_equals_the_loops(rule, zipf):
    rng = np.random.default_rng(len(rule) + zipf)
    E, D, n, n_bags, step = 24, 8, 64, 10, 3
    rows, bag, scale = _stream(rng, n, E, n_bags, zipf)
    bag_grads = rng.normal(size=(n_bags, D)).astype(np.float32)
    table = rng.normal(size=(E, D)).astype(np.float32)
    r = getattr(optim, rule)(**RULES[rule])
    state = r.init_table(jnp.asarray(table))
    if rule != "sgd":  # a state that is not all zero
        state = jax.tree_util.tree_map(lambda x: x + 0.25, state)
    new_t, new_s = update_rows(
        r,
        jnp.asarray(table),
        state,
        jnp.int32(step),
        jnp.asarray(rows),
        jnp.asarray(bag),
        jnp.asarray(scale),
        jnp.asarray(bag_grads),
        kernel="pallas",
    )
    grads = {}
    for i, b, s in zip(rows, bag, scale, strict=True):
        if 0 <= i < E and b < n_bags:
            grads[int(i)] = grads.get(int(i), 0.0) + float(s) * bag_grads[b].astype(np.float64)
    weights = {"t": table.astype(np.float64)}
    host = {
        k: np.asarray(v, np.float64) for k, v in (state.items() if isinstance(state, dict) else [])
    }
    states = {"t": {i: {k: v[i] for k, v in host.items()} for i in grads}}
    reference.fused_step(rule, r.hyperparams, weights, states, {"t": grads}, step)
    np.testing.assert_allclose(np.asarray(new_t), weights["t"], rtol=1e-5, atol=1e-6)
    for k, leaf in new_s.items() if isinstance(new_s, dict) else []:
        want = host[k].copy()
        for i in grads:
            want[i] = states["t"][i][k]
        np.testing.assert_allclose(np.asarray(leaf), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,stochastic", [("fp16", False), ("bf16", True)])
def test_sorted_run_update_of_narrow_tables_rounds_as_the_xla_form(dtype, stochastic):
    """Narrow rows are written back as the XLA form writes them (round to nearest, or the same
    counter-based stochastic draw). The two sum a row's gradients in different orders, so a
    row may land one unit in the last place apart; nearly all are bitwise equal."""
    rng = np.random.default_rng(5)
    E, D, n = 16, 16, 48
    rows, bag, scale = _stream(rng, n, E, 6, True)
    table = jnp.asarray(rng.normal(size=(E, D)).astype(NP_DTYPES[dtype]))
    r = optim.rowwise_adagrad(lr=0.3, stochastic_rounding=stochastic, seed=7)
    args = (
        jnp.int32(2),
        jnp.asarray(rows),
        jnp.asarray(bag),
        jnp.asarray(scale),
        jnp.asarray(rng.normal(size=(6, D)).astype(np.float32)),
    )
    a, sa = update_rows(r, table, r.init_table(table), *args, kernel="pallas")
    b, sb = update_rows(r, table, r.init_table(table), *args, kernel="xla")
    assert a.dtype == table.dtype
    same = np.asarray(a).view(np.uint16) == np.asarray(b).view(np.uint16)
    assert same.mean() > 0.95, same.mean()
    ulp = 2.0**-10 if dtype == "fp16" else 2.0**-7
    np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2 * ulp, atol=1e-3
    )
    assert not np.array_equal(np.asarray(a).view(np.uint16), np.asarray(table).view(np.uint16))
    np.testing.assert_allclose(np.asarray(sa["momentum1"]), np.asarray(sb["momentum1"]), rtol=1e-6)


def test_a_skipped_step_writes_nothing_and_the_update_is_reproducible():
    rng = np.random.default_rng(9)
    rows, bag, scale = _stream(rng, 80, 12, 5, True)
    table = jnp.asarray(rng.normal(size=(12, 8)).astype(np.float32))
    r = optim.adam(lr=0.1)
    runs = (*_pallas.sorted_runs(jnp.asarray(rows), 12), jnp.asarray(bag), jnp.asarray(scale))
    g = jnp.asarray(rng.normal(size=(5, 8)).astype(np.float32)).at[2, 3].set(jnp.nan)
    kept, kept_state = _pallas.sorted_run_update(
        r,
        table,
        r.init_table(table),
        jnp.int32(1),
        *runs,
        g,
        jnp.zeros((), bool),
        interpret=INTERPRET,
    )
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(table))
    assert not any(np.asarray(x).any() for x in jax.tree_util.tree_leaves(kept_state))
    g = g.at[2, 3].set(1.0)
    once = _pallas.sorted_run_update(
        r, table, r.init_table(table), jnp.int32(1), *runs, g, interpret=INTERPRET
    )
    again = _pallas.sorted_run_update(
        r, table, r.init_table(table), jnp.int32(1), *runs, g, interpret=INTERPRET
    )
    for x, y in zip(jax.tree_util.tree_leaves(once), jax.tree_util.tree_leaves(again), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))  # no atomics: bitwise the same
    assert not np.array_equal(np.asarray(once[0]), np.asarray(table))


def test_pallas_refuses_what_it_cannot_run_and_names_the_way_out():
    table = jnp.zeros((8, 12), jnp.float32)  # 12: not a power of two
    with pytest.raises(ValueError, match="power-of-two"):
        update_rows(
            optim.sgd(lr=0.1),
            table,
            (),
            jnp.int32(1),
            jnp.zeros(4, jnp.int32),
            jnp.zeros(4, jnp.int32),
            jnp.ones(4, jnp.float32),
            jnp.zeros((1, 12), jnp.float32),
            kernel="pallas",
        )
    import optax

    custom = optim.from_optax(optax.sgd(0.1), name="sgd")  # named like SGD, but not declared native
    assert custom.native is None
    with pytest.raises(ValueError, match="native rule"):
        update_rows(
            custom,
            jnp.zeros((8, 8), jnp.float32),
            custom.init_table(jnp.zeros((8, 8))),
            jnp.int32(1),
            jnp.zeros(4, jnp.int32),
            jnp.zeros(4, jnp.int32),
            jnp.ones(4, jnp.float32),
            jnp.zeros((1, 8), jnp.float32),
            kernel="pallas",
        )


def test_unrolled_loops_sum_in_the_bags_order():
    """Reading several ids per loop step keeps each bag's (and run's) sum order: the results
    with unroll 1, 3 and 4 are bitwise equal, whatever the bag lengths' remainders."""
    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 11, 12)
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    ids = jnp.asarray(rng.integers(0, 40, int(lengths.sum())).astype(np.int32))
    table = jnp.asarray(rng.normal(size=(40, 8)).astype(np.float32))
    outs = [
        np.asarray(
            _pallas.jagged_pooled_sum(
                table,
                ids,
                offsets,
                None,
                stride=6,
                keys=[0, 1],
                row_offsets=[0, 0],
                num_rows=[40, 40],
                mean=[False, True],
                clamp=False,
                interpret=INTERPRET,
                unroll=u,
            )
        )
        for u in (1, 3, 4)
    ]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    rows, bag, scale = _stream(rng, 90, 16, 7, True)
    runs = (*_pallas.sorted_runs(jnp.asarray(rows), 16), jnp.asarray(bag), jnp.asarray(scale))
    g = jnp.asarray(rng.normal(size=(7, 8)).astype(np.float32))
    r = optim.rowwise_adagrad(lr=0.1)
    table = table[:16]
    ups = [
        np.asarray(
            _pallas.sorted_run_update(
                r, table, r.init_table(table), jnp.int32(1), *runs, g, interpret=INTERPRET, unroll=u
            )[0]
        )
        for u in (1, 4)
    ]
    assert np.array_equal(ups[0], ups[1])


def test_chunk_sums_equal_the_loops():
    rng = np.random.default_rng(3)
    n, n_bags, dim = 300, 40, 16
    bag = rng.integers(-1, n_bags + 1, n).astype(np.int32)  # -1 and n_bags add nothing
    scale = rng.uniform(0.5, 1.5, n).astype(np.float32)
    g = rng.normal(size=(n_bags, dim)).astype(np.float32)
    cuts = np.sort(rng.integers(0, n, 24))
    starts = [0, *cuts.tolist(), n, n, n]  # empty chunks inside and at the end
    out = _pallas.chunk_sums(
        jnp.asarray(np.array(starts[:-1], np.int32)),
        jnp.asarray(np.array(starts[1:], np.int32)),
        jnp.asarray(bag),
        jnp.asarray(scale),
        jnp.asarray(g),
        interpret=INTERPRET,
    )
    want = reference.chunk_sums_loop(starts, bag, scale, g)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    assert not np.asarray(out)[-2:].any()


@pytest.mark.parametrize("rule", sorted(RULES))
def test_run_update_over_host_runs_equals_the_per_id_kernel_bitwise(rule):
    """`run_update` (one program per run the host found) sums and steps each row as
    `sorted_run_update` does: the same bits, padding runs and out-of-range bags writing
    nothing; a false guard writes nothing at all."""
    rng = np.random.default_rng(7 + len(rule))
    E, D, n, n_bags = 24, 8, 80, 10
    rows, bag, scale = _stream(rng, n, E, n_bags, zipf=True)
    r = getattr(optim, rule)(**RULES[rule])
    table = jnp.asarray(rng.normal(size=(E, D)).astype(np.float32))
    state = jax.tree_util.tree_map(lambda x: x + 0.25, r.init_table(table))
    g = jnp.asarray(rng.normal(size=(n_bags, D)).astype(np.float32))
    key = np.where((rows >= 0) & (rows < E), rows, E)
    order = np.argsort(key, kind="stable")
    rows_s, bag_s, scale_s = key[order], bag[order], scale[order]
    unique, starts = np.unique(rows_s[rows_s < E], return_index=True)
    u_cap = unique.size + 3  # padding runs: row E, empty
    unique_p = np.full(u_cap, E, np.int32)
    unique_p[: unique.size] = unique
    offsets = np.full(u_cap + 1, int((rows_s < E).sum()), np.int32)
    offsets[: unique.size] = starts
    host = [jnp.asarray(x) for x in (unique_p, offsets, bag_s, scale_s)]
    want = _pallas.sorted_run_update(
        r, table, state, jnp.int32(2), *(jnp.asarray(x) for x in (rows_s, order.astype(np.int32), bag, scale)),
        g, interpret=INTERPRET,
    )  # fmt: skip
    got = _pallas.run_update(r, table, state, jnp.int32(2), *host, g, interpret=INTERPRET)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(got[0]), np.asarray(table))  # it did write rows
    kept = _pallas.run_update(
        r, table, state, jnp.int32(2), *host, g, jnp.zeros((), bool), interpret=INTERPRET
    )
    for a, b in zip(
        jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves((table, state)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sorted_chunks_find_the_runs_and_cut_only_the_long_ones():
    rng = np.random.default_rng(9)
    E, n, size = 30, 300, 16
    rows = rng.integers(-1, E + 1, n).astype(np.int32)
    rows[rng.choice(n, 70, replace=False)] = 4  # a run of 70+ ids: 5 chunks
    rows[rng.choice(n, 17, replace=False)] = 11  # just over one chunk
    c = jax.tree_util.tree_map(np.asarray, _pallas.sorted_chunks(jnp.asarray(rows), E, size))
    want = reference.sorted_chunks_loop(rows.tolist(), E, size)
    u = len(want)
    assert (c.unique[u:] == E).all() and c.chunk_hi[u:].max(initial=0) == 0
    chunk_list = []
    for k, (row, start, end, chunks) in enumerate(want):
        assert c.unique[k] == row
        if chunks:  # a long run sums its chunks, not its ids
            assert c.starts[k] == c.ends[k]
            got = list(
                zip(
                    c.chunk_starts[c.chunk_lo[k] : c.chunk_hi[k]],
                    c.chunk_ends[c.chunk_lo[k] : c.chunk_hi[k]],
                    strict=True,
                )
            )
            assert got == chunks, (row, got, chunks)
            chunk_list += chunks
        else:
            assert (c.starts[k], c.ends[k], c.chunk_lo[k], c.chunk_hi[k]) == (start, end, 0, 0)
    assert len(chunk_list) <= c.chunk_starts.size == 2 * (n // size) + 2
    # the stream order within a run: perm sorts stably
    np.testing.assert_array_equal(
        c.perm[: sum(e - s for _, s, e, _ in want)],
        [i for _, i in sorted((r, i) for i, r in enumerate(rows.tolist()) if 0 <= r < E)],
    )


@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad", "adam"])
def test_the_in_program_chunked_update_equals_the_loops_and_repeats_its_bits(rule):
    rng = np.random.default_rng(len(rule) + 40)
    E, D, n, n_bags, step = 40, 16, 400, 30, 2
    rows, bag, scale = _stream(rng, n, E, n_bags, zipf=False)
    rows[rng.choice(np.arange(3, n), 150, replace=False)] = 7  # a hot row: several chunks
    g = rng.normal(size=(n_bags, D)).astype(np.float32)
    table = rng.normal(size=(E, D)).astype(np.float32)
    r = getattr(optim, rule)(**RULES[rule])
    state = jax.tree_util.tree_map(lambda x: x + 0.25, r.init_table(jnp.asarray(table)))
    runs = [jnp.asarray(x) for x in (rows, bag, scale)]
    outs = [
        _pallas.chunked_run_update(
            r,
            jnp.asarray(table),
            state,
            jnp.int32(step),
            *runs,
            jnp.asarray(g),
            interpret=INTERPRET,
        )
        for _ in range(2)
    ]
    for a, b in zip(*(jax.tree_util.tree_leaves(o) for o in outs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # no atomics
    grads = {}
    for i, b, s in zip(rows, bag, scale, strict=True):
        if 0 <= i < E and b < n_bags:
            grads[int(i)] = grads.get(int(i), 0.0) + float(s) * g[b].astype(np.float64)
    weights = {"t": table.astype(np.float64)}
    host = {
        k: np.asarray(v, np.float64) for k, v in (state.items() if isinstance(state, dict) else [])
    }
    states = {"t": {i: {k: v[i] for k, v in host.items()} for i in grads}}
    reference.fused_step(rule, r.hyperparams, weights, states, {"t": grads}, step)
    np.testing.assert_allclose(np.asarray(outs[0][0]), weights["t"], rtol=1e-5, atol=1e-5)
    kept = _pallas.chunked_run_update(
        r, jnp.asarray(table), state, jnp.int32(step), *runs, jnp.asarray(g), jnp.zeros((), bool),
        interpret=INTERPRET,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(kept[0]), table)  # a false guard writes nothing


# ---------------------------------------------------------------- the quantized pooled lookup

# (weight type, power-of-two dim, row alignment): every type, narrow and wide rows (one to
# four warps), rows packed tight (1) and padded as FBGEMM's GPU TBE pads them (16)
QUANT_CASES = [
    ("int8", 16, 1),
    ("int8", 128, 16),
    ("int4", 8, 16),
    ("int4", 64, 1),
    ("int2", 4, 1),
    ("int2", 32, 16),
    ("fp16", 2, 1),
    ("fp16", 64, 16),
]
# (pooling, weighted, bounds_check): each setting both ways in four compiles per case
QUANT_MODES = [
    ("SUM", False, "skip"),
    ("MEAN", True, "clamp"),
    ("SUM", True, "skip"),
    ("MEAN", False, "clamp"),
]


def _quant_bags(rng, E):
    """ids, offsets, weights: an empty first bag and an empty bag inside, a long bag (40),
    one row three times over, ids -1 (pruned), 0, E - 1, E and 2^30, padding past the end."""
    lengths = np.array([0, 3, 5, 0, 40, 1, 6, 2])
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    ids = rng.integers(0, E, offsets[-1] + 5)
    ids[offsets[1] : offsets[1] + 3] = 7  # a duplicate row
    ids[offsets[2] : offsets[2] + 5] = [0, E - 1, -1, E, 0]
    ids[offsets[4] + 39] = E - 1  # the long bag's last id (an off-by-one in its end drops it)
    ids[offsets[6] + 2] = 1 << 30
    ids[offsets[-1] :] = -7  # padding: never read
    weights = rng.uniform(-2.0, 2.0, ids.size).astype(np.float32)
    return ids.astype(np.int32), offsets, weights


@pytest.mark.parametrize("weight_type,dim,row_alignment", QUANT_CASES)
def test_quant_pooled_sum_equals_the_loops_and_the_xla_form_bitwise(
    weight_type, dim, row_alignment
):
    """The Pallas kernel against the plain loop (`reference.quantized_pooled_loop`, float64:
    1e-6 of the largest |w| * |row| sum a bag reaches) and against the XLA form bit for bit:
    the same operations in the same order (in interpret mode; compiled by Triton, an fma is
    the compiler's choice, see `sparse_jax._quant`)."""
    from sparse_jax._quant import quantize_rows, quantized_pooled_lookup

    rng = np.random.default_rng([dim, row_alignment, len(weight_type)])
    E = 24
    table = rng.normal(size=(E, dim)) * 10.0 ** rng.uniform(-3, 3, size=(E, 1))
    table += rng.normal(size=(E, 1)) * 10.0 ** rng.uniform(-2, 2, size=(E, 1))
    packed = quantize_rows(table.astype(np.float32), weight_type, row_alignment=row_alignment)
    ids, offsets, weights = _quant_bags(rng, E)
    lookup = jax.jit(
        quantized_pooled_lookup,
        static_argnames=("weight_type", "dim", "pooling", "bounds_check", "kernel"),
    )
    rows = np.abs(reference.dequantize_rows_loop(np.asarray(packed), weight_type, dim)).max()
    for pooling, weighted, bounds in QUANT_MODES:
        w = weights if weighted else None
        args = (packed, weight_type, dim, ids, offsets, pooling, w)
        got = np.asarray(lookup(*args, bounds_check=bounds, kernel="pallas"))
        what = f"{pooling}, weighted {weighted}, {bounds}"
        np.testing.assert_array_equal(
            got, lookup(*args, bounds_check=bounds, kernel="xla"), err_msg=what
        )
        oracle_ids = reference.bounded_ids(ids, E, bounds)
        want = reference.quantized_pooled_loop(
            np.asarray(packed), weight_type, dim, oracle_ids, offsets, pooling, w
        )
        mags = np.ones(ids.size) if w is None else np.abs(w)
        reach = max(mags[a:b].sum() for a, b in zip(offsets[:-1], offsets[1:], strict=True))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * rows * reach, err_msg=what)
        assert not got[[0, 3]].any(), what  # the empty bags


def test_quant_pooled_sum_pools_a_collection_in_one_call():
    """Four features over three packed tables (int8, int4, fp16; one table read by two
    features, SUM and MEAN), one call writing `[B, sum of dims]`: bit for bit each feature's
    XLA form side by side, and the loops; a feature's `max_length` cuts its reads (MEAN still
    divides by the full length); int64 ids past int32 add nothing instead of wrapping."""
    from sparse_jax._kernels._pallas_quant import QuantFeature, quant_pooled_sum
    from sparse_jax._quant import _xla_form, quantize_rows

    rng = np.random.default_rng(2)
    types, dims, rows = ("int8", "int4", "fp16"), (16, 8, 4), (24, 30, 24)
    tables = [
        quantize_rows(rng.normal(size=(e, d)).astype(np.float32), t, row_alignment=a)
        for t, d, e, a in zip(types, dims, rows, (1, 16, 1), strict=True)
    ]
    B = 6
    features = [  # key, table, type, dim, MEAN, max_length
        QuantFeature(0, 0, "int8", 16, False),
        QuantFeature(1, 1, "int4", 8, True, 2),
        QuantFeature(2, 0, "int8", 16, True),
        QuantFeature(3, 2, "fp16", 4, False),
    ]
    lengths = rng.integers(0, 7, 4 * B)
    lengths[[0, 9]] = 0
    lengths[2 * B + 1] = 30  # a long bag
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    ids = rng.integers(-1, 25, offsets[-1] + 3).astype(np.int64)  # -1, 0 ... E - 1, E
    ids[offsets[B + 1]] = (1 << 32) + 5  # row 5 if wrapped to int32
    weights = rng.uniform(-2.0, 2.0, ids.size).astype(np.float32)
    for weighted, clamp in ((True, False), (False, True)):
        w = jnp.asarray(weights) if weighted else None
        with jax.enable_x64(True):
            got = quant_pooled_sum(
                tables, jnp.asarray(ids), jnp.asarray(offsets), w, stride=B,
                features=features, clamp=clamp, interpret=INTERPRET,
            )  # fmt: skip
            blocks = []
            for f in features:
                form = _xla_form(f.weight_type, f.dim, f.mean, clamp, f.max_length)
                bags = jnp.asarray(offsets[f.key * B : (f.key + 1) * B + 1])
                blocks.append(jax.jit(form)(tables[f.table], jnp.asarray(ids), bags, w)[0])
        what = f"weighted {weighted}, clamp {clamp}"
        np.testing.assert_array_equal(np.asarray(got), np.concatenate(blocks, axis=1), what)
        col = 0
        for f in features:
            e = rows[f.table]
            bag_ids = np.clip(ids, 0, e - 1) if clamp else np.where((ids >= 0) & (ids < e), ids, -1)
            bags = offsets[f.key * B : (f.key + 1) * B + 1]
            if f.max_length is not None:  # the loop reads every id: drop those past the bound
                bag_ids = bag_ids.copy()
                for a, z in zip(bags[:-1], bags[1:], strict=True):
                    bag_ids[a + f.max_length : z] = -1
            want = reference.quantized_pooled_loop(
                np.asarray(tables[f.table]), f.weight_type, f.dim, bag_ids, bags,
                "MEAN" if f.mean else "SUM", weights if weighted else None,
            )  # fmt: skip
            np.testing.assert_allclose(got[:, col : col + f.dim], want, rtol=1e-5, atol=1e-4)
            col += f.dim


@pytest.mark.parametrize("weighted,bounds", [(False, "error"), (True, "clamp")])
def test_the_quantized_collection_pools_every_feature_in_one_pallas_call(weighted, bounds):
    """`QuantEmbeddingBagCollection(kernel="pallas")` (the call a CUDA program makes, here in
    interpret mode): int8, int4 and fp16 tables, one read by two features (SUM and MEAN),
    bit for bit the collection's XLA form, and its default (the C++ kernel on CPU)."""
    from sparse_jax import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        KeyedJaggedTensor,
        PoolingType,
        QuantEmbeddingBagCollection,
    )

    configs = [
        EmbeddingBagConfig(
            name="a", num_embeddings=40, embedding_dim=16, feature_names=["f", "g"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(name="b", num_embeddings=30, embedding_dim=8, feature_names=["h"]),
        EmbeddingBagConfig(name="c", num_embeddings=20, embedding_dim=32, feature_names=["k"]),
    ]  # fmt: skip
    ebc = EmbeddingBagCollection(configs, is_weighted=weighted, bounds_check=bounds)
    params = ebc.init(jax.random.key(1))
    rng = np.random.default_rng(7)
    B = 5
    lengths = rng.integers(0, 6, 4 * B)
    lengths[[1, 12]] = 0
    lengths[3] = 25  # a long bag
    ids = rng.integers(0, 20, lengths.sum())
    ids[:2] = [0, 19]
    w = rng.uniform(0.5, 1.5, ids.size).astype(np.float32) if weighted else None
    # the KJT in another key order than the outputs: a bag block is found by its key
    kjt = KeyedJaggedTensor(["h", "k", "f", "g"], ids, lengths=lengths, weights=w)
    types = {"a": "int8", "b": "int4", "c": "fp16"}
    out = {}
    for kernel in ("pallas", "xla", "auto"):
        qebc = QuantEmbeddingBagCollection.from_float(
            ebc, params, per_table_weight_type=types, kernel=kernel
        )
        out[kernel] = np.asarray(qebc(kjt).values())
    assert out["pallas"].shape == (B, 16 + 16 + 8 + 32)
    np.testing.assert_array_equal(out["pallas"], out["xla"])
    np.testing.assert_array_equal(out["pallas"], out["auto"])
