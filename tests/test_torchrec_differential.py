"""Differential test: TorchRec's sparse types and ours, method by method, on random inputs.

Each test draws `CASES` random jagged inputs (no keys, empty bags, a zero-length batch,
weights or none, variable lengths, int32/int64/float32 values and `[N, D]` rows, a variable
batch per key with inverse indices) and calls one public method on TorchRec's object and on
ours built from the same arrays; results must be equal, dtypes included (run with jax x64
on, so int64 stays int64 as in torch; `test_dtypes_without_x64` checks the narrowed dtypes).
Where the two differ by design the case is filtered with the reason (see
docs/torchrec_compat.md), never skipped silently: each test asserts how many cases ran.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

torchrec = pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import jax  # noqa: E402
import torch  # noqa: E402
from torchrec.modules import embedding_configs as tr_configs  # noqa: E402
from torchrec.modules import embedding_modules as tr_modules  # noqa: E402
from torchrec.sparse import jagged_tensor as tr  # noqa: E402

import sparse_jax as sj  # noqa: E402

pytestmark = pytest.mark.parity

# 500 in `make test`; `make mutation` runs every mutant against fewer (HYBRIDREC_DIFF_CASES)
CASES = int(os.environ.get("HYBRIDREC_DIFF_CASES", "500"))
# The few tests whose time is XLA compiles of eager ops at shapes no case had before (~2-8
# per case, most of a case's time) run a quarter of the cases (never fewer than 100, nor
# more than CASES): each asserts that its edge cases (no bags, no ids, a zero batch or
# width, each dtype, weights or none, ...) were among them, so the cut drops repeats only.
FEWER_CASES = max(CASES // 4, min(CASES, 100))
# The three of those whose edge sets the first few cases already meet (padded dense: case 52,
# KeyedTensor methods: 17, KJT getitem/to_dict: 11) and whose later cases are mostly compiles
# at new shapes of the same eager ops: an eighth (60 at least, as `make mutation` runs them).
EDGE_CASES = max(CASES // 8, min(CASES, 60))
VALUE_KINDS = ("int64", "int32", "float32", "rows")


# -- random inputs -------------------------------------------------------------------------------
def _values(rng, n: int, kind: str) -> np.ndarray:
    if kind == "int64":
        return rng.integers(-(2**40), 2**40, n, dtype=np.int64)
    if kind == "int32":
        return rng.integers(-1000, 1000, n, dtype=np.int32)
    if kind == "float32":
        return rng.standard_normal(n).astype(np.float32)
    return rng.standard_normal((n, 3)).astype(np.float32)  # [N, D] rows


def random_kjt_case(i: int, *, variable: bool | None = None, kind: str | None = None) -> dict:
    """Case i (deterministic): keys, values, lengths, weights, strides (one per key)."""
    rng = np.random.default_rng(1000 + i)
    num_keys = int(rng.integers(0, 5))
    batch = int(rng.integers(0, 5))
    variable = bool(rng.random() < 0.25) if variable is None else variable
    strides = [int(rng.integers(0, batch + 1)) if variable else batch for _ in range(num_keys)]
    if variable and batch:
        strides = [max(s, 1) for s in strides]  # inverse indices need a bag to point at
    lengths = rng.integers(0, 4, sum(strides)).astype(rng.choice([np.int32, np.int64]))
    lengths[rng.random(lengths.size) < 0.2] = 0  # more empty bags
    n = int(lengths.sum())
    kind = kind or str(rng.choice(VALUE_KINDS))
    weights = rng.random(n).astype(np.float32) if rng.random() < 0.5 else None
    inverse = None
    if variable and num_keys:
        inverse = np.stack([rng.integers(0, max(s, 1), batch) for s in strides]).astype(np.int64)
    return dict(
        keys=[f"f{k}" for k in range(num_keys)],
        values=_values(rng, n, kind),
        lengths=lengths,
        weights=weights,
        strides=strides,
        variable=variable,
        inverse=inverse,
        batch=batch,
        kind=kind,
    )


def tr_kjt(c: dict) -> tr.KeyedJaggedTensor:
    kw = {}
    if c["variable"]:
        kw["stride_per_key_per_rank"] = [[s] for s in c["strides"]]
        if c["inverse"] is not None:
            kw["inverse_indices"] = (c["keys"], torch.from_numpy(c["inverse"]))
    else:
        kw["stride"] = c["batch"] if c["keys"] else 0
    return tr.KeyedJaggedTensor(
        keys=c["keys"],
        values=torch.from_numpy(c["values"]),
        lengths=torch.from_numpy(c["lengths"]),
        weights=None if c["weights"] is None else torch.from_numpy(c["weights"]),
        **kw,
    )


def sj_kjt(c: dict) -> sj.KeyedJaggedTensor:
    kw = {}
    if c["variable"]:
        kw["stride_per_key_per_rank"] = [[s] for s in c["strides"]]
        if c["inverse"] is not None:
            kw["inverse_indices"] = (c["keys"], c["inverse"])
    else:
        kw["stride"] = c["batch"] if c["keys"] else 0
    return sj.KeyedJaggedTensor(
        keys=c["keys"], values=c["values"], lengths=c["lengths"], weights=c["weights"], **kw
    )


def random_jt_case(i: int) -> dict:
    rng = np.random.default_rng(5000 + i)
    bags = int(rng.integers(0, 6))
    lengths = rng.integers(0, 4, bags).astype(rng.choice([np.int32, np.int64]))
    n = int(lengths.sum())
    kind = str(rng.choice(VALUE_KINDS))
    weights = rng.random(n).astype(np.float32) if rng.random() < 0.5 else None
    return dict(values=_values(rng, n, kind), lengths=lengths, weights=weights, kind=kind, rng=rng)


# -- comparisons ------------------------------------------------------------------------------------
def same(ours, theirs, what: str) -> None:
    """Equal values, shapes and dtypes (torch tensors vs JAX/numpy arrays), recursively."""
    if isinstance(theirs, torch.Tensor):
        t = theirs.numpy()
        if what.endswith(".offsets") and t.size == 0 and np.asarray(ours).tolist() == [0]:
            return  # no bags: TorchRec's empty()/split() give offsets [], ours [0] (offsets always start at 0)
        if what.endswith(".values") and t.size == 0 and np.asarray(ours).size == 0 and t.ndim == 1:
            assert np.asarray(ours).dtype == t.dtype, what
            return  # no ids: TorchRec's split() of [N, D] values gives an empty [0], ours keeps [0, D]
        o = np.asarray(ours)
        assert o.dtype == t.dtype, f"{what}: dtype {o.dtype} vs TorchRec {t.dtype}"
        assert o.shape == t.shape, f"{what}: shape {o.shape} vs TorchRec {t.shape}"
        assert np.array_equal(o, t, equal_nan=True), f"{what}: {o} vs TorchRec {t}"
    elif isinstance(theirs, tr.JaggedTensor):
        assert isinstance(ours, sj.JaggedTensor), f"{what}: {type(ours)}"
        same(ours.values(), theirs.values(), what + ".values")
        same(ours.lengths(), theirs.lengths(), what + ".lengths")
        same(ours.offsets(), theirs.offsets(), what + ".offsets")
        same(ours.weights_or_none(), theirs.weights_or_none(), what + ".weights")
    elif isinstance(theirs, tr.KeyedJaggedTensor):
        assert isinstance(ours, sj.KeyedJaggedTensor), f"{what}: {type(ours)}"
        assert ours.keys() == theirs.keys(), f"{what}.keys"
        assert ours.stride() == theirs.stride(), (
            f"{what}.stride {ours.stride()} vs {theirs.stride()}"
        )
        assert ours.variable_stride_per_key() == theirs.variable_stride_per_key(), what
        assert ours.stride_per_key() == theirs.stride_per_key(), f"{what}.stride_per_key"
        same(ours.values(), theirs.values(), what + ".values")
        same(ours.lengths(), theirs.lengths(), what + ".lengths")
        same(ours.offsets(), theirs.offsets(), what + ".offsets")
        same(ours.weights_or_none(), theirs.weights_or_none(), what + ".weights")
    elif isinstance(theirs, tr.KeyedTensor):
        assert ours.keys() == theirs.keys() and ours.key_dim() == theirs.key_dim(), what
        assert ours.length_per_key() == theirs.length_per_key(), what
        same(ours.values(), theirs.values(), what + ".values")
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{what}: keys {list(ours)} vs {list(theirs)}"
        for k in theirs:
            same(ours[k], theirs[k], f"{what}[{k!r}]")
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs), f"{what}: {len(ours)} items vs {len(theirs)}"
        for j, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            same(a, b, f"{what}[{j}]")
    else:
        assert ours == theirs, f"{what}: {ours!r} vs TorchRec {theirs!r}"


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _usable_kjt_cases(where, count, **kw) -> list[dict]:
    """The cases `_each_kjt(..., where=where, at_least=count)` runs."""
    cases = (random_kjt_case(i, **kw) for i in itertools.count())
    return list(itertools.islice((c for c in cases if where(c)), count))


def _each_kjt(method_check, *, where=lambda c: True, at_least=CASES, **kw):
    ran = 0
    for i in itertools.count():
        if ran >= at_least:
            break
        assert i < 4 * at_least, f"only {ran} usable cases in {i} draws"
        c = random_kjt_case(i, **kw)
        if not where(c):
            continue
        method_check(c, tr_kjt(c), sj_kjt(c), f"case {i}")
        ran += 1
    assert ran == at_least


# -- KeyedJaggedTensor -------------------------------------------------------------------------------
KJT_ACCESSORS = [
    "keys",
    "values",
    "weights_or_none",
    "lengths",
    "offsets",
    "stride",
    "stride_per_key",
    "stride_per_key_per_rank",
    "variable_stride_per_key",
    "length_per_key",
    "offset_per_key",
    "lengths_offset_per_key",
    "index_per_key",
    "inverse_indices_or_none",
    "size_in_bytes",
    "lengths_or_none",
    "offsets_or_none",
    "length_per_key_or_none",
    "offset_per_key_or_none",
]


def _materialized(theirs):
    """TorchRec computes offsets (and per-key sizes) lazily; ours holds them. Compare with
    TorchRec's after it computed them (its `*_or_none` are None before)."""
    theirs.offsets(), theirs.lengths(), theirs.length_per_key(), theirs.offset_per_key()
    return theirs


