"""sparse_jax against TorchRec 1.8.0 + FBGEMM (fbgemm-gpu-cpu 1.8.0), the oracles, on CPU.

Pooled lookups: the same weights and bags through TorchRec's `EmbeddingBagCollection` and
ours give the same pooled KeyedTensor (SUM, MEAN, both in one collection, weighted, a
shared table, tables of two dims, empty bags).

Fused optimizers: FBGEMM's `SplitTableBatchedEmbeddingBagsCodegen` (TBE: `HOST` weights,
`ComputeDevice.CPU`, the kernel under TorchRec's fused EBC) and our `make_update` start
from the same weights and take the same 3 steps (forward, then the backward of a fixed
pooled gradient) on 3 different batches with an id twice in one bag, an id in two bags,
the same row from both features of a shared table, and empty bags. A TBE has one pooling
mode, so a collection mixing SUM and MEAN tables is compared with two TBEs. Weights and
optimizer state must then agree to fp32 rounding.

FBGEMM's CPU rules (codegen/genscript/optimizers.py, `split_weight_update_cpu`, run once
per distinct row of a table; `g` = that row's gradient summed over its ids, each id's
share = pooled grad x per-sample weight, x 1/L for MEAN):
  EXACT_SGD:             w -= lr * g
  EXACT_ADAGRAD:         m += g * g (per element, starts at 0);  w -= lr * g / (sqrt(m) + eps)
  EXACT_ROWWISE_ADAGRAD: m += mean_d(g * g) (one float per row, starts at 0);
                         w -= lr / (sqrt(m) + eps) * g   (weight_decay_mode NONE; non-shared
                         fp32 tables go through fbgemm's GenerateSparseAdaGrad(rowwise=true),
                         shared tables through the generic loop: same formula)
  ADAM:                  no CPU kernel (`has_cpu_support: False`; the TBE constructor asserts).
                         Checked against FBGEMM's CUDA rule (`adam`, `split_weight_update`),
                         lazy, t = global step (TBE's `iter`, 1-based):
                         m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
                         w -= lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd * w)
Not compared: weighted MEAN. TorchRec refuses it (nn.EmbeddingBag takes per-sample weights
for mode="sum" only); FBGEMM's CPU forward divides the weighted sum by L but its backward
drops the 1/L when weights are given (`csr2csc`: "MEAN pooling will not work with
indice_weights!"), so its update is not the gradient of its output. Ours uses w/L in both.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import pytest

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import jax  # noqa: E402
import torch  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType  # noqa: E402
from fbgemm_gpu.split_embedding_configs import SparseType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: E402
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: E402
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules import embedding_configs as tr_configs  # noqa: E402
from torchrec.modules.embedding_modules import (  # noqa: E402
    EmbeddingBagCollection as TorchRecEBC,
)
from torchrec.sparse import jagged_tensor as tr_jt  # noqa: E402

from sparse_jax import (  # noqa: E402
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    PoolingType,
    make_update,
    optim,
)

pytestmark = pytest.mark.parity

FWD_TOL = dict(rtol=1e-6, atol=1e-6)
OPT_TOL = dict(rtol=1e-5, atol=1e-6)  # fp32 after 3 steps; the summation orders differ
BATCH = 5
STEPS = 3
MAX_LEN = 3  # every batch has a bag of 3 in every feature: the same length caps each step
CAPACITY = 64  # >= 4 features x 5 bags x 3 ids: one capacity, one compiled program per test
SUM, MEAN = PoolingType.SUM, PoolingType.MEAN


class Table(NamedTuple):
    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    pooling: PoolingType = SUM


# Tables in config order. SUM tables come first, so a TBE per pooling mode gives the
# output columns in our order. Our groups: fp32_d4 = t_small (rows 0-6) + t_shared (rows
# 7-18, MEAN, two features), fp32_d8 = t_wide. In FBGEMM's CPU backward the shared table
# takes the generic loop, the others (rowwise adagrad) fbgemm's SparseAdaGrad kernel.
SEVERAL = [
    Table("t_small", 7, 4, ("c",)),
    Table("t_wide", 6, 8, ("d",)),
    Table("t_shared", 12, 4, ("a", "b"), MEAN),
]
SHARED = [Table("t", 9, 4, ("f", "g"))]


def _pooled(spec, pooling):
    return [t._replace(pooling=pooling) for t in spec]


# ------------------------------------------------------------------------------ helpers


def _features(spec):
    return [f for t in spec for f in t.features]


def _weights(spec, seed):
    rng = np.random.default_rng(seed)
    return {t.name: rng.uniform(-1.0, 1.0, (t.rows, t.dim)).astype(np.float32) for t in spec}


def _bags(spec, seed, *, weighted=False, empty=False):
    """{feature: [(ids int64, weights float32 or None) per sample]}.

    Random bags of 0..MAX_LEN ids, then fixed repeats in every feature k (row `a`): bag 1 is
    [a, b, a] (twice in one bag), bag 3 is [a] (in two bags), bag 0 or 2 is empty; for a
    shared table the second feature's bag 4 is the first feature's row `a` (both features).
    """
    rng = np.random.default_rng(seed)
    rows = {f: t.rows for t in spec for f in t.features}
    out = {}
    for k, (f, r) in enumerate(rows.items()):
        lengths = np.zeros(BATCH, int) if empty else rng.integers(0, MAX_LEN + 1, BATCH)
        bags = [rng.integers(0, r, n) for n in lengths]
        if not empty:
            a, b = (seed + 2 * k) % r, (seed + 2 * k + 1) % r
            bags[1], bags[3], bags[2 * (k % 2)] = [a, b, a], [a], []
        out[f] = bags
    if not empty:
        for t in spec:
            if len(t.features) > 1:
                out[t.features[1]][4] = [out[t.features[0]][1][0]]
    return {
        f: [
            (
                np.asarray(ids, np.int64),
                rng.uniform(0.5, 1.5, len(ids)).astype(np.float32) if weighted else None,
            )
            for ids in bags
        ]
        for f, bags in out.items()
    }


def _flat(bags, keys):
    """Key-major values / weights / lengths of `keys` (the KJT layout, and TBE's)."""
    ids = [i for k in keys for i, _ in bags[k]]
    ws = [w for k in keys for _, w in bags[k]]
    values = np.concatenate(ids).astype(np.int64)
    weights = None if ws[0] is None else np.concatenate(ws).astype(np.float32)
    lengths = np.array([len(i) for i in ids], np.int64)
    return values, weights, lengths


def _our_kjt(bags, keys, capacity=None):
    values, weights, lengths = _flat(bags, keys)
    kjt = KeyedJaggedTensor(keys, values.astype(np.int32), weights, lengths.astype(np.int32))
    return kjt if capacity is None else kjt.pad(capacity=capacity)


def _torchrec_kjt(bags, keys):
    values, weights, lengths = _flat(bags, keys)
    return tr_jt.KeyedJaggedTensor(
        keys=list(keys),
        values=torch.from_numpy(values),
        weights=None if weights is None else torch.from_numpy(weights),
        lengths=torch.from_numpy(lengths),
    )


def _ours(spec, weights, *, weighted=False, data_type="FP32"):
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.rows,
            embedding_dim=t.dim,
            feature_names=t.features,
            pooling=t.pooling,
            data_type=data_type,
        )
        for t in spec
    ]
    ebc = EmbeddingBagCollection(configs, is_weighted=weighted)
    narrow = {n: w.astype(np.float16) if data_type == "FP16" else w for n, w in weights.items()}
    return ebc, ebc.with_table_weights(ebc.init(jax.random.key(0)), narrow)


