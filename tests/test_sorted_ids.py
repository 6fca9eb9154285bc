"""The row-sorted id stream that `prepare` builds on the host (`sparse_jax._sorted_ids`) and
the updates that read it (pure XLA: `optim._apply.apply_sorted_runs`; Pallas): the stream against
plain loops (several features on one buffer, MEAN, weights, ids at and past the bounds under
"clamp" and "skip", empty bags, runs in several length buckets and longer than the last);
the buckets against loops (every run whole, in one bucket); the update against the loops
and against the in-program form for every rule, writing nothing under a false guard; the
bucket rungs only grow (one program); the Pallas update (interpret mode) the same bits
either way; and the CUDA programs: no sort, no scatter-add, no `[ids, dim]` temporary."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, optim
from sparse_jax._sorted_ids import CHUNK, RUN_CLASSES
from sparse_jax._update import _bag_grads
from sparse_jax.optim._apply import apply_row_rule, apply_sorted_runs
from tests import reference

# t0 (9 rows) feeds f0 and f1 on one buffer with t1 (6 rows, MEAN); t2 has another dim
TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=9, embedding_dim=4, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(
        name="t1", num_embeddings=6, embedding_dim=4, feature_names=["f2"], pooling="MEAN"
    ),
    EmbeddingBagConfig(name="t2", num_embeddings=5, embedding_dim=8, feature_names=["f3"]),
]
NUM = {"f0": 9, "f1": 9, "f2": 6, "f3": 5}
ROW_OFFSET = {"f0": 0, "f1": 0, "f2": 9, "f3": 0}
B = 4
HYPER = {
    "sgd": dict(lr=0.5),
    "adagrad": dict(lr=0.5, eps=0.3),
    "rowwise_adagrad": dict(lr=0.5, eps=0.3),
    "adam": dict(lr=0.1, beta1=0.8, beta2=0.9, eps=0.3, weight_decay=0.1),
}


def _bags(rng):
    """Per feature B bags of ids in [-1, E] with every boundary, an empty bag and a run
    in the bucket of 8 (row 0 of f0 and f1 six times)."""
    out = {}
    for f, e in NUM.items():
        bags = [
            [int(x) for x in rng.integers(-1, e + 1, size=int(rng.integers(0, 5)))]
            for _ in range(B)
        ]
        bags[0] = [-1, 0, e - 1, e, 0, 0]
        bags[1] = []
        out[f] = bags
    return out


def _batch(bounds, weighted, rng):
    bags = _bags(rng)
    weights = {f: [list(rng.uniform(0.25, 2.0, size=len(b))) for b in bs] for f, bs in bags.items()}
    order = ["f2", "f0", "f3", "f1"]  # KJT keys in another order than the tables'
    values = [i for f in order for b in bags[f] for i in b]
    w = [x for f in order for b in weights[f] for x in b]
    lengths = [len(b) for f in order for b in bags[f]]
    kjt = KeyedJaggedTensor(
        order,
        np.array(values, np.int64),
        lengths=np.array(lengths),
        weights=np.array(w, np.float32),
    )
    ebc = EmbeddingBagCollection(TABLES, is_weighted=weighted, bounds_check=bounds, kernel="xla")
    return ebc, kjt, bags, weights


def _entries(ebc, group, bags, weights, bounds, weighted):
    """(row, bag, scale) of the group's ids in batch order, by loops."""
    members = [s.feature for s in ebc.layout.features if s.group == group]
    order = ["f2", "f0", "f3", "f1"]
    out = []
    for f in order:
        if f not in members:
            continue
        j = members.index(f)
        for b, ids in enumerate(bags[f]):
            for k, i in enumerate(ids):
                if not 0 <= i < NUM[f]:
                    if bounds == "skip":
                        continue
                    i = min(max(i, 0), NUM[f] - 1)
                scale = weights[f][b][k] if weighted else 1.0
                if f == "f2":
                    scale = scale / len(ids)
                out.append((i + ROW_OFFSET[f], j * B + b, scale))
    return out