@pytest.mark.parametrize("method", KJT_ACCESSORS)
def test_kjt_accessors(method):
    def check(c, theirs, ours, what):
        t = getattr(_materialized(theirs), method)()
        if method == "stride_per_key_per_rank":
            t = [list(r) for r in (t.tolist() if isinstance(t, torch.Tensor) else t)]
        same(getattr(ours, method)(), t, f"{what} {method}")

    _each_kjt(check)


def _kjt_edges(c) -> set:
    """The edge cases a KJT case `c` is (for the tests that run FEWER_CASES)."""
    return {
        c["kind"],
        str(c["lengths"].dtype),
        "weighted" if c["weights"] is not None else "unweighted",
        "variable" if c["variable"] else "uniform",
        *(["inverse"] if c["inverse"] is not None else []),
        *(["no keys"] if not c["keys"] else []),
        *(["zero batch"] if c["keys"] and not c["batch"] else []),
        *(["no ids"] if c["keys"] and c["batch"] and not c["values"].shape[0] else []),
        *(["empty bag"] if (c["lengths"] == 0).any() else []),
    }


KJT_EDGES = {*VALUE_KINDS, "int32", "int64", "weighted", "unweighted", "variable", "uniform"}
KJT_EDGES |= {"inverse", "no keys", "zero batch", "no ids", "empty bag"}