def _pooled_grad(spec, seed):
    width = sum(t.dim * len(t.features) for t in spec)
    return np.random.default_rng(seed).standard_normal((BATCH, width)).astype(np.float32)


# -------------------------------------------------------------------------- pooled lookup

FORWARD_CASES = {
    # name: (tables, weighted, every bag empty)
    "sum": (_pooled(SEVERAL, SUM), False, False),
    "mean": (_pooled(SEVERAL, MEAN), False, False),
    "sum_and_mean_tables": (SEVERAL, False, False),
    "weighted": (_pooled(SEVERAL, SUM), True, False),
    "one_shared_table": (SHARED, False, False),
    "all_bags_empty": (SEVERAL, False, True),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))  # all_bags_empty: a KJT with zero ids
def test_pooled_output_matches_torchrec_ebc(case):
    spec, weighted, empty = FORWARD_CASES[case]
    weights = _weights(spec, seed=1)
    bags = _bags(spec, seed=2, weighted=weighted, empty=empty)
    keys = _features(spec)[::-1]  # the KJT's key order is not the tables' order

    theirs = TorchRecEBC(
        tables=[
            tr_configs.EmbeddingBagConfig(
                name=t.name,
                num_embeddings=t.rows,
                embedding_dim=t.dim,
                feature_names=list(t.features),
                pooling=tr_configs.PoolingType[t.pooling.name],
            )
            for t in spec
        ],
        is_weighted=weighted,
    )
    theirs.load_state_dict(
        {f"embedding_bags.{n}.weight": torch.from_numpy(w) for n, w in weights.items()}
    )
    want = theirs(_torchrec_kjt(bags, keys))

    ebc, params = _ours(spec, weights, weighted=weighted)
    got = ebc.apply(params, _our_kjt(bags, keys))

    assert got.keys() == list(want.keys())  # (no feature name is in two tables: no "f@t" keys)
    assert got.length_per_key() == list(want.length_per_key())
    np.testing.assert_allclose(np.asarray(got.values()), want.values().detach().numpy(), **FWD_TOL)


