"""The served lookup by a direct call of the C++ kernel (`hybrid.serving._direct`).

Four packed tables (int4, int2, fp16, int8; dims 8, 16, 4 and 12, the last two taking the
kernel's any-dim loop), five output blocks (a table read by two features, a feature read by
two tables, one MEAN table), under each bounds_check, with and without per-id weights, at
batch 1, a batch padded to its rung, and a request of more than 16,384 ids (its later blocks
pooled on the helper thread): every block equals, bit for bit, the kernel's custom call
(`quantized_pooled_lookup(kernel="ffi")` under jit, what the artifact's "cpu_kernel" program
runs) on that feature's slice of the offsets, and the plain loops of
`tests/reference.quantized_pooled_loop` to float rounding. A plan that does not fit (a column
past the output, a feature past the offsets) is refused by the entry before it writes.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
import torch

from hybrid.serving import _direct, _kernel
from hybrid.serving._request import RequestSpec, read_sparse, with_bounds
from sparse_jax import _kernels, quantize_rows, quantized_pooled_lookup
from tests.reference import quantized_pooled_loop

pytestmark = pytest.mark.skipif(
    not _kernels.available(), reason="the C++ kernels are not built here"
)

FEATURES = ("a", "b", "c")
# name, weight type, rows, dim, pooling, features
TABLES = (
    ("t0", "int4", 50, 8, "SUM", ("a", "b")),
    ("t1", "int2", 30, 16, "MEAN", ("c",)),
    ("t2", "fp16", 40, 4, "SUM", ("b",)),
    ("t3", "int8", 20, 12, "SUM", ("a",)),
)
BLOCKS = (("a", "t0"), ("a", "t3"), ("b", "t0"), ("b", "t2"), ("c", "t1"))  # program order


@functools.cache
def _packed() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        name: np.asarray(quantize_rows(rng.uniform(-1, 1, (rows, dim)).astype(np.float32), wtype))
        for name, wtype, rows, dim, _, _ in TABLES
    }


def _manifest(bounds_check: str, weighted: bool) -> dict:
    by_name = {t[0]: t for t in TABLES}
    embeddings, offset = [], 0
    for feature, table in BLOCKS:
        dim = by_name[table][3]
        embeddings.append(
            {
                "name": f"{feature}@{table}",
                "feature": feature,
                "table": table,
                "dim": dim,
                "offset": offset,
            }
        )
        offset += dim
    return {
        "features": list(FEATURES),
        "tables": [
            {"name": n, "weight_type": w, "packed": True, "pooling": p, "features": list(fs)}
            for n, w, _, _, p, fs in TABLES
        ],
        "embeddings": embeddings,
        "bounds_check": bounds_check,
        "is_weighted": weighted,
    }


def _spec(bounds_check: str, weighted: bool, max_batch: int = 32) -> RequestSpec:
    by_name = {t[0]: t for t in TABLES}
    return with_bounds(
        RequestSpec(
            features=FEATURES,
            tables_of={f: tuple((t, by_name[t][2]) for g, t in BLOCKS if g == f) for f in FEATURES},
            is_weighted=weighted,
            bounds_check=bounds_check,
            max_batch_size=max_batch,
            id_capacities=(64, 512, 32768),
            batch_rungs=(1, 8, max_batch),
        )
    )


def _request(rng, spec: RequestSpec, batch: int, longest: int):
    """{feature: (values, lengths[, weights])}: bags of 0 to `longest` ids, the first empty;
    under clamp / skip also ids -1, rows and beyond."""
    out = {}
    for f in FEATURES:
        rows = min(n for _, n in spec.tables_of[f])
        lengths = rng.integers(0, longest + 1, batch).astype(np.int64)
        lengths[0] = 0 if batch > 1 else longest
        ids = rng.integers(0, rows, int(lengths.sum())).astype(np.int64)
        if spec.bounds_check != "error":
            ids[rng.random(ids.size) < 0.2] = rng.choice([-1, -7, rows, rows + 5])
        entry = (ids, lengths)
        if spec.is_weighted:
            entry += (rng.uniform(-2, 2, ids.size).astype(np.float32),)
        out[f] = entry
    return out


def _lookup(spec: RequestSpec, manifest: dict) -> _direct.DirectLookup:
    tables = [_packed()[t[0]] for t in TABLES]
    found = _direct.direct_lookup(manifest, tables, spec, _kernel.library(), [], None)
    assert isinstance(found, _direct.DirectLookup), found
    return found


@functools.partial(jax.jit, static_argnames=("wtype", "dim", "pooling", "bounds_check"))
def _custom_call(packed, ids, offsets, weights, *, wtype, dim, pooling, bounds_check):
    return quantized_pooled_lookup(
        packed, wtype, dim, ids, offsets, pooling, weights, bounds_check=bounds_check, kernel="ffi"
    )


def _oracle_ids(ids: np.ndarray, rows: int, bounds_check: str) -> np.ndarray:
    """The ids the loops read: clamped, or -1 (adds nothing) where the kernel skips them."""
    if bounds_check == "clamp":
        return np.clip(ids, 0, rows - 1)
    return np.where((ids >= 0) & (ids < rows), ids, -1)


@pytest.mark.parametrize("bounds_check", ["error", "clamp", "skip"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(
    "batch, longest", [(1, 5), (5, 4), (32, 3), (32, 300)], ids=["one", "padded", "rung", "helper"]
)
def test_every_block_is_the_custom_calls_and_the_loops(bounds_check, weighted, batch, longest):
    rng = np.random.default_rng([batch, longest, weighted, len(bounds_check)])
    spec = _spec(bounds_check, weighted)
    manifest = _manifest(bounds_check, weighted)
    lookup = _lookup(spec, manifest)
    arrays = read_sparse(_request(rng, spec, batch, longest), spec)
    rung = (arrays.offsets.shape[0] - 1) // len(FEATURES)
    if longest == 300:  # more ids than QUANT_SERVE_SPLIT_IDS: the helper thread pools some blocks
        starts = {f: arrays.offsets[FEATURES.index(f) * rung] for f in FEATURES}
        ends = {f: arrays.offsets[FEATURES.index(f) * rung + batch] for f in FEATURES}
        assert sum(ends[f] - starts[f] for f, _ in BLOCKS) > 16384
    got = lookup(arrays)
    assert got.dtype == torch.float32 and tuple(got.shape) == (batch, lookup.width) == (batch, 48)
    by_name = {t[0]: t for t in TABLES}
    for e in manifest["embeddings"]:
        _, wtype, rows, dim, pooling, _ = by_name[e["table"]]
        f = FEATURES.index(e["feature"])
        offsets = arrays.offsets[f * rung : (f + 1) * rung + 1]
        block = got[:, e["offset"] : e["offset"] + dim].numpy()
        want = np.asarray(
            _custom_call(
                _packed()[e["table"]],
                arrays.values,
                offsets,
                arrays.weights,
                wtype=wtype,
                dim=dim,
                pooling=pooling,
                bounds_check="clamp" if bounds_check == "clamp" else "skip",
            )
        )[:batch]
        assert np.array_equal(block, want), e["name"]
        loops = quantized_pooled_loop(
            _packed()[e["table"]],
            wtype,
            dim,
            _oracle_ids(arrays.values, rows, bounds_check),
            offsets[: batch + 1],
            pooling,
            arrays.weights,
        )
        np.testing.assert_allclose(block, loops, rtol=1e-5, atol=1e-5, err_msg=e["name"])


def test_the_entry_refuses_a_plan_that_does_not_fit_before_it_writes():
    spec = _spec("error", False)
    lookup = _lookup(spec, _manifest("error", False))
    arrays = read_sparse(_request(np.random.default_rng(1), spec, 5, 3), spec)
    good = lookup._plan.copy()
    for field, value in ((5, 45), (6, 3), (3, 5), (0, 0)):  # column, feature, kind, address
        plan = good.copy()
        plan[2, field] = value
        lookup._plan, lookup._plan_at = plan, plan.ctypes.data
        with pytest.raises(RuntimeError, match="refused block 2 of a request of 5 samples"):
            lookup(arrays)
    lookup._plan, lookup._plan_at = good, good.ctypes.data
    assert tuple(lookup(arrays).shape) == (5, 48)


def test_a_float_table_or_a_gap_in_the_output_is_not_run_directly():
    spec = _spec("error", False)
    tables = [_packed()[t[0]] for t in TABLES]
    manifest = _manifest("error", False)
    manifest["tables"][2] = {**manifest["tables"][2], "weight_type": "fp32", "packed": False}
    found = _direct.direct_lookup(manifest, tables, spec, _kernel.library(), [], None)
    assert found == "table 't2' is not packed (int8 / int4 / int2 / fp16 rows)"
    manifest = _manifest("error", False)
    manifest["embeddings"][1] = {**manifest["embeddings"][1], "offset": 9}
    found = _direct.direct_lookup(manifest, tables, spec, _kernel.library(), [], None)
    assert found == "block 'a@t3' is not where the direct lookup would write it"
    assert (
        _direct.direct_lookup(manifest, tables, spec, "no library here", [], None)
        == "no library here"
    )