def test_kjt_getitem_and_to_dict():
    seen = set()

    def check(c, theirs, ours, what):
        seen.update(_kjt_edges(c))
        if (
            c["batch"] == 0
        ):  # TorchRec's to_dict raises IndexError on a zero-sample batch; ours: empty bags
            assert all(int(ours[k].lengths().shape[0]) == 0 for k in c["keys"])
            return
        same(ours.to_dict(), theirs.to_dict(), f"{what} to_dict")
        for k in c["keys"]:
            same(ours[k], theirs[k], f"{what} [{k!r}]")

    _each_kjt(check, at_least=EDGE_CASES)
    assert seen == KJT_EDGES, KJT_EDGES - seen


def test_kjt_permute():
    rng = np.random.default_rng(7)

    def check(c, theirs, ours, what):
        k = len(c["keys"])
        order = rng.permutation(k)[: rng.integers(0, k + 1)].tolist()  # reordered, some dropped
        same(ours.permute(order), theirs.permute(order), f"{what} permute {order}")
        if k:  # a repeated index would make duplicate keys: TorchRec builds that KJT, ours refuses
            with pytest.raises(ValueError, match="appears twice"):
                ours.permute([0, 0])

    # TorchRec's permute of a variable-batch KJT needs its multi-rank (distributed) layout;
    # it flattens [N, D] values (fbgemm's permute_2D_sparse_data is 1-D), ours keeps rows
    _each_kjt(check, where=lambda c: c["keys"] and not c["variable"] and c["kind"] != "rows")