# ------------------------------------------------------------------------ fused optimizers


class _TBE(NamedTuple):
    module: SplitTableBatchedEmbeddingBagsCodegen
    tables: list[Table]
    features: list[str]  # table-major: TBE's feature order
    cols: slice  # its columns in the pooled output


def _tbes(spec, weights, optimizer, precision=SparseType.FP32, **hp):
    """One TBE per pooling mode (a TBE pools all its tables alike), our initial weights."""
    runs: list[list[Table]] = []
    for t in spec:
        if runs and runs[-1][0].pooling is t.pooling:
            runs[-1].append(t)
        else:
            runs.append([t])
    assert len(runs) == len({t.pooling for t in spec}), "keep tables of one pooling together"
    out, col = [], 0
    for tables in runs:
        module = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[
                (t.rows, t.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables
            ],
            feature_table_map=[i for i, t in enumerate(tables) for _ in t.features],
            optimizer=optimizer,
            pooling_mode=PoolingMode.SUM if tables[0].pooling is SUM else PoolingMode.MEAN,
            weights_precision=precision,
            device=torch.device("cpu"),
            **hp,
        )
        for t, dst in zip(tables, module.split_embedding_weights(), strict=True):
            dst.copy_(torch.from_numpy(weights[t.name]).to(dst.dtype))
        width = sum(t.dim * len(t.features) for t in tables)
        out.append(_TBE(module, tables, _features(tables), slice(col, col + width)))
        col += width
    return out


def _tbe_step(tbe: _TBE, bags, grad):
    """TBE forward (indices, B*T+1 offsets, per-sample weights), then backward of `grad`
    (the fused update happens in the backward)."""
    values, weights, lengths = _flat(bags, tbe.features)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = tbe.module(
        torch.from_numpy(values),
        torch.from_numpy(offsets),
        per_sample_weights=None if weights is None else torch.from_numpy(weights),
    )
    out.backward(torch.from_numpy(np.ascontiguousarray(grad[:, tbe.cols])))


OPT_CASES = {
    # name: (our rule, FBGEMM optimizer, FBGEMM hyperparameters, weighted)
    # Unweighted cases use SEVERAL (SUM and MEAN tables); weighted ones are all SUM
    # (TorchRec refuses weighted MEAN). eps = 0.1 tells sqrt(m) + eps from sqrt(m + eps).
    "sgd": (optim.sgd(lr=0.3), OptimType.EXACT_SGD, dict(learning_rate=0.3), False),
    "adagrad": (
        optim.adagrad(lr=0.1, eps=0.1),
        OptimType.EXACT_ADAGRAD,
        dict(learning_rate=0.1, eps=0.1),
        False,
    ),
    "rowwise_adagrad": (
        optim.rowwise_adagrad(lr=0.2, eps=0.1),
        OptimType.EXACT_ROWWISE_ADAGRAD,
        dict(learning_rate=0.2, eps=0.1),
        False,
    ),
    "rowwise_adagrad_weighted": (
        optim.rowwise_adagrad(lr=0.1, eps=1e-8),
        OptimType.EXACT_ROWWISE_ADAGRAD,
        dict(learning_rate=0.1, eps=1e-8),
        True,
    ),
}


