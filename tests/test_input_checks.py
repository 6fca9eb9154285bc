"""The input checks of `sparse_jax._validate`, one case per rule, each error matched on the
words that name the rule, the position and the value (the messages are part of the API: they
tell the user which feature, bag and id are wrong). Found by mutation testing: every case here
kills a mutant of `_validate.py` that the behavioural tests left alive."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import JaggedTensor, KeyedJaggedTensor, _validate

I32 = np.int32
VALUES3 = np.array([1, 2, 3], I32)


def _jt(**kw):
    return JaggedTensor(kw.pop("values", VALUES3), **kw)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(offsets=np.array([0, 2, 1, 3])), "offsets decrease at bag 1 (2 -> 1)"),
        (dict(offsets=np.array([0, 3, 2, 3])), "offsets decrease at bag 1 (3 -> 2)"),
        (
            dict(offsets=np.array([[0, 3]])),
            "offsets must be 1-D with at least one entry (0), got shape (1, 2)",
        ),
        (
            dict(offsets=np.array([], I32)),
            "offsets must be 1-D with at least one entry (0), got shape (0,)",
        ),
        (dict(offsets=np.array([2, 3])), "offsets must start at 0, got 2"),
        (dict(offsets=np.array([0, 2])), "offsets end at 2 but values holds 3 ids"),
        (dict(offsets=np.array([0, 1, 2])), "offsets end at 2 but values holds 3 ids"),
        (
            dict(lengths=np.array([[1, 2]]), offsets=np.array([0, 1, 3])),
            "lengths has shape (1, 2) but offsets describe 2 bags",
        ),
        (dict(offsets=np.array([0.0, 3.0])), "offsets must be integers, got dtype float64"),
        (dict(lengths=np.array([[3]])), "lengths must be 1-D, got shape (1, 1)"),
        (dict(lengths=np.array([3.0])), "lengths must be integers, got dtype float64"),
        (dict(lengths=np.array([4, -1])), "length -1 at bag 1 is negative"),
        (
            dict(lengths=np.array([1, 1])),
            "sum(lengths)=2 but values holds 3 ids; every id belongs to exactly one bag, so the two must match",
        ),
        (
            dict(lengths=np.array([1, 2]), offsets=np.array([0, 2, 3])),
            "at bag 0, lengths says 1 ids but offsets say 2; give one of them, or both for the same bags",
        ),
        (
            dict(lengths=np.array([2, 0, 1]), offsets=np.array([0, 2, 2, 3])[[0, 1, 3, 3]]),
            "at bag 1, lengths says 0 ids but offsets say 1",
        ),
        (
            dict(lengths=np.array([1, 2, 0]), offsets=np.array([0, 2, 3])),
            "lengths has shape (3,) but offsets describe 2 bags; give one of them, or both for the same bags",
        ),
        (
            dict(lengths=np.array([3]), weights=np.array([1, 2, 3])),
            "weights must be floating point, got dtype int64",
        ),
        (
            dict(lengths=np.array([3]), weights=np.ones(2, np.float32)),
            "weights has shape (2,) but values holds 3 ids; give one weight per id",
        ),
        (
            dict(values=np.array(3), lengths=np.array([0])),
            "values must have at least one dimension",
        ),
        (
            dict(values=np.array(["a", "b", "c"]), lengths=np.array([3])),
            "values must be numbers, got dtype <U1",
        ),
        (
            dict(values=np.array([1, 2**31], np.uint64), lengths=np.array([2])),
            "id 2147483648 at bag 0, index 1 in the bag does not fit in int32",
        ),
        (
            dict(values=np.array([2**33, 1], np.int64), lengths=np.array([1, 1])),
            "id 8589934592 at bag 0, index 0 in the bag does not fit in int32",
        ),
        (
            dict(values=np.array([1, 2, -(2**33)], np.int64), lengths=np.array([2, 1])),
            "id -8589934592 at bag 1, index 0 in the bag does not fit in int32 and jax x64 is off (1 such values); "
            "hash or remap ids into the table's range, or enable jax.config.update('jax_enable_x64', True)",
        ),
    ],
)
def test_jagged_tensor_input_errors(kw, message):
    with pytest.raises(ValueError, match="^JaggedTensor: " + re.escape(message)):
        _jt(**kw)


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(lengths=np.array([1, -1, 3, 0])),
            "length -1 at feature 'a', batch position 1 is negative",
        ),
        # variable stride: 'a' has 1 sample, 'b' has 3; flat bag 2 is b's position 1
        (
            dict(lengths=np.array([1, 2, -1, 1]), stride_per_key_per_rank=[[1], [3]]),
            "length -1 at feature 'b', batch position 1 is negative",
        ),
        (
            dict(
                lengths=np.array([1, 1, 0, 1]),
                offsets=np.array([0, 1, 2, 3, 3]),
                stride_per_key_per_rank=[[1], [3]],
            ),
            "at feature 'b', batch position 1, lengths says 0 ids but offsets say 1",
        ),
        (
            dict(
                lengths=np.array([1, 0, 1, 1]),
                offsets=np.array([0, 1, 1, 3, 3]),
                stride_per_key_per_rank=[[3], [1]],
            ),
            "at feature 'a', batch position 2, lengths says 1 ids but offsets say 2",
        ),
        (
            dict(
                lengths=np.array([1, 0, 1, 1]),
                values=np.array([1, 2, 2**40], np.int64),
                stride_per_key_per_rank=[[2], [2]],
            ),
            "id 1099511627776 at feature 'b', batch position 1, index 0 in the bag",
        ),
        (
            dict(lengths=np.array([3, 0, 0, 0]), values=np.array([1, 2, 2**40], np.int64)),
            "id 1099511627776 at feature 'a', batch position 0, index 2 in the bag",
        ),
        # [N, D] rows: each row's largest and smallest entry are checked, and the row is named
        (
            dict(
                lengths=np.array([1, 1, 1, 1]),
                values=np.array([[1, 2], [3, 4], [5, 6], [0, -(2**33)]], np.int64),
            ),
            "id -8589934592 at feature 'b', batch position 1, index 0 in the bag",
        ),
        (
            dict(
                lengths=np.array([1, 1, 1, 1]),
                values=np.array([[1, 2], [3, 4], [2**33, 6], [0, 0]], np.int64),
            ),
            "id 8589934592 at feature 'b', batch position 0, index 0 in the bag",
        ),
    ],
)
def test_keyed_jagged_tensor_input_errors_name_feature_and_position(kw, message):
    values = kw.pop("values", np.array([1, 2, 3], I32))
    with pytest.raises(ValueError, match="^KeyedJaggedTensor: " + re.escape(message)):
        KeyedJaggedTensor(["a", "b"], values, **kw)


def test_accepted_edges_and_dtypes_without_x64():
    with jax.enable_x64(False):
        empty = JaggedTensor(np.array([], I32), offsets=np.array([0]))
        assert empty.lengths().shape == (0,) and empty.offsets().tolist() == [0]
        for values, dtype in [
            (np.array([True, False]), jnp.bool_),
            (jnp.array([1.0, 2.0], jnp.bfloat16), jnp.bfloat16),
            (np.array([1.0, 2.0]), jnp.float32),  # float64 -> float32, not int32
            (np.array([1, 2], I32), jnp.int32),
            (np.array([1, 2], np.int16), jnp.int16),
            (np.array([1, 2], np.uint32), jnp.uint32),
            (np.array([-(2**31), 2**31 - 1], np.int64), jnp.int32),  # the int32 boundaries fit
            (np.array([1, 2], np.complex128), jnp.complex64),
        ]:
            jt = JaggedTensor(values, lengths=np.array([2], np.int64), weights=np.ones(2))
            assert jt.values().dtype == dtype, (values.dtype, jt.values().dtype)
            assert jt.lengths().dtype == jnp.int32 and jt.offsets().dtype == jnp.int32
            assert jt.weights().dtype == jnp.float32
        edge = JaggedTensor(np.array([-(2**31), 2**31 - 1], np.int64), lengths=np.array([2]))
        assert edge.values().tolist() == [-(2**31), 2**31 - 1]
        jt = JaggedTensor(VALUES3, offsets=np.array([0, 3], np.int64))
        assert jt.offsets().dtype == jnp.int32 and jt.lengths().dtype == jnp.int32


def test_dtypes_kept_with_x64():
    with jax.enable_x64(True):
        jt = JaggedTensor(
            np.array([2**40, 1], np.int64), lengths=np.array([2], np.int64), weights=np.ones(2)
        )
        assert jt.values().dtype == jnp.int64 and jt.values()[0] == 2**40
        assert jt.lengths().dtype == jnp.int64 and jt.offsets().dtype == jnp.int64
        assert jt.weights().dtype == jnp.float64
        assert _validate.as_id_array(np.array([2**40], np.int64), what="w").dtype == np.int64
        assert _validate.as_id_array(np.array([7], I32), what="w").dtype == np.int64
        ids = np.array([5, 7], np.int64)
        assert np.shares_memory(_validate.as_id_array(ids, what="w"), ids)
        assert _validate.canonical_int(np.array([1], np.int64)).dtype == np.int64


def test_as_id_array():
    """The ids a collection looks up (the padded sparse batch): integer, 1-D, int32 unless x64."""
    with jax.enable_x64(False):
        out = _validate.as_id_array(np.array([-(2**31), 0, 2**31 - 1], np.int64), what="w")
        assert out.dtype == np.int32 and out.tolist() == [-(2**31), 0, 2**31 - 1]
        assert _validate.as_id_array(np.array([], np.int64), what="w").dtype == np.int32
        assert _validate.as_id_array(np.array([], np.float32), what="w").dtype == np.int32
        with pytest.raises(
            ValueError,
            match=re.escape(
                "w: values must be integer ids, got dtype float32; convert with astype(int32) or hash strings to integers first"
            ),
        ):
            _validate.as_id_array(np.array([1.0], np.float32), what="w")
        with pytest.raises(ValueError, match=re.escape("w: values must be 1-D, got shape (1, 1)")):
            _validate.as_id_array(np.array([[1]]), what="w")
        with pytest.raises(
            ValueError, match=re.escape("w: id 2147483648 at index 1 does not fit in int32")
        ):
            _validate.as_id_array(np.array([0, 2**31], np.int64), what="w")
        with pytest.raises(
            ValueError, match=re.escape("w: id -2147483649 at index 0 does not fit")
        ):
            _validate.as_id_array(np.array([-(2**31) - 1], np.int64), what="w")
        with pytest.raises(
            ValueError,
            match=re.escape("w: id 4294967295 at bag 1, index 0 in the bag does not fit"),
        ):
            _validate.as_id_array(
                np.array([1, 2**32 - 1], np.uint32),
                what="w",
                where=lambda i: _validate.locate(i, np.array([1, 1]), None, 1),
            )
        ids = np.array([5, 7], I32)
        assert np.shares_memory(
            _validate.as_id_array(ids, what="w"), ids
        )  # int32 ids are not copied
        with pytest.raises(ValueError, match=re.escape("(2 such values)")):
            _validate.as_id_array(np.array([2**31, 2**32], np.uint64), what="w")


def test_locate_and_bag_position():
    lengths = np.array([2, 0, 3])
    assert _validate.locate(0, lengths, None, 1) == "bag 0, index 0 in the bag"
    assert _validate.locate(1, lengths, None, 1) == "bag 0, index 1 in the bag"
    assert _validate.locate(2, lengths, None, 1) == "bag 2, index 0 in the bag"
    assert _validate.locate(4, lengths, None, 1) == "bag 2, index 2 in the bag"
    assert (
        _validate.locate(4, lengths, ["a", "b", "c"], 1)
        == "feature 'c', batch position 0, index 2 in the bag"
    )
    assert _validate.bag_position(5, ["a", "b"], 3) == "feature 'b', batch position 2"
    assert _validate.bag_position(0, ["a", "b"], 0) == "bag 0"
    assert _validate.bag_position(3, ["a", "b", "c"], [1, 2, 2]) == "feature 'c', batch position 0"
    assert _validate.bag_position(2, ["a", "b", "c"], [1, 2, 2]) == "feature 'b', batch position 1"
    assert _validate.bag_position(0, ["a", "b", "c"], [0, 2, 2]) == "feature 'b', batch position 0"


def test_check_helpers_directly():
    """Each helper's own contract, called as `_jagged` calls it (keys and stride given)."""
    assert _validate.check_offsets(np.array([0, 0, 2, 5]), 5, what="w").tolist() == [0, 2, 3]
    assert _validate.check_lengths(
        np.array([1, 2]), 5, what="w", keys=None, stride=1, exact=False
    ).tolist() == [1, 2]
    with pytest.raises(ValueError, match=re.escape("w: sum(lengths)=6 but values holds 5 ids")):
        _validate.check_lengths(np.array([3, 3]), 5, what="w", keys=None, stride=1, exact=False)
    with pytest.raises(
        ValueError, match=re.escape("w: length -2 at feature 'b', batch position 0 is negative")
    ):
        _validate.check_lengths(np.array([1, 1, -2]), 0, what="w", keys=["a", "b"], stride=2)
    with pytest.raises(
        ValueError, match=re.escape("w: at feature 'b', batch position 1, lengths says 1")
    ):
        _validate.check_agree(
            np.array([0, 0, 0, 1]), np.array([0, 0, 0, 2]), what="w", keys=["a", "b"], stride=2
        )
    with pytest.raises(
        ValueError, match=re.escape("w: lengths has shape (1,) but offsets describe 2 bags")
    ):
        _validate.check_agree(np.array([1]), np.array([1, 0]), what="w", keys=None, stride=1)
    assert _validate.check_weights(np.array([], np.int64), 0, what="w").shape == (0,)
    assert _validate.is_concrete(np.ones(1), None) and _validate.is_concrete()
    traced = []
    jax.jit(lambda x: traced.append(_validate.is_concrete(np.ones(1), x)) or x)(1.0)
    assert traced == [False]