def test_kjt_split():
    rng = np.random.default_rng(8)

    def check(c, theirs, ours, what):
        k = len(c["keys"])
        cuts = sorted(rng.integers(0, k + 1, rng.integers(0, 3)).tolist())
        segments = [b - a for a, b in zip([0, *cuts], [*cuts, k], strict=True)]
        mine, its = ours.split(segments), theirs.split(segments)
        for j, (o, t) in enumerate(zip(mine, its, strict=True)):
            if not segments[j]:  # no keys: TorchRec's lengths turn int32, ours keep the KJT's dtype
                assert o.keys() == t.keys() == [] and o.lengths().dtype == ours.lengths().dtype
                continue
            same(o, t, f"{what} split {segments}[{j}]")

    _each_kjt(check, where=lambda c: not c["variable"])


def test_kjt_concat():
    def check(c, theirs, ours, what):
        d = random_kjt_case(10_000 + int(what.split()[1]), variable=False, kind=c["kind"])
        d["batch"] = c["batch"]
        d["keys"] = [f"g{k}" for k in range(len(d["keys"]))]
        rng = np.random.default_rng(len(what))
        d["lengths"] = rng.integers(0, 3, len(d["keys"]) * c["batch"]).astype(c["lengths"].dtype)
        d["values"] = _values(rng, int(d["lengths"].sum()), c["kind"])
        d["weights"] = (
            None if c["weights"] is None else rng.random(d["values"].shape[0]).astype(np.float32)
        )
        d["strides"] = [c["batch"]] * len(d["keys"])
        if not d[
            "keys"
        ]:  # TorchRec asserts the keyless KJT's stride 0 equals the other's; ours: it adds nothing
            assert sj.kjt_is_equal(sj.KeyedJaggedTensor.concat([ours, sj_kjt(d)]), ours)
            return
        same(
            sj.KeyedJaggedTensor.concat([ours, sj_kjt(d)]),
            tr.KeyedJaggedTensor.concat([theirs, tr_kjt(d)]),
            f"{what} concat",
        )

    _each_kjt(check, where=lambda c: not c["variable"] and c["keys"])


@pytest.mark.parametrize("method", ["from_lengths_sync", "from_offsets_sync"])
def test_kjt_sync_constructors(method):
    def check(c, theirs, ours, what):
        w = c["weights"]
        if method == "from_lengths_sync":
            t = tr.KeyedJaggedTensor.from_lengths_sync(
                c["keys"],
                torch.from_numpy(c["values"]),
                torch.from_numpy(c["lengths"]),
                None if w is None else torch.from_numpy(w),
                stride=c["batch"],
            )
            o = sj.KeyedJaggedTensor.from_lengths_sync(
                c["keys"], c["values"], c["lengths"], w, stride=c["batch"]
            )
        else:
            offsets = np.concatenate([[0], np.cumsum(c["lengths"])]).astype(c["lengths"].dtype)
            t = tr.KeyedJaggedTensor.from_offsets_sync(
                c["keys"],
                torch.from_numpy(c["values"]),
                torch.from_numpy(offsets),
                None if w is None else torch.from_numpy(w),
                stride=c["batch"],
            )
            o = sj.KeyedJaggedTensor.from_offsets_sync(
                c["keys"], c["values"], offsets, w, stride=c["batch"]
            )
        same(o, t, f"{what} {method}")

    # TorchRec's from_offsets_sync fails on a zero-sample batch (reshape of 0 elements)
    _each_kjt(check, where=lambda c: not c["variable"] and c["keys"] and c["batch"])


def test_kjt_from_jt_dict():
    def check(c, theirs, ours, what):
        same(
            sj.KeyedJaggedTensor.from_jt_dict(ours.to_dict()),
            tr.KeyedJaggedTensor.from_jt_dict(theirs.to_dict()),
            f"{what} from_jt_dict",
        )

    # TorchRec's from_jt_dict makes no variable-batch KJT (it needs equal strides); its
    # to_dict fails on a zero-sample batch
    usable = lambda c: c["keys"] and not c["variable"] and c["batch"]  # noqa: E731
    _each_kjt(check, where=usable, at_least=FEWER_CASES)
    seen = set().union(*(_kjt_edges(c) for c in _usable_kjt_cases(usable, FEWER_CASES)))
    want = KJT_EDGES - {"variable", "inverse", "no keys", "zero batch"}
    assert seen == want, want - seen


