"""The serving request reader (`hybrid.serving._request.read_sparse`), vectorised, against
its plain-loop twin (`tests/reference.serving_request_loop`): the ids, offsets, weights
and batch rung of random requests in every accepted form, and the named refusals of bad
ones (the vectorised checks find them; the feature-by-feature walk names them). numpy only:
no program is compiled here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid.serving._request import RequestError, RequestSpec, read_sparse, with_bounds
from tests.reference import serving_request_loop

FEATURES = ("a", "b", "c")
ROWS = {"a": 50, "b": 40, "c": 30}


def _spec(*, weighted=False, rungs=(1, 8, 32), bounds_check="error") -> RequestSpec:
    return RequestSpec(
        features=FEATURES,
        tables_of={"a": (("t0", 50),), "b": (("t0", 50), ("t2", 40)), "c": (("t1", 30),)},
        is_weighted=weighted,
        bounds_check=bounds_check,
        max_batch_size=32,
        id_capacities=(16, 64, 512),
        batch_rungs=rungs,
    )


def _bags(rng, batch: int) -> dict[str, list[list[int]]]:
    return {
        f: [rng.integers(0, ROWS[f], rng.integers(0, 5)).tolist() for _ in range(batch)]
        for f in ("c", "a", "b")  # another order than the program's
    }


def _forms(bags, weights=None):
    """The same request as per-sample lists, flat arrays, and a (keys, values, lengths) tuple."""
    lists = bags if weights is None else {f: {"ids": bags[f], "weights": weights[f]} for f in bags}
    flat = {}
    for f in bags:
        values = np.array([i for bag in bags[f] for i in bag], np.int64)
        lengths = np.array([len(bag) for bag in bags[f]], np.int64)
        flat[f] = (values, lengths)
        if weights is not None:
            flat[f] += (np.array([w for bag in weights[f] for w in bag], np.float32),)
    keys = list(FEATURES)
    keyed = (
        keys,
        torch.from_numpy(np.concatenate([flat[k][0] for k in keys])),
        torch.from_numpy(np.concatenate([flat[k][1] for k in keys])),
    )
    if weights is not None:
        keyed += (torch.from_numpy(np.concatenate([flat[k][2] for k in keys])),)
    return {"lists": lists, "flat": flat, "keyed": keyed}


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("batch", [1, 2, 8, 9, 32])
def test_read_sparse_packs_what_the_plain_loop_packs(batch, weighted):
    rng = np.random.default_rng(batch)
    bags = _bags(rng, batch)
    weights = (
        {f: [rng.random(len(bag)).tolist() for bag in b] for f, b in bags.items()}
        if weighted
        else None
    )
    spec = _spec(weighted=weighted)
    want = serving_request_loop(bags, FEATURES, (1, 8, 32), 32, spec.id_capacities, weights)
    for name, request in _forms(bags, weights).items():
        got = read_sparse(request, spec)
        np.testing.assert_array_equal(got.values, want[0], err_msg=name)
        np.testing.assert_array_equal(got.offsets, want[1], err_msg=name)
        assert got.values.dtype == np.int32 and got.offsets.dtype == np.int32, name
        if weighted:
            np.testing.assert_array_equal(got.weights, want[2], err_msg=name)
        else:
            assert got.weights is None
        assert got.batch_size == want[3] == batch
    # without batch rungs every request takes max_batch_size bags per feature
    got = read_sparse(bags if not weighted else _forms(bags, weights)["lists"], _spec(rungs=()))
    assert got.offsets.shape == (len(FEATURES) * 32 + 1,)


@pytest.mark.parametrize(
    ("change", "kind", "message"),
    [
        (
            lambda b: b["b"].__setitem__(1, [3, 40]),
            "id_out_of_range",
            r"feature 'b' \(table 't2', num_embeddings=40\): id 40 at sample 1, position 1",
        ),
        (
            lambda b: b["c"].__setitem__(2, [-1]),
            "id_out_of_range",
            r"feature 'c' \(table 't1', num_embeddings=30\): id -1 at sample 2, position 0",
        ),
        (lambda b: b["a"].__setitem__(0, [1.5]), "ids_not_integer", "feature 'a': ids must be"),
        (lambda b: b["a"].__setitem__(0, "12"), "malformed", "feature 'a': sample 0 is '12'"),
        (lambda b: b["a"].__setitem__(0, [[1, 2]]), "malformed", "feature 'a': a sample's ids"),
        (lambda b: b["a"].pop(), "batch_size", "features have different batch sizes"),
    ],
    ids=["above a table", "negative", "float", "string bag", "nested", "batch sizes"],
)
def test_a_bad_request_is_refused_naming_what_is_wrong(change, kind, message):
    bags = _bags(np.random.default_rng(0), 4)
    change(bags)
    with pytest.raises(RequestError, match=message) as e:
        read_sparse(bags, _spec())
    assert e.value.kind == kind


def test_flat_form_checks_lengths_and_json_floats():
    spec = _spec()
    ok = {f: (np.array([1, 2]), np.array([2, 0])) for f in FEATURES}
    whole = {**ok, "a": (np.array([1.0, 2.0]), np.array([2, 0]))}  # JSON may write 3.0
    np.testing.assert_array_equal(read_sparse(whole, spec).values, read_sparse(ok, spec).values)
    with pytest.raises(RequestError, match=r"feature 'b': sample 1 has length -1"):
        read_sparse({**ok, "b": (np.array([1]), np.array([2, -1]))}, spec)
    with pytest.raises(RequestError, match=r"feature 'c': lengths add up to 3 but there are 2"):
        read_sparse({**ok, "c": (np.array([1, 2]), np.array([2, 1]))}, spec)
    with pytest.raises(RequestError, match=r"feature 'a' has no weights"):
        read_sparse(ok, _spec(weighted=True))
    # lengths whose int64 sum wraps around to the id count are refused, not packed
    big = np.iinfo(np.int64).max
    three = {f: (np.array([1, 2, 3]), np.array([1, 1, 1])) for f in FEATURES}
    with pytest.raises(RequestError, match=r"feature 'a': sample 0 has length \d+ but there are 5"):
        read_sparse({**three, "a": (np.arange(5), np.array([big, big, 7]))}, spec)


def test_the_packed_arrays_start_on_64_byte_boundaries_so_xla_reads_them_in_place():
    """XLA:CPU takes a host argument without copying it only when it is 64-byte aligned."""
    rng = np.random.default_rng(3)
    for batch in (1, 5, 32):
        got = read_sparse(_bags(rng, batch), _spec(weighted=False))
        weighted = read_sparse(
            {
                f: {"ids": bags, "weights": [[1.0] * len(b) for b in bags]}
                for f, bags in _bags(rng, batch).items()
            },
            _spec(weighted=True),
        )
        for array in (got.values, got.offsets, weighted.values, weighted.offsets, weighted.weights):
            assert array.ctypes.data % 64 == 0
            assert array.flags.c_contiguous and array.flags.writeable


def test_bounds_shared_by_every_feature_are_checked_by_one_min_and_max():
    """With bounds_check "clamp" every feature's ids share int32's range (`id_bounds` gives
    one pair): the ids still reach the program untruncated, and the culprit is named."""
    spec = with_bounds(_spec(bounds_check="clamp"))
    assert spec.bounds.uniform == (-(2**31), 2**31)
    assert with_bounds(_spec()).bounds.uniform is None  # tables of 50, 40 and 30 rows
    ok = {f: (np.array([1, 2]), np.array([2, 0])) for f in FEATURES}
    np.testing.assert_array_equal(read_sparse(ok, spec).values, read_sparse(ok, _spec()).values)
    with pytest.raises(RequestError, match=r"feature 'c' \(ids must fit int32\): id 2147483648"):
        read_sparse({**ok, "c": (np.array([1, 2**31]), np.array([2, 0]))}, spec)