@pytest.mark.parametrize("bounds", ["clamp", "skip"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_host_sorted_stream_matches_loops(bounds, weighted):
    ebc, kjt, bags, weights = _batch(
        bounds, weighted, np.random.default_rng([weighted, len(bounds)])
    )
    batch = ebc.prepare(kjt)
    assert set(batch.sorted_ids) == set(ebc.layout.groups)
    for group, ids in batch.sorted_ids.items():
        num_rows, members = (
            ebc.layout.groups[group][0],
            [s for s in ebc.layout.features if s.group == group],
        )
        want = reference.sorted_runs(_entries(ebc, group, bags, weights, bounds, weighted))
        unique, offsets, bag, scale = want
        u, n = len(unique), len(bag)
        got = jax.tree_util.tree_map(np.asarray, ids)
        np.testing.assert_array_equal(got.unique[:u], unique)
        np.testing.assert_array_equal(got.offsets[: u + 1], offsets)
        np.testing.assert_array_equal(got.bag[:n], bag)
        np.testing.assert_allclose(got.scale[:n], scale, rtol=1e-6)
        # padding: out-of-range rows and bags, empty runs, zero scales
        assert (got.unique[u:] == num_rows).all() and (got.offsets[u:] == n).all()
        assert (got.bag[n:] == len(members) * B).all() and (got.scale[n:] == 0).all()
        filled = _assert_buckets(got, want, num_rows, len(members) * B)
        assert filled[4] + filled[8] >= 1  # row 0, four to eight times
        assert got.long is None


def _assert_buckets(got, want, num_rows: int, no_bag: int) -> dict:
    """`got.buckets` / `got.long` hold the runs of `want` (`reference.sorted_runs`) as
    `reference.run_buckets` puts them: each run whole, in order, in exactly one bucket, the
    padding out of range. Returns the number of runs per bucket cap."""
    unique, offsets, bag, scale = want
    buckets, long = reference.run_buckets(unique, offsets, bag, scale, RUN_CLASSES, CHUNK)
    assert [b.bag.shape[1] for b in got.buckets] == list(RUN_CLASSES)
    seen = []
    for cap, got_b in zip(RUN_CLASSES, got.buckets, strict=True):
        runs = buckets[cap]
        r = len(runs)
        np.testing.assert_array_equal(got_b.rows[:r], [run[0] for run in runs])
        for i, (_, bags, scales) in enumerate(runs):
            k = len(bags)
            np.testing.assert_array_equal(got_b.bag[i, :k], bags)
            np.testing.assert_allclose(got_b.scale[i, :k], scales, rtol=1e-6)
            assert (got_b.bag[i, k:] == no_bag).all() and (got_b.scale[i, k:] == 0).all()
        assert (got_b.rows[r:] == num_rows).all()
        assert (got_b.bag[r:] == no_bag).all() and (got_b.scale[r:] == 0).all()
        seen += [run[0] for run in runs]
    if not long:
        assert got.long is None or (got.long.rows == num_rows).all()
    else:
        k_cap = got.long.bag.shape[0]
        np.testing.assert_array_equal(got.long.rows[: len(long)], [run[0] for run in long])
        assert (got.long.rows[len(long) :] == num_rows).all()
        used = []
        for i, (_, parts) in enumerate(long):
            index = got.long.chunks[i]
            assert (index[: len(parts)] < k_cap).all() and (index[len(parts) :] == k_cap).all()
            for c, (bags, scales) in zip(index[: len(parts)], parts, strict=True):
                np.testing.assert_array_equal(got.long.bag[c, : len(bags)], bags)
                np.testing.assert_allclose(got.long.scale[c, : len(bags)], scales, rtol=1e-6)
                assert (got.long.bag[c, len(bags) :] == no_bag).all()
                used.append(int(c))
        assert len(set(used)) == len(used)  # no chunk read twice
        seen += [run[0] for run in long]
    assert sorted(seen) == list(unique)  # every run in exactly one place
    return {cap: len(buckets[cap]) for cap in RUN_CLASSES}


@pytest.mark.parametrize("rule", sorted(HYPER))
def test_the_sorted_run_update_matches_loops_and_the_in_program_form(rule):
    rng = np.random.default_rng(len(rule))
    ebc, kjt, bags, weights = _batch("clamp", True, rng)
    batch = ebc.prepare(kjt)
    params = ebc.init(jax.random.key(1))
    opt = getattr(optim, rule)(**HYPER[rule])
    state = opt.init(params)
    grad = jnp.asarray(rng.normal(size=(B, 20)).astype(np.float32))
    group = next(g for g in ebc.layout.groups if ebc.layout.groups[g][1] == 4)
    table, st = params[group], state.tables[group]
    bag_grads = _bag_grads(ebc.layout, group, grad)
    step = jnp.int32(1)
    new, new_state = jax.jit(lambda t, s, ids, g: apply_sorted_runs(opt, t, s, step, ids, g))(
        table, st, batch.sorted_ids[group], bag_grads
    )
    # the in-program form (sort inside the program), as a GPU takes it (no scatter-add)
    from sparse_jax import _lookup

    rows, bag, scale = _lookup.id_stream(
        batch.kjt, ebc.layout, group, weighted=True, bounds_check="clamp"
    )
    old, old_state = apply_row_rule(
        opt, table, st, step, rows, bag, scale, bag_grads, scatter_add=False
    )
    for a, b in zip(
        jax.tree_util.tree_leaves((new, new_state)),
        jax.tree_util.tree_leaves((old, old_state)),
        strict=True,
    ):
        # on CPU both forms add a run's ids in batch order; a GPU's scatter-adds may not
        tol = (
            dict(rtol=1e-6, atol=1e-7)
            if jax.default_backend() == "cpu"
            else dict(rtol=2e-5, atol=1e-6)
        )
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)
    # the loops
    entries = _entries(ebc, group, bags, weights, "clamp", True)
    row_grads: dict = {}
    g = np.asarray(bag_grads, np.float64)
    for row, b, s in entries:
        row_grads[row] = row_grads.get(row, 0.0) + s * g[b]
    want = {group: np.asarray(table, np.float64)}
    reference.fused_step(rule, HYPER[rule], want, {}, {group: row_grads}, 1)
    np.testing.assert_allclose(np.asarray(new), want[group], rtol=2e-5, atol=1e-6)
    # a false guard writes nothing
    kept, kept_state = jax.jit(
        lambda t, s, ids, g: apply_sorted_runs(opt, t, s, step, ids, g, good=jnp.array(False))
    )(table, st, batch.sorted_ids[group], bag_grads)
    for a, b in zip(
        jax.tree_util.tree_leaves((kept, kept_state)),
        jax.tree_util.tree_leaves((table, st)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_xla_step_lowered_for_cuda_sorts_nothing_and_keeps_no_id_sized_rows():
    from tests.test_gpu_lowering import audit

    T, E, D, Bn, L = 2, 5000, 16, 256, 8
    tables = [
        EmbeddingBagConfig(name=f"t{t}", num_embeddings=E, embedding_dim=D, feature_names=[f"f{t}"])
        for t in range(T)
    ]
    rng = np.random.default_rng(0)
    kjt = KeyedJaggedTensor(
        ["f0", "f1"], rng.integers(0, E, T * Bn * L), lengths=np.full(T * Bn, L)
    )
    texts = {}
    for sort in (True, False):
        ebc = EmbeddingBagCollection(tables, kernel="xla", sort_ids=sort)
        batch = ebc.prepare(kjt)
        params = jax.eval_shape(ebc.init, jax.random.key(0))
        r = optim.rowwise_adagrad(lr=0.1)
        from sparse_jax import make_update

        update = make_update(ebc, r, skip_nonfinite=True)
        operands = ebc.update_operands(batch, jnp.zeros((Bn, T * D)))
        texts[sort] = (
            update.jitted.trace(
                params,
                jax.eval_shape(r.init, params),
                operands,
                jnp.ones((1,), bool),
                (jnp.int32(0), jnp.int32(-1)),
                jnp.int32(0),
            )
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    n_cap = int(batch.kjt.capacity())
    assert "stablehlo.sort" in texts[False]  # the in-program form sorts
    assert re.search(rf"tensor<{n_cap}x{D}xf32>", texts[False])  # and gathers [ids, dim]
    text = texts[True]
    got = audit(text)
    assert "stablehlo.sort" not in text and got["case_or_if"] == 0, got
    assert got["dynamic_loops"] == 0 and got["cpu_custom_calls"] == 0, got
    # the runs are summed by gathers: no scatter-add over repeated rows
    assert got["float_scatter_add_non_unique"] == 0, got
    assert not re.search(rf"tensor<{n_cap}x{D}xf32>", text), "an [ids, dim] temporary"


def test_the_pallas_update_reads_the_host_runs_with_the_same_bits():
    from sparse_jax import make_update

    rng = np.random.default_rng(5)
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}", num_embeddings=40, embedding_dim=8, feature_names=[f"f{t}"]
        )
        for t in range(2)
    ]
    lengths = rng.integers(0, 6, 2 * B)
    ids = (rng.zipf(1.3, lengths.sum()) - 1) % 40  # long runs
    kjt = KeyedJaggedTensor(
        ["f0", "f1"], ids, lengths=lengths, weights=rng.random(lengths.sum()).astype(np.float32)
    )
    grad = jnp.asarray(rng.normal(size=(B, 16)).astype(np.float32))
    out, texts = [], []
    for sort in (False, True):
        ebc = EmbeddingBagCollection(tables, is_weighted=True, kernel="pallas", sort_ids=sort)
        params = ebc.init(jax.random.key(0))
        r = optim.rowwise_adagrad(lr=0.1)
        update = make_update(ebc, r)
        batch = ebc.prepare(kjt)
        operands = ebc.update_operands(batch, grad)
        traced = update.jitted.trace(params, r.init(params), operands)
        texts.append(traced.lower(lowering_platforms=("cuda",)).as_text())
        out.append(jax.tree_util.tree_leaves(update(params, r.init(params), batch, grad)))
    for a, b in zip(*out, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "stablehlo.sort" in texts[0] and "stablehlo.sort" not in texts[1]
    assert "xla.gpu.triton" in texts[1]


def _hot_batch(rng, hot: int):
    """Two features on one buffer, a hot row (`hot` ids of row 3) and Zipf ids around it."""
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}", num_embeddings=50, embedding_dim=8, feature_names=[f"f{t}"]
        )
        for t in range(2)
    ]
    lengths = rng.integers(0, 8, 2 * B * 8)
    ids = (rng.zipf(1.3, lengths.sum()) - 1) % 50
    lengths[0] += hot
    ids = np.concatenate([np.full(hot, 3), ids])
    weights = rng.uniform(0.25, 2.0, ids.size).astype(np.float32)
    kjt = KeyedJaggedTensor(["f0", "f1"], ids, lengths=lengths, weights=weights)
    return tables, kjt