def _steps_on_both(spec, weighted, tbes, ebc, params, rule):
    """STEPS random batches through FBGEMM's TBEs and our fused update (KJT keys in reverse
    order): (params, state, update)."""
    state = rule.init(params)
    update = make_update(ebc, rule)
    for step in range(STEPS):
        bags = _bags(spec, seed=10 + step, weighted=weighted)
        grad = _pooled_grad(spec, seed=20 + step)
        for tbe in tbes:
            _tbe_step(tbe, bags, grad)
        params, state = update(
            params, state, _our_kjt(bags, _features(spec)[::-1], capacity=CAPACITY), grad
        )
    return params, state, update


@pytest.mark.parametrize("case", list(OPT_CASES))
def test_fused_update_matches_fbgemm_tbe(case):
    rule, fb_opt, fb_hp, weighted = OPT_CASES[case]
    spec = _pooled(SEVERAL, SUM) if weighted else SEVERAL
    weights = _weights(spec, seed=5)
    tbes = _tbes(spec, weights, fb_opt, **fb_hp)
    ebc, params = _ours(spec, weights, weighted=weighted)
    params, state, update = _steps_on_both(spec, weighted, tbes, ebc, params, rule)
    assert update.compile_count() == 1
    for tbe in tbes:
        for i, t in enumerate(tbe.tables):
            moved = tbe.module.split_embedding_weights()[i].numpy()
            assert not np.array_equal(moved, weights[t.name]), f"{t.name}: no row moved"
    _assert_same_tables(ebc, params, state, tbes, fb_opt)


def _assert_same_tables(ebc, params, state, tbes, fb_opt):
    """Every table's weights and `momentum1` (FBGEMM's `split_optimizer_states()[t][0]`)."""
    ours_w = ebc.table_weights(params)
    for tbe in tbes:
        fb_w = tbe.module.split_embedding_weights()
        fb_states = (
            tbe.module.split_optimizer_states() if fb_opt is not OptimType.EXACT_SGD else None
        )
        for i, t in enumerate(tbe.tables):
            np.testing.assert_allclose(
                np.asarray(ours_w[t.name]),
                fb_w[i].numpy(),
                **OPT_TOL,
                err_msg=f"weights of {t.name}",
            )
            if fb_states is None:
                continue
            group, off = ebc.layout.table_group[t.name]
            ours_m = np.asarray(state.tables[group]["momentum1"][off : off + t.rows])
            fb_m = fb_states[i][0].numpy()  # rowwise: [rows]; elementwise: [rows, dim]
            assert ours_m.shape == fb_m.shape
            np.testing.assert_allclose(ours_m, fb_m, **OPT_TOL, err_msg=f"momentum1 of {t.name}")


@pytest.mark.parametrize("case", ["rowwise_adagrad", "rowwise_adagrad_weighted"])
def test_fp16_tables_round_to_nearest_match_fbgemm_fp16_tbe(case):
    """fp16 weights, FBGEMM's `stochastic_rounding=False`: both step in fp32 and round each
    touched row to the nearest fp16 once per step; after 3 steps the tables are bitwise
    equal. (Only rowwise Adagrad, TorchRec's default: FBGEMM's CPU SGD and Adagrad on fp16
    tables land up to 7 ulps away from the fp32-math-then-round result, which is what its
    GPU kernels and ours compute; tests/test_optim.py checks ours against the loops.)"""
    rule, fb_opt, fb_hp, weighted = OPT_CASES[case]
    rule = dataclasses.replace(rule, stochastic_rounding=False)
    spec = _pooled(SEVERAL, SUM) if weighted else SEVERAL
    weights = {
        n: w.astype(np.float16).astype(np.float32) for n, w in _weights(spec, seed=5).items()
    }
    tbes = _tbes(spec, weights, fb_opt, SparseType.FP16, stochastic_rounding=False, **fb_hp)
    ebc, params = _ours(spec, weights, weighted=weighted, data_type="FP16")
    params, _, _ = _steps_on_both(spec, weighted, tbes, ebc, params, rule)
    ours = ebc.table_weights(params)
    for tbe in tbes:
        for i, t in enumerate(tbe.tables):
            fb = tbe.module.split_embedding_weights()[i].numpy()
            assert fb.dtype == np.float16 and np.asarray(ours[t.name]).dtype == np.float16
            assert not np.array_equal(fb.astype(np.float32), weights[t.name]), (
                f"{t.name}: no row moved"
            )
            np.testing.assert_array_equal(
                np.asarray(ours[t.name]), fb, err_msg=f"weights of {t.name}"
            )