def test_kjt_empty_and_empty_like():
    def check(c, theirs, ours, what):
        same(
            sj.KeyedJaggedTensor.empty_like(ours),
            tr.KeyedJaggedTensor.empty_like(theirs),
            f"{what} empty_like",
        )
        w = c["weights"] is not None
        same(
            sj.KeyedJaggedTensor.empty(
                is_weighted=w, values_dtype=c["values"].dtype, lengths_dtype=c["lengths"].dtype
            ),
            tr.KeyedJaggedTensor.empty(
                is_weighted=w,
                values_dtype=torch.from_numpy(c["values"]).dtype,
                lengths_dtype=torch.from_numpy(c["lengths"]).dtype,
            ),
            f"{what} empty",
        )

    # TorchRec's empty_like keeps a variable-batch KJT's strides with no lengths (not a valid KJT here)
    _each_kjt(check, where=lambda c: not c["variable"] and c["kind"] != "rows")


def test_kjt_flatten_lengths_and_sync():
    def check(c, theirs, ours, what):
        if c[
            "variable"
        ]:  # TorchRec's flatten_lengths drops the inverse indices (and so the stride); ours keeps
            assert sj.kjt_is_equal(ours.flatten_lengths(), ours)
        else:
            same(ours.flatten_lengths(), theirs.flatten_lengths(), f"{what} flatten_lengths")
        same(ours.sync(), theirs.sync(), f"{what} sync")
        same(ours.unsync(), theirs.unsync(), f"{what} unsync")

    _each_kjt(check)


def test_kjt_equality_helpers():
    def check(c, theirs, ours, what):
        other = sj_kjt(c)
        assert sj.kjt_is_equal(ours, other) == tr.kjt_is_equal(theirs, tr_kjt(c)) == True  # noqa: E712
        if c["values"].shape[0]:
            changed = dict(c, values=c["values"].copy())
            changed["values"][0] = changed["values"][0] + 1
            # ours is exact; TorchRec's uses allclose (ids 2**40 and 2**40 + 1 compare equal there)
            assert sj.kjt_is_equal(ours, sj_kjt(changed)) is False

    _each_kjt(check, where=lambda c: not c["variable"])


# -- JaggedTensor ------------------------------------------------------------------------------------
def _jt_edges(c) -> set:
    """The edge cases a JaggedTensor case `c` is (for the tests that run FEWER_CASES)."""
    return {
        c["kind"],
        str(c["lengths"].dtype),
        "weighted" if c["weights"] is not None else "unweighted",
        *(["no bags"] if not c["lengths"].size else []),
        *(["no ids"] if c["lengths"].size and not c["values"].shape[0] else []),
        *(["empty bag"] if (c["lengths"] == 0).any() else []),
    }


JT_EDGES = {*VALUE_KINDS, "int32", "int64", "weighted", "unweighted", "no bags", "no ids"}
JT_EDGES |= {"empty bag"}


def _each_jt(check, at_least=CASES):
    for i in range(at_least):
        c = random_jt_case(i)
        w = c["weights"]
        theirs = tr.JaggedTensor(
            values=torch.from_numpy(c["values"]),
            lengths=torch.from_numpy(c["lengths"]),
            weights=None if w is None else torch.from_numpy(w),
        )
        ours = sj.JaggedTensor(c["values"], w, lengths=c["lengths"])
        check(c, theirs, ours, f"case {i}")


@pytest.mark.parametrize(
    "method",
    [
        "values",
        "lengths",
        "offsets",
        "weights_or_none",
        "lengths_or_none",
        "offsets_or_none",
        "to_dense",
        "to_dense_weights",
        "size_in_bytes",
    ],
)
def test_jt_accessors(method):
    def check(c, theirs, ours, what):
        theirs.offsets()  # computed lazily by TorchRec (offsets_or_none is None before); held by ours
        same(getattr(ours, method)(), getattr(theirs, method)(), f"{what} {method}")

    _each_jt(check)