def test_long_runs_carry_chunks_that_split_every_run_in_order():
    from sparse_jax._sorted_ids import LONG_RUN, chunk_size

    rng = np.random.default_rng(11)
    tables, kjt = _hot_batch(rng, hot=300)
    ebc = EmbeddingBagCollection(tables, is_weighted=True, kernel="pallas", sort_ids=True)
    (ids,) = ebc.prepare(kjt).sorted_ids.values()
    ids = jax.tree_util.tree_map(np.asarray, ids)
    n = int(ids.offsets[-1])
    u = int((ids.unique < 100).sum())
    longest = int(np.diff(ids.offsets[: u + 1]).max())
    assert longest > LONG_RUN
    starts, first = reference.run_chunks(
        ids.unique[:u].tolist(), ids.offsets[: u + 1].tolist(), chunk_size(longest)
    )
    k = len(starts) - 1
    np.testing.assert_array_equal(ids.chunks[: k + 1], starts)
    np.testing.assert_array_equal(ids.run_chunks[: u + 1], first)
    assert (ids.chunks[k:] == n).all() and (ids.run_chunks[u:] == k).all()  # padding: empty
    # short runs only: no chunks, the update takes the one-pass kernel
    (short,) = ebc.prepare(_hot_batch(rng, hot=0)[1]).sorted_ids.values()
    assert short.chunks is None and short.run_chunks is None


