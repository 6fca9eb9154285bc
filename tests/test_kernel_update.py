"""The fused update on both kernel paths, and the pooled lookup on all three, against plain
loops: every rule the C++ kernel has,
SUM and MEAN, per-id weights, ids at and past the table's bounds under "clamp" and "skip",
several features on one buffer, dims with and without a compiled width; the C++ kernel's
id-stream form (what sharded code calls) with dropped entries; the same bits whatever the
thread count. Hyper-parameters are chosen so that a misplaced `eps`, a wrong divisor or a
bounds check off by one changes the result far beyond the tolerance."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    _kernels,
    make_update,
    optim,
)
from tests import reference

pytestmark = pytest.mark.skipif(
    not _kernels.available(), reason="the C++ kernels are not built here"
)

# eps large next to sqrt(state): sqrt(s + eps) or sqrt(s) + eps * 2 are far off
HYPER = {
    "sgd": dict(lr=0.5),
    "adagrad": dict(lr=0.5, eps=0.3),
    "rowwise_adagrad": dict(lr=0.5, eps=0.3),
}
# (feature, table, pooling); t0 feeds two features; dims 64 (compiled width) and 12 (generic)
TABLES = [
    ("t0", 9, 64, "SUM", ["f0", "f1"]),
    ("t1", 6, 64, "MEAN", ["f2"]),
    ("t2", 5, 12, "MEAN", ["f3"]),
]
BATCH = 5


def _configs():
    return [
        EmbeddingBagConfig(name=n, num_embeddings=e, embedding_dim=d, pooling=p, feature_names=fs)
        for n, e, d, p, fs in TABLES
    ]


def _bags(rng):
    """Per feature, BATCH bags of ids in [-1, E] (every boundary: -1, 0, E-1, E), some empty."""
    out = {}
    for _, e, _, _, feats in TABLES:
        for f in feats:
            bags = [
                [int(x) for x in rng.integers(-1, e + 1, size=int(rng.integers(0, 6)))]
                for _ in range(BATCH)
            ]
            bags[0] = [-1, 0, e - 1, e, 0]  # the boundaries, and a duplicate
            bags[1] = []
            out[f] = bags
    return out


def _kjt(bags, weights, order):
    values, lengths, w = [], [], []
    for f in order:
        for b in range(BATCH):
            values += bags[f][b]
            w += weights[f][b]
            lengths.append(len(bags[f][b]))
    return KeyedJaggedTensor(
        order,
        np.array(values, np.int64),
        lengths=np.array(lengths),
        weights=np.array(w, np.float32),
    )


def _expected_row_grads(bags, weights, grad, bounds, weighted):
    """{table: {row: float64 grad}} by loops: clamp moves an id to the nearest row, skip
    drops it; MEAN divides by the bag's full length (skipped ids included)."""
    out, col = {}, 0
    for name, e, d, pooling, feats in TABLES:
        for f in feats:
            for b, ids in enumerate(bags[f]):
                for j, i in enumerate(ids):
                    if not 0 <= i < e:
                        if bounds == "skip":
                            continue
                        i = min(max(i, 0), e - 1)
                    scale = weights[f][b][j] if weighted else 1.0
                    if pooling == "MEAN":
                        scale = scale / len(ids)
                    g = scale * grad[b, col : col + d].astype(np.float64)
                    rows = out.setdefault(name, {})
                    rows[i] = rows.get(i, 0.0) + g
            col += d
    return out