def test_jt_to_padded_dense():
    seen = set()

    def check(c, theirs, ours, what):
        rng = c["rng"]
        desired = None if rng.random() < 0.3 else int(rng.integers(0, 5))
        seen.update(_jt_edges(c))
        if (
            c["kind"] == "rows"
        ):  # TorchRec pads 1-D values only (fbgemm's 1-D jagged_to_padded_dense)
            return
        if (
            desired is None and c["lengths"].size == 0
        ):  # TorchRec: max() of no lengths raises; ours: [0, 0]
            assert ours.to_padded_dense().shape == (0, 0)
            seen.add("no bags, longest")
            return
        longest = int(c["lengths"].max()) if c["lengths"].size else 0
        if desired is None:
            seen.add("longest")
        else:
            seen.add(
                "zero width"
                if desired == 0
                else ("cut" if desired < longest else "padded" if desired > longest else "exact")
            )
        pad = c["values"].dtype.type(rng.integers(-3, 3))
        same(
            ours.to_padded_dense(desired, pad),
            theirs.to_padded_dense(desired, pad),
            f"{what} to_padded_dense",
        )
        same(
            ours.to_padded_dense_weights(desired, 0.5),
            theirs.to_padded_dense_weights(desired, 0.5),
            f"{what} to_padded_dense_weights",
        )

    _each_jt(check, EDGE_CASES)
    want = JT_EDGES | {"no bags, longest", "longest", "zero width", "cut", "padded", "exact"}
    assert seen == want, want - seen


def test_jt_from_dense_and_from_dense_lengths():
    def check(c, theirs, ours, what):
        dense = [np.array(x) for x in ours.to_dense()]
        if not dense:  # TorchRec's from_dense([]) fails in torch.cat; ours: no bags
            assert sj.JaggedTensor.from_dense([]).lengths().shape == (0,)
            return
        dw = ours.to_dense_weights()
        same(
            sj.JaggedTensor.from_dense(dense, None if dw is None else [np.asarray(x) for x in dw]),
            tr.JaggedTensor.from_dense(
                [torch.from_numpy(x) for x in dense],
                None if dw is None else [torch.from_numpy(np.array(x)) for x in dw],
            ),
            f"{what} from_dense",
        )
        if c["kind"] == "rows" or not len(dense):
            return
        width = int(max((len(x) for x in dense), default=0)) + 1
        padded = np.asarray(theirs.to_padded_dense(width).numpy())
        lengths = c["lengths"]
        pw = None if c["weights"] is None else theirs.to_padded_dense_weights(width).numpy()
        same(
            sj.JaggedTensor.from_dense_lengths(padded, lengths, pw),
            tr.JaggedTensor.from_dense_lengths(
                torch.from_numpy(padded),
                torch.from_numpy(lengths),
                None if pw is None else torch.from_numpy(pw),
            ),
            f"{what} from_dense_lengths",
        )

    _each_jt(check)


def test_jt_empty_and_equality():
    def check(c, theirs, ours, what):
        w = c["weights"] is not None
        same(
            sj.JaggedTensor.empty(
                w, values_dtype=c["values"].dtype, lengths_dtype=c["lengths"].dtype
            ),
            tr.JaggedTensor.empty(
                w,
                values_dtype=torch.from_numpy(c["values"]).dtype,
                lengths_dtype=torch.from_numpy(c["lengths"]).dtype,
            ),
            f"{what} empty",
        )
        assert sj.jt_is_equal(
            ours, sj.JaggedTensor(c["values"], c["weights"], lengths=c["lengths"])
        )
        assert tr.jt_is_equal(theirs, theirs)

    _each_jt(check)