@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad", "adam"])
def test_the_chunked_pallas_update_equals_the_loops_and_repeats_its_bits(rule):
    from sparse_jax import make_update

    rng = np.random.default_rng(len(rule))
    tables, kjt = _hot_batch(rng, hot=300)
    ebc = EmbeddingBagCollection(tables, is_weighted=True, kernel="pallas", sort_ids=True)
    batch = ebc.prepare(kjt)
    (ids,) = batch.sorted_ids.values()
    assert ids.chunks is not None
    opt = getattr(optim, rule)(**HYPER[rule])
    params = ebc.init(jax.random.key(2))
    grad = jnp.asarray(rng.normal(size=(2 * B * 8 // 2, 16)).astype(np.float32))
    update = make_update(ebc, opt)
    start = jax.tree_util.tree_map(np.asarray, params)  # the update donates its operands
    outs = [
        jax.tree_util.tree_leaves(
            update(jax.tree_util.tree_map(jnp.asarray, start), opt.init(params), batch, grad)
        )
        for _ in range(2)
    ]
    for a, b in zip(*outs, strict=True):  # no atomics: the same bits
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (group,) = ebc.layout.groups
    entries, g = [], np.asarray(grad, np.float64)
    vals, lens, w = (np.asarray(x) for x in (kjt.values(), kjt.lengths(), kjt.weights()))
    pos = 0
    for f in range(2):
        for b in range(kjt.stride()):
            for _ in range(lens[f * kjt.stride() + b]):
                entries.append((int(vals[pos]) + 50 * f, f * kjt.stride() + b, float(w[pos])))
                pos += 1
    row_grads: dict = {}
    for row, bag, s in entries:
        col = (bag // kjt.stride()) * 8
        row_grads[row] = row_grads.get(row, 0.0) + s * g[bag % kjt.stride(), col : col + 8]
    want = {group: np.asarray(start[group], np.float64)}
    reference.fused_step(rule, HYPER[rule], want, {}, {group: row_grads}, 1)
    np.testing.assert_allclose(np.asarray(outs[0][0]), want[group], rtol=2e-5, atol=1e-5)
    # lowered for a GPU: the chunk sums and the update, two Triton kernels, no sort
    operands = ebc.update_operands(batch, grad)
    text = (
        update.jitted.trace(start, opt.init(start), operands)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert text.count("xla.gpu.triton") == 2 and "stablehlo.sort" not in text


def _stream_of(ids, num_rows: int):
    """(unique, offsets, bag, scale) of a host-sorted stream without its padding."""
    u = int((ids.unique < num_rows).sum())
    n = int(ids.offsets[u])
    return (
        ids.unique[:u].tolist(),
        ids.offsets[: u + 1].tolist(),
        ids.bag[:n].tolist(),
        ids.scale[:n].tolist(),
    )


@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad", "adam"])
def test_buckets_hold_every_run_whole_and_the_xla_update_equals_the_loops(rule):
    """A hot row of 300 ids (cut into chunks of CHUNK) and Zipf runs of every length: the
    buckets as the loops make them, and the pure-XLA update against the loops."""
    from sparse_jax import make_update

    rng = np.random.default_rng(len(rule) + 7)
    tables, kjt = _hot_batch(rng, hot=300)
    ebc = EmbeddingBagCollection(tables, is_weighted=True, kernel="xla")
    batch = ebc.prepare(kjt)
    (ids,) = jax.tree_util.tree_map(np.asarray, batch.sorted_ids).values()
    filled = _assert_buckets(ids, _stream_of(ids, 100), 100, 2 * kjt.stride())
    assert sum(n > 0 for n in filled.values()) >= 4 and ids.long is not None
    opt = getattr(optim, rule)(**HYPER[rule])
    params = ebc.init(jax.random.key(2))
    start = jax.tree_util.tree_map(np.asarray, params)
    grad = jnp.asarray(rng.normal(size=(kjt.stride(), 16)).astype(np.float32))
    new = make_update(ebc, opt)(params, opt.init(params), batch, grad)[0]
    (group,) = ebc.layout.groups
    g = np.asarray(grad, np.float64)
    vals, lens, w = (np.asarray(x) for x in (kjt.values(), kjt.lengths(), kjt.weights()))
    row_grads: dict = {}
    pos = 0
    for f in range(2):
        for b in range(kjt.stride()):
            for _ in range(lens[f * kjt.stride() + b]):
                row = int(vals[pos]) + 50 * f
                step = float(w[pos]) * g[b, f * 8 : f * 8 + 8]
                row_grads[row] = row_grads.get(row, 0.0) + step
                pos += 1
    want = {group: np.asarray(start[group], np.float64)}
    reference.fused_step(rule, HYPER[rule], want, {}, {group: row_grads}, 1)
    np.testing.assert_allclose(np.asarray(new[group]), want[group], rtol=2e-5, atol=1e-5)


def test_bucket_rungs_only_grow_so_a_steady_loop_keeps_one_program():
    """Smaller batches after a hot one keep its bucket shapes (the other fields of the
    stream follow their own ladders)."""
    from sparse_jax import make_update

    rng = np.random.default_rng(3)
    tables, hot = _hot_batch(rng, hot=300)
    ebc = EmbeddingBagCollection(tables, is_weighted=True, kernel="xla")
    opt = optim.rowwise_adagrad(lr=0.1)
    update = make_update(ebc, opt)
    params = ebc.init(jax.random.key(0))
    state = opt.init(params)
    shapes = []
    for kjt in (hot, _hot_batch(rng, hot=0)[1], _hot_batch(rng, hot=100)[1]):
        batch = ebc.prepare(kjt)
        (ids,) = batch.sorted_ids.values()
        shapes.append(jax.tree_util.tree_map(lambda x: x.shape, (ids.buckets, ids.long)))
        grad = jnp.asarray(rng.normal(size=(kjt.stride(), 16)).astype(np.float32))
        params, state = update(params, state, batch, grad)
    assert shapes[1] == shapes[0] == shapes[2]  # the long-run part stays, empty