@pytest.mark.parametrize("rule", sorted(HYPER))
@pytest.mark.parametrize("bounds", ["clamp", "skip"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kernel", ["xla", "ffi"])
def test_three_steps_with_boundary_ids_match_loops(rule, bounds, weighted, kernel):
    rng = np.random.default_rng([len(rule), weighted, bounds == "skip"])
    ebc = EmbeddingBagCollection(
        _configs(), is_weighted=weighted, bounds_check=bounds, kernel=kernel
    )
    params = ebc.init(jax.random.key(3))
    opt = getattr(optim, rule)(**HYPER[rule])
    update = make_update(ebc, opt)
    opt_state = opt.init(params)
    expected = {k: np.asarray(v, np.float64) for k, v in ebc.table_weights(params).items()}
    states: dict = {}
    dims = sum(d * len(fs) for _, _, d, _, fs in TABLES)
    for step in range(1, 4):
        bags = _bags(rng)
        weights = {
            f: [list(rng.uniform(0.25, 2.0, size=len(b))) for b in bs] for f, bs in bags.items()
        }
        order = list(rng.permutation(sorted(bags)))  # KJT keys in any order
        grad = rng.normal(size=(BATCH, dims)).astype(np.float32)
        params, opt_state = update(params, opt_state, _kjt(bags, weights, order), jnp.asarray(grad))
        row_grads = _expected_row_grads(bags, weights, grad, bounds, weighted)
        reference.fused_step(rule, HYPER[rule], expected, states, row_grads, step)
    got = ebc.table_weights(params)
    for name, want in expected.items():
        np.testing.assert_allclose(
            np.asarray(got[name]), want, rtol=2e-5, atol=1e-6, err_msg=f"table {name}"
        )


@pytest.mark.parametrize("rule", sorted(HYPER))
def test_id_stream_form_drops_out_of_range_entries(rule):
    """`_kernels.fused_update` (rows, bags, scale, bag_grads): rows or bags outside their
    range, and scale 0, contribute nothing; the rest is summed per row before the rule."""
    rng = np.random.default_rng(7)
    rows_n, dim, bags_n, n = 13, 16, 6, 80
    table = rng.normal(size=(rows_n, dim)).astype(np.float32)
    state = (
        np.zeros(0, np.float32)
        if rule == "sgd"
        else rng.uniform(
            0.1, 1, size=rows_n if rule == "rowwise_adagrad" else (rows_n, dim)
        ).astype(np.float32)
    )
    rows = rng.integers(-1, rows_n + 1, size=n).astype(np.int32)
    bags = rng.integers(-1, bags_n + 1, size=n).astype(np.int32)
    scale = rng.uniform(0.5, 1.5, size=n).astype(np.float32)
    scale[::7] = 0.0
    rows[:4] = [0, rows_n - 1, rows_n, -1]
    bag_grads = rng.normal(size=(bags_n, dim)).astype(np.float32)
    got_t, got_s = _kernels.fused_update(
        rule,
        jnp.array(table),
        jnp.array(state) if state.size else None,
        jnp.array(rows),
        jnp.array(bags),
        jnp.array(scale),
        jnp.array(bag_grads),
        **HYPER[rule],
    )
    want = {"t": table.astype(np.float64)}
    states = (
        {
            "t": {
                r: {
                    "momentum1": np.float64(state[r])
                    if rule == "rowwise_adagrad"
                    else state[r].astype(np.float64)
                }
                for r in range(rows_n)
            }
        }
        if state.size
        else {}
    )
    grads: dict = {}
    for r, b, s in zip(rows, bags, scale, strict=True):
        if 0 <= r < rows_n and 0 <= b < bags_n and s != 0:
            grads[int(r)] = grads.get(int(r), 0.0) + float(s) * bag_grads[b].astype(np.float64)
    reference.fused_step(rule, HYPER[rule], want, states, {"t": grads}, 1)
    np.testing.assert_allclose(np.asarray(got_t), want["t"], rtol=2e-5, atol=1e-6)
    if state.size:
        got_state = np.asarray(got_s).reshape(state.shape)
        want_state = np.array([states["t"][r]["momentum1"] for r in range(rows_n)]).reshape(
            state.shape
        )
        np.testing.assert_allclose(got_state, want_state, rtol=2e-5)


_DETERMINISM = """
import hashlib, jax, jax.numpy as jnp, numpy as np
from sparse_jax import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, make_update, optim
rng = np.random.default_rng(0)
tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=3000, embedding_dim=32, feature_names=[f"f{i}"])
          for i in range(2)]
ebc = EmbeddingBagCollection(tables, kernel="ffi")
params = ebc.init(jax.random.key(0))
opt = optim.rowwise_adagrad(lr=0.1)
update, state = make_update(ebc, opt), opt.init(params)
lengths = rng.integers(0, 40, size=2 * 2048)
kjt = KeyedJaggedTensor(["f0", "f1"], rng.zipf(1.2, size=int(lengths.sum())) % 3000, lengths=lengths)
grad = jnp.asarray(rng.normal(size=(2048, 64)).astype(np.float32))
params, state = update(params, state, kjt, grad)
print(hashlib.sha256(np.asarray(params[next(iter(params))]).tobytes()).hexdigest())
"""


def test_update_bits_do_not_depend_on_the_thread_count():
    """~80k ids (several sort and apply chunks per thread): 1 and 2 OpenMP threads give the
    same bits (each row's gradient is summed in the ids' order)."""
    digests = []
    for threads in ("1", "2"):
        env = dict(os.environ, OMP_NUM_THREADS=threads)
        env.pop("XLA_FLAGS", None)
        done = subprocess.run(
            [sys.executable, "-c", _DETERMINISM],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        assert done.returncode == 0, done.stderr[-2000:]
        digests.append(done.stdout.strip().splitlines()[-1])
    assert digests[0] == digests[1]


@pytest.mark.parametrize("bounds", ["clamp", "skip"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kernel", ["xla", "ffi", "reference"])
def test_forward_with_boundary_ids_matches_loops(bounds, weighted, kernel):
    """The pooled lookup on every path, ids -1, 0, E-1 and E in the bags: clamp moves an id
    to the nearest row, skip drops it, and MEAN divides by the bag's full length (skipped
    ids included, as TorchRec's `bounds_check_mode` does)."""
    rng = np.random.default_rng([weighted, bounds == "skip", len(kernel)])
    ebc = EmbeddingBagCollection(
        _configs(), is_weighted=weighted, bounds_check=bounds, kernel=kernel
    )
    params = ebc.init(jax.random.key(1))
    tables = {k: np.asarray(v, np.float64) for k, v in ebc.table_weights(params).items()}
    bags = _bags(rng)
    weights = {f: [list(rng.uniform(0.25, 2.0, size=len(b))) for b in bs] for f, bs in bags.items()}
    got = np.asarray(ebc.apply(params, _kjt(bags, weights, sorted(bags))).values())
    col = 0
    for name, e, d, pooling, feats in TABLES:
        for f in feats:
            for b, ids in enumerate(bags[f]):
                want = np.zeros(d)
                for j, i in enumerate(ids):
                    if not 0 <= i < e:
                        if bounds == "skip":
                            continue
                        i = min(max(i, 0), e - 1)
                    want += (weights[f][b][j] if weighted else 1.0) * tables[name][i]
                if pooling == "MEAN" and ids:
                    want /= len(ids)
                np.testing.assert_allclose(
                    got[b, col : col + d],
                    want,
                    rtol=1e-5,
                    atol=1e-6,
                    err_msg=f"{kernel} {f} bag {b} ids {ids}",
                )
            col += d