# -- KeyedTensor ----------------------------------------------------------------------------------------
def test_keyed_tensor_methods():
    seen = set()
    for i in range(EDGE_CASES):
        rng = np.random.default_rng(9000 + i)
        k = int(rng.integers(1, 5))
        batch = int(rng.integers(0, 4))
        dims = rng.integers(0, 4, k).tolist()
        seen |= {f"{k} keys", f"batch {batch}", *(["a zero dim"] if 0 in dims else [])}
        seen |= {"all zero dims"} if not any(dims) else set()
        keys = [f"k{j}" for j in range(k)]
        blocks = [rng.standard_normal((batch, d)).astype(np.float32) for d in dims]
        cat_dim = 1
        t = tr.KeyedTensor.from_tensor_list(
            keys, [torch.from_numpy(b) for b in blocks], key_dim=1, cat_dim=cat_dim
        )
        o = sj.KeyedTensor.from_tensor_list(keys, blocks, key_dim=1, cat_dim=cat_dim)
        what = f"case {i}"
        same(o, t, what)
        assert o.offset_per_key() == t.offset_per_key()
        assert o.size_in_bytes() == t.size_in_bytes()
        same(o.to_dict(), t.to_dict(), what + " to_dict")
        for key in keys:
            same(o[key], t[key], f"{what} [{key!r}]")
        # a second KeyedTensor and random groups over both
        keys2 = [f"m{j}" for j in range(int(rng.integers(1, 3)))]
        blocks2 = [
            rng.standard_normal((batch, int(rng.integers(1, 3)))).astype(np.float32) for _ in keys2
        ]
        t2 = tr.KeyedTensor.from_tensor_list(keys2, [torch.from_numpy(b) for b in blocks2])
        o2 = sj.KeyedTensor.from_tensor_list(keys2, blocks2)
        everything = keys + keys2
        groups = [
            rng.choice(
                everything, int(rng.integers(1, len(everything) + 1)), replace=False
            ).tolist()
            for _ in range(int(rng.integers(1, 4)))
        ]
        same(
            sj.KeyedTensor.regroup([o, o2], groups),
            tr.KeyedTensor.regroup([t, t2], groups),
            f"{what} regroup",
        )
        seen |= {f"{len(groups)} groups", *(f"a group of {len(g)}" for g in groups)}
        seen |= {"a group over both"} if any(g[0][0] != g[-1][0] for g in groups) else set()
        names = [f"g{j}" for j in range(len(groups))]
        same(
            sj.KeyedTensor.regroup_as_dict([o, o2], groups, names),
            tr.KeyedTensor.regroup_as_dict([t, t2], groups, names),
            f"{what} regroup_as_dict",
        )
    want = {f"{k} keys" for k in (1, 2, 3, 4)} | {f"batch {b}" for b in (0, 1, 2, 3)}
    want |= {f"{n} groups" for n in (1, 2, 3)} | {f"a group of {n}" for n in range(1, 7)}
    want |= {"a zero dim", "all zero dims", "a group over both"}
    assert seen == want, want - seen


# -- the collections -------------------------------------------------------------------------------------
def _tables(rng, pooled: bool):
    """2-3 tables; feature "s" is shared by two of them, the rest are their own."""
    make = tr_configs.EmbeddingBagConfig if pooled else tr_configs.EmbeddingConfig
    ours = sj.EmbeddingBagConfig if pooled else sj.EmbeddingConfig
    specs = [("t0", 11, 4, ["a", "s"]), ("t1", 7, 4, ["s", "b"]), ("t2", 5, 4, ["c"])]
    extra = {}
    if pooled:
        extra = [
            dict(pooling=tr_configs.PoolingType.SUM),
            dict(pooling=tr_configs.PoolingType.MEAN),
            dict(pooling=tr_configs.PoolingType.SUM),
        ]
    else:
        extra = [{}, {}, {}]
    t = [
        make(name=n, num_embeddings=r, embedding_dim=d, feature_names=f, **e)
        for (n, r, d, f), e in zip(specs, extra, strict=True)
    ]
    o = [
        ours(
            name=n,
            num_embeddings=r,
            embedding_dim=d,
            feature_names=f,
            **({"pooling": e["pooling"].value} if e else {}),
        )
        for (n, r, d, f), e in zip(specs, extra, strict=True)
    ]
    return t, o, specs


def _module_case(i: int, rows: dict, weighted: bool):
    rng = np.random.default_rng(20_000 + i)
    keys = ["a", "s", "b", "c"]
    batch = int(rng.integers(1, 5))
    variable = bool(rng.random() < 0.3)
    strides = [int(rng.integers(1, batch + 1)) if variable else batch for _ in keys]
    lengths = rng.integers(0, 4, sum(strides)).astype(np.int64)
    table_of = {"a": "t0", "s": "t1", "b": "t1", "c": "t2"}  # "s" must fit both tables: the smaller
    values = []
    for k, s0, s1 in zip(keys, np.cumsum([0, *strides])[:-1], np.cumsum(strides), strict=True):
        values.append(rng.integers(0, rows[table_of[k]], int(lengths[s0:s1].sum())))
    values = np.concatenate(values).astype(np.int64)
    weights = rng.random(values.shape[0]).astype(np.float32) if weighted else None
    inverse = (
        np.stack([rng.integers(0, s, batch) for s in strides]).astype(np.int64)
        if variable
        else None
    )
    return dict(
        keys=keys,
        values=values,
        lengths=lengths,
        weights=weights,
        strides=strides,
        variable=variable,
        inverse=inverse,
        batch=batch,
        kind="int64",
    )


