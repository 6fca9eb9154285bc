"""Jagged tensors against the plain-loop oracles, plus every bad input the issue lists."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_jax import JaggedTensor, KeyedJaggedTensor, KeyedTensor, capacity_for, make_ladder
from tests import reference


@st.composite
def kjts(draw, max_keys=4, max_batch=5, max_len=4, weighted=None):
    num_keys = draw(st.integers(1, max_keys))
    stride = draw(st.integers(1, max_batch))
    lengths = draw(
        st.lists(st.integers(0, max_len), min_size=num_keys * stride, max_size=num_keys * stride)
    )
    n = sum(lengths)
    values = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    if weighted is None:
        weighted = draw(st.booleans())
    weights = np.linspace(0.5, 1.5, n, dtype=np.float32) if weighted else None
    keys = [f"f{i}" for i in range(num_keys)]
    return keys, np.array(values, np.int64), np.array(lengths, np.int64), weights, stride


@settings(max_examples=40, deadline=None)
@given(kjts())
def test_kjt_accessors_match_plain_loops(case):
    keys, values, lengths, weights, stride = case
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=weights)
    assert kjt.keys() == keys and kjt.stride() == stride
    assert np.asarray(kjt.offsets()).tolist() == [0, *np.cumsum(lengths).tolist()]
    expected = reference.bags(keys, values, lengths, stride)
    for key in keys:
        jt = kjt[key]
        assert [np.asarray(b).tolist() for b in jt.to_dense()] == expected[key]
        cap = max(1, max(len(b) for b in expected[key]))
        assert np.asarray(jt.to_padded_dense(cap, -1)).tolist() == reference.padded_dense(
            expected[key], cap, -1
        )
    assert kjt.length_per_key() == [sum(len(b) for b in expected[k]) for k in keys]
    same = KeyedJaggedTensor.from_offsets_sync(keys, values, kjt.offsets(), weights=weights)
    assert np.array_equal(same.lengths(), kjt.lengths())


@settings(max_examples=40, deadline=None)
@given(kjts(), st.randoms(use_true_random=False))
def test_permute_and_split_match_plain_loops(case, rnd):
    keys, values, lengths, weights, stride = case
    kjt = KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths)
    order = list(range(len(keys)))
    rnd.shuffle(order)
    permuted = kjt.permute(order)
    expected = reference.bags(keys, values, lengths, stride)
    got = reference.bags(
        permuted.keys(), np.asarray(permuted.values()), np.asarray(permuted.lengths()), stride
    )
    assert permuted.keys() == [keys[i] for i in order]
    assert got == {k: expected[k] for k in permuted.keys()}
    if weights is not None:
        # weights travel with their ids
        w_by_id = {}
        for key in keys:
            jt = kjt[key]
            w_by_id[key] = np.asarray(jt.weights()).tolist()
        assert np.asarray(permuted.weights()).tolist() == sum(
            (w_by_id[k] for k in permuted.keys()), []
        )
    cut = rnd.randint(0, len(keys))
    left, right = kjt.split([cut, len(keys) - cut])
    assert left.keys() == keys[:cut] and right.keys() == keys[cut:]
    for part in (left, right):
        assert reference.bags(
            part.keys(), np.asarray(part.values()), np.asarray(part.lengths()), stride
        ) == {k: expected[k] for k in part.keys()}


@settings(max_examples=30, deadline=None)
@given(kjts())
def test_pad_segment_ids_and_mask(case):
    keys, values, lengths, weights, stride = case
    kjt = KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths)
    padded = kjt.pad(make_ladder(8, 1 << 12))
    cap = padded.capacity()
    assert cap == capacity_for(len(values), make_ladder(8, 1 << 12)) and cap >= len(values)
    assert np.asarray(padded.segment_ids()).tolist() == reference.segment_ids(lengths, cap)
    assert np.asarray(padded.valid_mask()).tolist() == [True] * len(values) + [False] * (
        cap - len(values)
    )
    assert np.array_equal(np.asarray(padded.values())[: len(values)], values)
    if weights is not None:
        assert not np.asarray(padded.weights())[len(values) :].any()
    per_key_max = np.asarray(lengths).reshape(len(keys), stride).max(axis=1)
    for cap_k, m in zip(padded.length_caps(), per_key_max, strict=True):
        assert cap_k >= m and cap_k & (cap_k - 1) == 0 and (cap_k == 1 or cap_k < 2 * m)
    # padded bags read back exactly
    assert reference.bags(keys, np.asarray(padded.values()), lengths, stride) == reference.bags(
        keys, values, lengths, stride
    )


def test_kjt_is_a_pytree_through_jit():
    kjt = KeyedJaggedTensor(["a", "b"], np.arange(5), lengths=np.array([2, 0, 1, 2])).pad(
        capacity=16
    )
    leaves, treedef = jax.tree_util.tree_flatten(kjt)
    assert all(isinstance(x, jax.Array) for x in leaves)

    @jax.jit
    def pooled_count(k):
        return jax.ops.segment_sum(
            k.valid_mask().astype(jnp.int32), k.segment_ids(), num_segments=4
        )

    assert np.asarray(pooled_count(kjt)).tolist() == [2, 0, 1, 2]
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.keys() == ["a", "b"] and back.length_caps() == (2, 2)


def test_empty_bags_zero_length_feature_and_batch_size_one():
    kjt = KeyedJaggedTensor(["a", "b"], np.array([7]), lengths=np.array([0, 1]))
    assert kjt.stride() == 1 and kjt.length_per_key() == [0, 1]
    assert np.asarray(kjt["a"].values()).size == 0
    assert np.asarray(kjt["a"].to_padded_dense(3)).tolist() == [[0, 0, 0]]
    empty = KeyedJaggedTensor(["a"], np.zeros(0, np.int32), lengths=np.zeros(3, np.int32))
    assert empty.pad(capacity=8).length_caps() == (1,)


def test_jagged_tensor_from_dense_round_trip():
    jt = JaggedTensor.from_dense([np.array([1, 2]), np.array([], np.int64), np.array([3])])
    assert np.asarray(jt.lengths()).tolist() == [2, 0, 1]
    assert [np.asarray(b).tolist() for b in jt.to_dense()] == [[1, 2], [], [3]]


def test_from_jt_dict():
    a = JaggedTensor(np.array([1, 2]), lengths=np.array([2, 0]))
    b = JaggedTensor(np.array([3]), lengths=np.array([0, 1]))
    kjt = KeyedJaggedTensor.from_jt_dict({"a": a, "b": b})
    assert kjt.keys() == ["a", "b"] and np.asarray(kjt.lengths()).tolist() == [2, 0, 0, 1]


def test_keyed_tensor_to_dict_and_regroup():
    v = jnp.arange(12, dtype=jnp.float32).reshape(2, 6)
    kt = KeyedTensor(["a", "b", "c"], [1, 2, 3], v)
    d = kt.to_dict()
    assert np.array_equal(d["b"], v[:, 1:3]) and kt.offset_per_key() == [0, 1, 3, 6]
    kt2 = KeyedTensor.from_tensor_list(["d"], [jnp.ones((2, 2), jnp.float32)])
    (g1, g2) = KeyedTensor.regroup([kt, kt2], [["c", "d"], ["a"]])
    assert g1.shape == (2, 5) and np.array_equal(g2, v[:, :1])
    with pytest.raises(KeyError, match="'z'"):
        KeyedTensor.regroup([kt], [["z"]])
    with pytest.raises(ValueError, match="appear twice"):
        KeyedTensor(["a", "a"], [1, 1], jnp.zeros((1, 2)))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(keys=["a", "b"], values=[1, 2], lengths=[1, -1, 1, 1]),
            r"length -1 at feature 'a', batch position 1 is negative",
        ),
        (
            dict(keys=["a", "b"], values=[1, 2, 3], lengths=[1, 1, 0, 0]),
            r"sum\(lengths\)=2 but values holds 3",
        ),
        (dict(keys=["a", "b"], values=[1, 2, 3], lengths=[1, 1, 1]), r"3 lengths for 2 keys"),
        (dict(keys=["a", "a"], values=[1, 2], lengths=[1, 1]), r"key 'a' appears twice"),
        (
            dict(keys=["a"], values=[1, 2], lengths=[2], weights=[1.0]),
            r"weights has shape \(1,\) but values holds 2",
        ),
        (
            dict(keys=["a"], values=["x", "y"], lengths=[2]),
            r"values must be numbers, got dtype <U1",
        ),
        (dict(keys=["a"], values=[1, 2], offsets=[0, 3]), r"offsets end at 3 but values holds 2"),
        (dict(keys=["a"], values=[1, 2], offsets=[1, 2]), r"offsets must start at 0"),
    ],
)
def test_bad_input_names_feature_and_position(kwargs, message):
    kwargs = {
        k: (np.asarray(v) if isinstance(v, list) and k != "keys" else v) for k, v in kwargs.items()
    }
    with pytest.raises(ValueError, match=message):
        KeyedJaggedTensor(**kwargs)


def test_ids_above_int32_are_never_truncated():
    big = np.array([5, 2**31 + 7], dtype=np.int64)
    with pytest.raises(
        ValueError,
        match=r"id 2147483655 at feature 'b', batch position 0, index 0 .* does not fit in int32",
    ):
        KeyedJaggedTensor(["a", "b"], big, lengths=np.array([1, 1]))
    ok = KeyedJaggedTensor(["a"], np.array([2**31 - 1], np.int64), lengths=np.array([1]))
    assert int(ok.values()[0]) == 2**31 - 1 and ok.values().dtype == jnp.int32


def test_ids_above_int32_kept_with_x64():
    with jax.enable_x64(True):
        kjt = KeyedJaggedTensor(["a"], np.array([2**40], np.int64), lengths=np.array([1]))
        assert int(kjt.values()[0]) == 2**40


def test_capacity_ladder_errors():
    with pytest.raises(ValueError, match="exceed the largest capacity 16"):
        capacity_for(17, [8, 16])
    with pytest.raises(ValueError, match="increasing"):
        capacity_for(3, [8, 4])
    kjt = KeyedJaggedTensor(["a"], np.arange(10), lengths=np.array([10]))
    with pytest.raises(ValueError, match="capacity 8 is below the 10 ids"):
        kjt.pad(capacity=8)


def test_lengths_and_offsets_that_disagree_are_refused():
    with pytest.raises(
        ValueError, match=r"feature 'b', batch position 0, lengths says 2 ids but offsets say 1"
    ):
        KeyedJaggedTensor(
            ["a", "b"],
            np.array([1, 2, 3]),
            lengths=np.array([1, 1, 2, 0]),
            offsets=np.array([0, 1, 2, 3, 3]),
        )
    with pytest.raises(
        ValueError, match=re.escape("lengths has shape (1,) but offsets describe 2 bags")
    ):
        KeyedJaggedTensor(
            ["a"], np.array([1, 2]), lengths=np.array([2]), offsets=np.array([0, 1, 2])
        )
    ok = KeyedJaggedTensor(
        ["a", "b"],
        np.array([1, 2, 3]),
        lengths=np.array([1, 1, 1, 0]),
        offsets=np.array([0, 1, 2, 3, 3]),
    )
    assert np.asarray(ok.lengths()).tolist() == [1, 1, 1, 0]


def test_no_keys_with_bags_is_refused():
    with pytest.raises(ValueError, match="no keys but 2 bags"):
        KeyedJaggedTensor([], np.array([1, 2]), lengths=np.array([1, 1]))
    assert KeyedJaggedTensor([], np.zeros(0, np.int64), lengths=np.zeros(0, np.int64)).stride() == 0


def test_jagged_tensor_empty_from_dense_lengths_and_dense_weights():
    e = JaggedTensor.empty()
    assert (
        e.values().shape == (0,)
        and e.lengths().shape == (0,)
        and np.asarray(e.offsets()).tolist() == [0]
    )
    assert e.weights_or_none() is None and JaggedTensor.empty(is_weighted=True).weights().shape == (
        0,
    )
    dense = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    w = dense / 10.0
    jt = JaggedTensor.from_dense_lengths(dense, np.array([2, 0, 3]), weights=w)
    assert [np.asarray(x).tolist() for x in jt.to_dense()] == [[1, 2], [], [7, 8, 9]]
    got_w = jt.to_dense_weights()
    for got, want in zip(got_w, [[0.1, 0.2], [], [0.7, 0.8, 0.9]], strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    assert JaggedTensor.from_dense([[1], [2, 3]]).to_dense_weights() is None
    with pytest.raises(ValueError, match="length 4 of bag 1 is outside"):
        JaggedTensor.from_dense_lengths(dense, np.array([1, 4, 0]))


def test_kjt_concat_puts_keys_side_by_side():
    a = KeyedJaggedTensor(
        ["a"], np.array([1, 2, 3]), lengths=np.array([2, 1]), weights=np.array([1.0, 2.0, 3.0])
    )
    b = KeyedJaggedTensor(
        ["b", "c"], np.array([4, 5]), lengths=np.array([0, 1, 1, 0]), weights=np.array([4.0, 5.0])
    )
    both = KeyedJaggedTensor.concat([a, b.pad(capacity=8)])  # a padded KJT's padding is dropped
    assert both.keys() == ["a", "b", "c"] and both.stride() == 2
    assert np.asarray(both.values()).tolist() == [1, 2, 3, 4, 5]
    assert np.asarray(both.lengths()).tolist() == [2, 1, 0, 1, 1, 0]
    assert np.asarray(both.weights()).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [np.asarray(x).tolist() for x in both["c"].to_dense()] == [[5], []]
    with pytest.raises(ValueError, match="strides"):
        KeyedJaggedTensor.concat(
            [a, KeyedJaggedTensor(["d"], np.array([1]), lengths=np.array([1]))]
        )
    with pytest.raises(ValueError, match="appears twice"):
        KeyedJaggedTensor.concat([a, a])
    with pytest.raises(ValueError, match="weighted"):
        KeyedJaggedTensor.concat(
            [a, KeyedJaggedTensor(["d"], np.array([1]), lengths=np.array([1, 0]))]
        )