# A batch with no ids at all (capacity 0): FBGEMM takes the step and nothing moves.
def test_all_bags_empty_update_matches_fbgemm_tbe():
    spec = SEVERAL
    weights = _weights(spec, seed=7)
    rule = optim.rowwise_adagrad(lr=0.1, eps=1e-8)
    tbes = _tbes(spec, weights, OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-8)
    ebc, params = _ours(spec, weights)
    state = rule.init(params)
    bags = _bags(spec, seed=8, empty=True)
    grad = _pooled_grad(spec, seed=9)
    for tbe in tbes:
        _tbe_step(tbe, bags, grad)
    params, state = make_update(ebc, rule)(params, state, _our_kjt(bags, _features(spec)), grad)
    _assert_same_tables(ebc, params, state, tbes, OptimType.EXACT_ROWWISE_ADAGRAD)


def test_fbgemm_has_no_cpu_adam():
    """Why ADAM is checked against FBGEMM's CUDA rule rather than run: CPU TBE refuses it."""
    with pytest.raises(AssertionError, match="not supported in CPU mode"):
        _tbes(SHARED, _weights(SHARED, 0), OptimType.ADAM, learning_rate=0.1)


def _fbgemm_adam_oracle(spec, weights, batches, *, lr, b1, b2, eps, wd):
    """Plain loops over FBGEMM's CUDA ADAM rule in float64: per step, the distinct rows a
    batch touched (gradient summed over their ids), t = the global step."""
    w = {n: x.astype(np.float64) for n, x in weights.items()}
    m = {n: np.zeros_like(x) for n, x in w.items()}
    v = {n: np.zeros_like(x) for n, x in w.items()}
    slots = []  # (feature, table, first output column, dim)
    col = 0
    for t in spec:
        for f in t.features:
            slots.append((f, t.name, col, t.dim))
            col += t.dim
    for step, (bags, grad) in enumerate(batches, start=1):
        g: dict[tuple[str, int], np.ndarray] = {}
        for f, name, c, d in slots:
            for b, (ids, _) in enumerate(bags[f]):
                for i in ids:
                    key = (name, int(i))
                    g[key] = g.get(key, 0.0) + grad[b, c : c + d].astype(np.float64)
        for (name, r), gr in g.items():
            m[name][r] = b1 * m[name][r] + (1 - b1) * gr
            v[name][r] = b2 * v[name][r] + (1 - b2) * gr * gr
            m_hat = m[name][r] / (1 - b1**step)
            v_hat = v[name][r] / (1 - b2**step)
            w[name][r] = w[name][r] - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * w[name][r])
    return w, m, v


def test_fused_adam_matches_fbgemm_rule():
    spec = _pooled(SEVERAL, SUM)
    hp = dict(lr=0.05, b1=0.8, b2=0.95, eps=1e-3, wd=0.01)
    weights = _weights(spec, seed=6)
    batches = [(_bags(spec, seed=30 + s), _pooled_grad(spec, seed=40 + s)) for s in range(STEPS)]
    want_w, want_m, want_v = _fbgemm_adam_oracle(spec, weights, batches, **hp)

    rule = optim.adam(
        lr=hp["lr"], beta1=hp["b1"], beta2=hp["b2"], eps=hp["eps"], weight_decay=hp["wd"]
    )
    ebc, params = _ours(spec, weights)
    state = rule.init(params)
    update = make_update(ebc, rule)
    for bags, grad in batches:
        params, state = update(
            params, state, _our_kjt(bags, _features(spec), capacity=CAPACITY), grad
        )
    got_w = ebc.table_weights(params)
    for t in spec:
        group, off = ebc.layout.table_group[t.name]
        np.testing.assert_allclose(
            np.asarray(got_w[t.name]), want_w[t.name], **OPT_TOL, err_msg=t.name
        )
        for key, want in (("momentum1", want_m), ("momentum2", want_v)):
            got = np.asarray(state.tables[group][key][off : off + t.rows])
            np.testing.assert_allclose(got, want[t.name], **OPT_TOL, err_msg=f"{key} of {t.name}")