@pytest.mark.parametrize("weighted", [False, True])
def test_embedding_bag_collection_forward(weighted):
    rng = np.random.default_rng(3)
    t_tables, o_tables, specs = _tables(rng, pooled=True)
    if weighted:  # TorchRec's weighted EBC pools with SUM only
        t_tables = [
            tr_configs.EmbeddingBagConfig(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                feature_names=t.feature_names,
            )
            for t in t_tables
        ]
        o_tables = [
            sj.EmbeddingBagConfig(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                feature_names=list(t.feature_names),
            )
            for t in o_tables
        ]
    theirs = tr_modules.EmbeddingBagCollection(tables=t_tables, is_weighted=weighted)
    ours = sj.EmbeddingBagCollection(o_tables, is_weighted=weighted, ladder=(64, 128))
    params = ours.init(jax.random.key(0))
    with torch.no_grad():
        for name, w in ours.table_weights(params).items():
            theirs.embedding_bags[name].weight.copy_(torch.from_numpy(np.array(w)))
    assert ours.embedding_bag_configs() == o_tables
    rows = {n: r for n, r, _, _ in specs}
    for i in range(CASES):
        c = _module_case(i, rows, weighted)
        t = theirs(tr_kjt(c))
        o = ours.apply(params, sj_kjt(c))
        assert o.keys() == t.keys() == ["a", "s@t0", "s@t1", "b", "c"]
        np.testing.assert_allclose(
            np.asarray(o.values()),
            t.values().detach().numpy(),
            rtol=1e-6,
            atol=1e-6,
            err_msg=f"case {i}",
        )


def test_embedding_collection_forward_need_indices():
    rng = np.random.default_rng(4)
    t_tables, o_tables, specs = _tables(rng, pooled=False)
    theirs = tr_modules.EmbeddingCollection(tables=t_tables, need_indices=True)
    ours = sj.EmbeddingCollection(o_tables, need_indices=True, ladder=(64, 128))
    params = ours.init(jax.random.key(1))
    with torch.no_grad():
        for name, w in ours.table_weights(params).items():
            theirs.embeddings[name].weight.copy_(torch.from_numpy(np.array(w)))
    assert ours.embedding_names_by_table() == theirs.embedding_names_by_table()
    assert (
        ours.embedding_dim() == theirs.embedding_dim()
        and ours.need_indices() == theirs.need_indices()
    )
    rows = {n: r for n, r, _, _ in specs}
    for i in range(CASES // 5):  # eager per feature on both sides: slower per case
        c = _module_case(i, rows, weighted=False)
        t = theirs(tr_kjt(c))
        o = ours.apply(params, sj_kjt(c))
        assert list(o) == list(t), f"case {i}"
        for k in t:
            np.testing.assert_allclose(
                np.asarray(o[k].values()),
                t[k].values().detach().numpy(),
                rtol=1e-6,
                err_msg=f"case {i} {k}",
            )
            same(o[k].lengths(), t[k].lengths().to(torch.int32), f"case {i} {k} lengths")
            same(o[k].weights(), t[k].weights(), f"case {i} {k} indices")


def test_dtypes_without_x64():
    """With x64 off (JAX's default) 64-bit values/lengths narrow to 32 bits; everything else
    as TorchRec."""
    with jax.enable_x64(False):
        for i in range(100):
            c = random_kjt_case(i)
            theirs = tr_kjt(c)
            if (
                c["kind"] == "int64"
                and c["values"].size
                and np.abs(c["values"]).max() > np.iinfo(np.int32).max
            ):
                with pytest.raises(ValueError, match="does not fit in int32 and jax x64 is off"):
                    sj_kjt(c)
                continue
            ours = sj_kjt(c)
            narrow = {np.dtype(np.int64): np.int32, np.dtype(np.float64): np.float32}
            for name in ("values", "lengths", "offsets"):
                o, t = np.asarray(getattr(ours, name)()), getattr(theirs, name)().numpy()
                assert o.dtype == narrow.get(t.dtype, t.dtype), f"case {i} {name}"
                assert np.array_equal(o, t), f"case {i} {name}"
