"""TorchRec's smaller JaggedTensor / KeyedJaggedTensor API, call by call: placement (`device`,
`to`), empty constructors, `concat`, per-key views, `permute` / `split` refusals, the
equality helpers. (Construction, padding and the differential test against TorchRec:
tests/test_jagged.py, tests/test_torchrec_differential.py.)"""

import re

import jax
import numpy as np
import pytest

from sparse_jax import JaggedTensor, KeyedJaggedTensor, jt_is_equal, kjt_is_equal


def _devices(x):
    return [a.devices() for a in jax.tree_util.tree_leaves(x)]


def _kjt(weighted=False):
    w = np.array([0.5, 1.5, 2.0, 3.0], np.float32) if weighted else None
    return KeyedJaggedTensor(
        ["a", "b"], np.array([1, 2, 3, 4], np.int32), w, lengths=np.array([2, 0, 1, 1], np.int32)
    )


def test_to_moves_every_array_and_device_names_it():
    d1 = jax.devices()[1]
    for x in (
        JaggedTensor(np.array([1, 2]), np.array([0.5, 1.0], np.float32), lengths=np.array([2])),
        _kjt(True),
    ):
        moved = x.to(d1, non_blocking=True)
        assert all(devs == {d1} for devs in _devices(moved)) and len(_devices(moved)) >= 4
        assert moved.device() == d1
        assert x.device() == jax.devices()[0]


def test_torchrec_spellings_of_devices_and_arguments():
    """What TorchRec code writes: `to("cpu")` / a torch.device / "cuda:N", `empty_like(x,
    device)`, `concat(kjt_list=...)`, `to_dict(compute_offsets=...)`."""
    torch = pytest.importorskip("torch")
    kjt = _kjt(True).to(jax.devices()[1])
    for device in ("cpu", "cpu:1", torch.device("cpu", 1)):
        want = jax.devices()[1] if str(device).endswith("1") else jax.devices()[0]
        assert kjt.to(device).device() == want
    with pytest.raises(ValueError, match=r"JAX has 0 gpu device\(s\) here"):
        kjt.to("cuda:0")
    with pytest.raises(TypeError, match="give a jax.Device, a Sharding, a torch.device"):
        kjt.to(3)
    assert KeyedJaggedTensor.empty_like(kjt, "cpu").device() == jax.devices()[0]
    assert KeyedJaggedTensor.empty_like(kjt).device() == jax.devices()[1]
    jt = kjt["a"]
    assert JaggedTensor.empty_like(jt, jax.devices()[0]).device() == jax.devices()[0]
    other = KeyedJaggedTensor(
        ["c"],
        np.array([7], np.int32),
        np.array([1.0], np.float32),
        lengths=np.array([1, 0], np.int32),
    )
    assert list(KeyedJaggedTensor.concat(kjt_list=[kjt, other]).keys()) == ["a", "b", "c"]
    assert list(kjt.to_dict(compute_offsets=False)) == ["a", "b"]


def test_device_refuses_values_spread_over_devices():
    spread = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",)), jax.sharding.PartitionSpec("x")
    )
    split_values = lambda x: jax.tree_util.tree_map(  # noqa: E731
        lambda a: jax.device_put(a, spread) if a is x._values else a, x
    )
    for x, name in (
        (_kjt(), "KeyedJaggedTensor"),
        (JaggedTensor(np.array([1, 2, 3, 4], np.int32), lengths=np.array([4])), "JaggedTensor"),
    ):
        with pytest.raises(
            ValueError, match="^" + re.escape(f"this {name}'s values span 2 devices") + "$"
        ):
            split_values(x).device()


def test_empty_constructors_keep_dtypes_shape_weights_and_device():
    d2 = jax.devices()[2]
    jt = JaggedTensor.empty(
        is_weighted=True, device=d2, values_dtype=np.int64, weights_dtype=np.float16
    )
    assert jt.device() == d2 and jt.values().shape == (0,) and jt.weights().dtype == np.float16
    assert (
        JaggedTensor.empty().device() == jax.devices()[0]
        and JaggedTensor.empty().weights_or_none() is None
    )
    rows = JaggedTensor(
        np.ones((3, 4), np.float32), np.ones(3, np.float32), lengths=np.array([1, 2], np.int32)
    ).to(d2)
    like = JaggedTensor.empty_like(rows)
    assert (
        like.values().shape,
        like.values().dtype,
        like.weights().shape,
        like.lengths().shape,
    ) == ((0, 4), np.float32, (0,), (0,))
    assert like.device() == d2 and all(devs == {d2} for devs in _devices(like))
    assert (
        JaggedTensor.empty_like(
            JaggedTensor(np.array([1]), lengths=np.array([1]))
        ).weights_or_none()
        is None
    )

    kjt = KeyedJaggedTensor.empty(is_weighted=True, device=d2)
    assert (kjt.keys(), kjt.stride(), kjt.device(), kjt.weights().shape) == ([], 0, d2, (0,))
    assert KeyedJaggedTensor.empty().device() == jax.devices()[0]
    wide = KeyedJaggedTensor(
        ["a"], np.ones((3, 4), np.float32), lengths=np.array([1, 2], np.int32)
    ).to(d2)
    like = KeyedJaggedTensor.empty_like(wide)
    assert (like.keys(), like.stride(), like.values().shape, like.device()) == ([], 2, (0, 4), d2)


def test_concat_of_keyless_kjts_keeps_the_stride_and_refuses_nothing_to_concat():
    keyless = KeyedJaggedTensor.empty_like(_kjt())
    assert keyless.stride() == 2
    assert KeyedJaggedTensor.concat([keyless]).stride() == 2
    both = KeyedJaggedTensor.concat([keyless, _kjt()])
    assert kjt_is_equal(both, _kjt())
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape("KeyedJaggedTensor.concat: give at least one KeyedJaggedTensor")
        + "$",
    ):
        KeyedJaggedTensor.concat([])


def test_concat_of_a_variable_stride_kjt_and_a_uniform_one_lists_every_keys_strides():
    variable = KeyedJaggedTensor(
        ["v"],
        np.array([7, 8, 9], np.int32),
        lengths=np.array([1, 0, 2], np.int32),
        stride_per_key_per_rank=[[1, 2]],
    )
    out = KeyedJaggedTensor.concat([variable, _kjt(), variable._replace(keys=("w",))])
    assert out.keys() == ["v", "a", "b", "w"]
    assert out.stride_per_key_per_rank() == [[1, 2], [2], [2], [1, 2]]
    assert out.stride_per_key() == [3, 2, 2, 3] and out.variable_stride_per_key()
    np.testing.assert_array_equal(out.values(), [7, 8, 9, 1, 2, 3, 4, 7, 8, 9])
    np.testing.assert_array_equal(out.lengths(), [1, 0, 2, 2, 0, 1, 1, 1, 0, 2])


def test_per_key_views():
    kjt = _kjt()
    assert kjt.offset_per_key() == [0, 2, 4] and all(type(o) is int for o in kjt.offset_per_key())
    np.testing.assert_array_equal(kjt.lengths_per_key_matrix(), [[2, 0], [1, 1]])
    variable = KeyedJaggedTensor(
        ["v"],
        np.array([7], np.int32),
        lengths=np.array([1, 0], np.int32),
        stride_per_key_per_rank=[[1, 1]],
    )
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "KeyedJaggedTensor.lengths_per_key_matrix: this KJT has a variable batch size per key [2]; "
            "expand it first with expand_to_batch()"
        )
        + "$",
    ):
        variable.lengths_per_key_matrix()
    padded = kjt.pad(capacity=8)
    assert padded.length_caps() is not None and padded.without_length_caps().length_caps() is None
    assert kjt.without_length_caps() is kjt
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape("this KeyedJaggedTensor has no inverse_indices; use inverse_indices_or_none()")
        + "$",
    ):
        kjt.inverse_indices()
    text = repr(kjt)
    assert (
        text.startswith("KeyedJaggedTensor(keys=['a', 'b'], stride=2, values=")
        and "lengths=" in text
    )


def test_permute_and_split_refuse_out_of_range_keys_and_bad_segments():
    kjt = _kjt()
    assert kjt.permute([1, 0]).keys() == ["b", "a"]
    with pytest.raises(
        ValueError, match="^" + re.escape("permute: index 2 is out of range for 2 keys") + "$"
    ):
        kjt.permute([0, 2])
    with pytest.raises(
        ValueError, match="^" + re.escape("permute: index -1 is out of range for 2 keys") + "$"
    ):
        kjt.permute([-1])
    assert [k.keys() for k in kjt.split([0, 2, 0])] == [[], ["a", "b"], []]
    for bad in ([1], [3, -1], [1, 2]):
        with pytest.raises(
            ValueError,
            match="^" + re.escape(f"split: segments {bad} must be >= 0 and sum to 2 keys") + "$",
        ):
            kjt.split(bad)


def test_equality_helpers():
    a = JaggedTensor(
        np.array([1, 2, 3]), np.array([np.nan, 1.0, 2.0], np.float32), lengths=np.array([1, 2])
    )
    same = JaggedTensor(
        np.array([1, 2, 3]), np.array([np.nan, 1.0, 2.0], np.float32), lengths=np.array([1, 2])
    )
    assert jt_is_equal(a, same)  # NaN weights are equal to NaN weights
    assert not jt_is_equal(
        a,
        JaggedTensor(
            np.array([1, 2, 4]), np.array([np.nan, 1, 2], np.float32), lengths=np.array([1, 2])
        ),
    )
    assert not jt_is_equal(
        a, JaggedTensor(np.array([1, 2, 3]), lengths=np.array([1, 2]))
    )  # weights vs none
    assert not jt_is_equal(JaggedTensor(np.array([1, 2, 3]), lengths=np.array([1, 2])), a)
    assert not jt_is_equal(a, "a") and not jt_is_equal("a", a)
    ids = JaggedTensor(np.array([1, 2, 3]), lengths=np.array([1, 2]))
    assert not jt_is_equal(ids, JaggedTensor(np.array([1, 2, 3]), lengths=np.array([2, 1])))
    assert kjt_is_equal(_kjt(True), _kjt(True).pad(capacity=8))
    assert (
        not kjt_is_equal(_kjt(True), _kjt(False))
        and not kjt_is_equal(_kjt(), "kjt")
        and not kjt_is_equal("kjt", _kjt())
    )
    nan_ids = KeyedJaggedTensor(["a"], np.array([1.5, np.nan]), lengths=np.array([2]))
    assert kjt_is_equal(
        nan_ids, KeyedJaggedTensor(["a"], np.array([1.5, np.nan]), lengths=np.array([2]))
    )


def test_permute_and_split_keep_per_key_strides_and_inverse_indices():
    inverse = (["a", "b"], np.array([[0, 1, 0], [1, 0, 1]], np.int32))
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        np.array([1, 2, 3, 4], np.int32),
        lengths=np.array([2, 1, 0, 1], np.int32),
        stride_per_key_per_rank=[[2], [2]],
        inverse_indices=inverse,
    )
    for out in (kjt.permute([1, 0]), kjt.split([1, 1])[1]):
        assert out.stride_per_key_per_rank() == [[2]] * len(out.keys())
        keys, inv = out.inverse_indices()
        assert keys == ["a", "b"] and np.array_equal(np.asarray(inv), inverse[1])
    variable = KeyedJaggedTensor(
        ["a", "b"],
        np.array([1, 2, 3], np.int32),
        lengths=np.array([1, 0, 2], np.int32),
        stride_per_key_per_rank=[[2], [1]],
        inverse_indices=(["a", "b"], np.zeros((2, 2), np.int32)),
    )
    assert variable.permute([1, 0]).stride_per_key_per_rank() == [[1], [2]]
    np.testing.assert_array_equal(
        variable.permute([1, 0]).expand_to_batch().lengths(), [2, 2, 1, 1]
    )


def test_expand_to_batch_refuses_what_it_cannot_expand():
    no_inverse = KeyedJaggedTensor(
        ["a"],
        np.array([1], np.int32),
        lengths=np.array([1, 0], np.int32),
        stride_per_key_per_rank=[[2]],
    )
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "KeyedJaggedTensor: a variable-stride KJT needs inverse_indices to be expanded to the batch "
            "(give inverse_indices=(keys, [num_keys, batch]))"
        )
        + "$",
    ):
        no_inverse.expand_to_batch()
    other_keys = no_inverse._replace(inverse=(["z"], np.zeros((1, 3), np.int32)))
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "KeyedJaggedTensor.expand_to_batch: inverse_indices has no row for feature(s) ['a']"
        )
        + "$",
    ):
        other_keys.expand_to_batch()


def test_from_dense_keeps_id_dtypes_and_checks_weights():
    assert np.asarray(JaggedTensor.from_dense([]).values()).dtype.kind == "i"
    empty = JaggedTensor.from_dense([], weights=[])
    assert empty.weights().shape == (0,) and np.asarray(empty.weights()).dtype == np.float32
    jt = JaggedTensor.from_dense(
        [np.array([1, 2]), np.array([3])], weights=[np.array([[0.5], [1.0]]), np.array([2.0])]
    )
    np.testing.assert_array_equal(jt.weights(), [0.5, 1.0, 2.0])
    with pytest.raises(
        ValueError,
        match="^" + re.escape("JaggedTensor.from_dense: 1 weight arrays for 2 bags") + "$",
    ):
        JaggedTensor.from_dense([np.array([1]), np.array([2])], weights=[np.array([1.0])])


def test_from_dense_lengths_edges_and_refusals():
    dense = np.arange(12).reshape(2, 3, 2)  # [B=2, N=3, D=2] rows
    jt = JaggedTensor.from_dense_lengths(
        dense, np.array([0, 3]), weights=np.ones((2, 3), np.float32)
    )
    np.testing.assert_array_equal(jt.lengths(), [0, 3])  # an empty bag and a full one are fine
    np.testing.assert_array_equal(jt.values(), dense[1])
    floats = JaggedTensor.from_dense_lengths(dense, np.array([1.0, 2.0]))
    assert np.asarray(floats.lengths()).dtype == np.int32
    for values, lengths, message in [
        (
            np.arange(3),
            np.array([1]),
            "values must be [B, N, ...] and lengths [B]; got (3,) and (1,)",
        ),
        (
            dense,
            np.array([1, 1, 1]),
            "values must be [B, N, ...] and lengths [B]; got (2, 3, 2) and (3,)",
        ),
        (dense, np.array([3, 4]), "length 4 of bag 1 is outside [0, 3] (the padded width)"),
        (dense, np.array([-1, 1]), "length -1 of bag 0 is outside [0, 3] (the padded width)"),
    ]:
        with pytest.raises(
            ValueError, match="^" + re.escape(f"JaggedTensor.from_dense_lengths: {message}") + "$"
        ):
            JaggedTensor.from_dense_lengths(values, lengths)
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape("JaggedTensor.from_dense_lengths: weights (2, 2) must be [B, N] = (2, 3)")
        + "$",
    ):
        JaggedTensor.from_dense_lengths(dense, np.array([1, 1]), weights=np.ones((2, 2)))


def test_from_values_and_lengths_names_both_sizes():
    rows = np.ones((5, 3), np.float32)
    jt = JaggedTensor.from_values_and_lengths(rows, np.array([2, 3], np.int64))
    assert np.asarray(jt.lengths()).dtype == np.int32 and np.asarray(jt.offsets()).tolist() == [
        0,
        2,
        5,
    ]
    with pytest.raises(
        ValueError,
        match="^" + re.escape("JaggedTensor: sum(lengths)=4 but values has 5 rows") + "$",
    ):
        JaggedTensor.from_values_and_lengths(rows, np.array([2, 2]))


def test_from_jt_dict_detects_two_batch_sizes_and_mixed_weights():
    a = JaggedTensor(np.array([1, 2]), lengths=np.array([1, 1]))
    b = JaggedTensor(np.array([3]), lengths=np.array([1]))
    kjt = KeyedJaggedTensor.from_jt_dict({"a": a, "b": b})
    assert kjt.variable_stride_per_key() and kjt.stride_per_key_per_rank() == [[2], [1]]
    assert not KeyedJaggedTensor.from_jt_dict({"a": a, "c": a}).variable_stride_per_key()
    weighted = JaggedTensor(np.array([3]), np.array([1.0], np.float32), lengths=np.array([1]))
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape("KeyedJaggedTensor.from_jt_dict: either every feature has weights or none does")
        + "$",
    ):
        KeyedJaggedTensor.from_jt_dict({"a": a, "b": weighted})


def test_a_pytree_round_trip_keeps_per_key_strides_and_inverse_indices():
    variable = KeyedJaggedTensor(
        ["v"],
        np.array([7, 8], np.int32),
        lengths=np.array([1, 1], np.int32),
        stride_per_key_per_rank=[[1, 1]],
    )
    inverse = KeyedJaggedTensor(
        ["a"],
        np.array([1, 2], np.int32),
        lengths=np.array([1, 1], np.int32),
        inverse_indices=(["a"], np.array([[1, 0, 1]], np.int32)),
    )
    for kjt in (variable, inverse, _kjt()):
        leaves, tree = jax.tree_util.tree_flatten(kjt)
        back = jax.tree_util.tree_unflatten(tree, leaves)
        assert back.stride_per_key_per_rank() == kjt.stride_per_key_per_rank()
        assert (back.inverse_indices_or_none() is None) == (kjt.inverse_indices_or_none() is None)
        assert kjt_is_equal(back, kjt)
    assert jax.jit(lambda k: k)(variable).stride_per_key_per_rank() == [[1, 1]]


def test_pad_keeps_dtypes_trailing_shape_and_weights_and_takes_larger_caps():
    rows = KeyedJaggedTensor(
        ["a"],
        np.ones((3, 4), np.float32),
        np.array([1, 2, 3], np.float16),
        lengths=np.array([1, 2], np.int32),
    )
    padded = rows.pad(capacity=8)
    assert padded.values().shape == (8, 4) and padded.values().dtype == np.float32
    assert padded.weights().shape == (8,) and padded.weights().dtype == np.float16
    ids = KeyedJaggedTensor(
        ["a", "b"], np.array([5, 6, 7], np.int64), lengths=np.array([1, 2, 0, 0])
    )
    assert ids.pad(capacity=4).values().dtype == ids.values().dtype
    assert ids.pad(capacity=4).length_caps() == (2, 1)
    assert ids.pad(capacity=4, length_caps=[8, 1]).length_caps() == (
        8,
        1,
    )  # the larger of given and own
    with pytest.raises(
        ValueError, match="^" + re.escape("KeyedJaggedTensor.pad: 1 length caps for 2 keys") + "$"
    ):
        ids.pad(capacity=4, length_caps=[8])
    with pytest.raises(
        ValueError,
        match="^" + re.escape("KeyedJaggedTensor.pad: 3 ids exceed the largest capacity 2"),
    ):
        ids.pad([1, 2])
    no_bags = KeyedJaggedTensor(["a"], np.zeros(0, np.int32), lengths=np.zeros(0, np.int32))
    assert no_bags.stride() == 0 and no_bags.pad(capacity=2).length_caps() == (1,)


def test_inverse_indices_are_checked_with_the_feature_and_sample_named():
    kjt = lambda inv, keys=("a",): KeyedJaggedTensor(  # noqa: E731
        ["a"],
        np.array([1, 2], np.int32),
        lengths=np.array([1, 1], np.int32),
        inverse_indices=(list(keys), inv),
    )
    for inv, message in [
        (
            np.array([0, 1]),
            "inverse_indices must be (keys, [num_keys, batch] array); got 1 keys and shape (2,)",
        ),
        (
            np.zeros((2, 3), np.int32),
            "inverse_indices must be (keys, [num_keys, batch] array); got 1 keys and shape (2, 3)",
        ),
        (np.array([[0.0, 1.0]]), "inverse_indices must be integers, got dtype float64"),
        (
            np.array([[0, 2, 1]]),
            "inverse_indices of feature 'a' at sample 1 is 2, outside the feature's 2 bags",
        ),
        (
            np.array([[0, -1]]),
            "inverse_indices of feature 'a' at sample 1 is -1, outside the feature's 2 bags",
        ),
    ]:
        with pytest.raises(
            ValueError, match="^" + re.escape(f"KeyedJaggedTensor: {message}") + "$"
        ):
            kjt(inv)
    assert kjt(np.array([[1, 0, 1]])).inverse_indices()[0] == ["a"]
    assert kjt(np.array([[5, 9]]), keys=("z",)).inverse_indices()[0] == [
        "z"
    ]  # a key it does not hold: not checked


def test_sync_constructors_pass_every_argument_on():
    inverse = (["a"], np.array([[0, 1, 0]], np.int32))
    for build, arg in (
        (KeyedJaggedTensor.from_lengths_sync, {"lengths": np.array([1, 1], np.int32)}),
        (KeyedJaggedTensor.from_offsets_sync, {"offsets": np.array([0, 1, 2], np.int32)}),
    ):
        kjt = build(
            ["a"],
            np.array([1, 2], np.int32),
            weights=np.array([0.5, 1.0], np.float32),
            stride_per_key_per_rank=[[2]],
            inverse_indices=inverse,
            **arg,
        )
        assert kjt.stride_per_key_per_rank() == [[2]] and kjt.inverse_indices()[0] == ["a"]
        np.testing.assert_array_equal(kjt.weights(), [0.5, 1.0])
        empty = (
            {"lengths": np.zeros(0, np.int32)}
            if "lengths" in arg
            else {"offsets": np.zeros(1, np.int32)}
        )
        assert (
            build([], np.zeros(0, np.int32), stride=3, **empty).stride() == 3
        )  # no keys: only the argument says


def test_weights_of_an_unweighted_tensor_name_the_type():
    for x, name in (
        (JaggedTensor(np.array([1]), lengths=np.array([1])), "JaggedTensor"),
        (_kjt(), "KeyedJaggedTensor"),
    ):
        with pytest.raises(
            ValueError,
            match="^" + re.escape(f"this {name} has no weights; use weights_or_none()") + "$",
        ):
            x.weights()


def test_to_padded_dense_keeps_rows_and_dtypes_and_pads_weights_with_zero():
    rows = JaggedTensor(
        np.array([[1, 2], [3, 4], [5, 6]], np.int32), lengths=np.array([1, 2], np.int32)
    )
    dense = rows.to_padded_dense(3)
    assert dense.dtype == np.int32 and dense.shape == (2, 3, 2)
    np.testing.assert_array_equal(dense, [[[1, 2], [0, 0], [0, 0]], [[3, 4], [5, 6], [0, 0]]])
    no_ids = JaggedTensor(
        np.zeros((0, 3), np.int32), lengths=np.array([0, 0], np.int32)
    ).to_padded_dense(4)
    assert no_ids.shape == (2, 4, 3) and no_ids.dtype == np.int32 and not np.asarray(no_ids).any()
    ids = JaggedTensor(
        np.array([1, 2, 3], np.int32),
        np.array([1.0, 2.0, 3.0], np.float32),
        lengths=np.array([1, 2]),
    )
    assert (
        ids.to_padded_dense(padding_value=-1.0).dtype == np.int32
    )  # a float padding keeps integer ids
    np.testing.assert_array_equal(ids.to_padded_dense_weights(), [[1.0, 0.0], [2.0, 3.0]])


def test_empty_like_keeps_integer_ids_and_half_weights():
    like = JaggedTensor.empty_like(
        JaggedTensor(
            np.array([1, 2], np.int32),
            np.array([1, 2], np.float16),
            lengths=np.array([2], np.int32),
        )
    )
    assert (like.values().dtype, like.weights().dtype) == (np.int32, np.float16)
    assert KeyedJaggedTensor.empty().weights_or_none() is None


def test_from_dense_lengths_names_the_first_bad_bag_after_an_empty_one():
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "JaggedTensor.from_dense_lengths: length 4 of bag 1 is outside [0, 3] (the padded width)"
        )
        + "$",
    ):
        JaggedTensor.from_dense_lengths(np.zeros((2, 3)), np.array([0, 4]))
    jt = JaggedTensor.from_values_and_lengths(np.ones((3, 2), np.float32), [1, 2])
    assert np.asarray(jt.offsets()).dtype == np.int32


def test_a_missing_feature_is_named_with_the_keys_there_are():
    with pytest.raises(KeyError) as info:
        _kjt()["z"]
    assert info.value.args == ("feature 'z' is not in this KeyedJaggedTensor (keys: ['a', 'b'])",)


def test_given_caches_are_checked_eagerly_and_trusted_under_jit():
    build = lambda **caches: KeyedJaggedTensor(  # noqa: E731
        ["a", "b"],
        np.array([1, 2, 3, 4], np.int32),
        lengths=np.array([2, 0, 1, 1], np.int32),
        **caches,
    )
    assert build(
        length_per_key=[2, 2], offset_per_key=[0, 2, 4], lengths_offset_per_key=[0, 2, 4]
    ).keys() == ["a", "b"]
    for name, wrong, right in (
        ("length_per_key", [3, 1], [2, 2]),
        ("offset_per_key", [0, 1, 4], [0, 2, 4]),
        ("lengths_offset_per_key", [0, 1, 4], [0, 2, 4]),
    ):
        with pytest.raises(
            ValueError,
            match="^"
            + re.escape(
                f"KeyedJaggedTensor: {name}={wrong} but the lengths give {right}; leave it out (it is computed) "
                "or fix it"
            )
            + "$",
        ):
            build(**{name: wrong})

    @jax.jit
    def traced(
        values, lengths, inverse
    ):  # nothing to read on the host: the caches and inverse are taken as given
        kjt = KeyedJaggedTensor(
            ["a"],
            values,
            lengths=lengths,
            length_per_key=[3],
            offset_per_key=[0, 3],
            stride_per_key_per_rank=[[2]],
            inverse_indices=(["a"], inverse),
        )
        return kjt.values().sum() + kjt.inverse_indices()[1].sum()

    assert int(traced(np.array([1, 2, 3]), np.array([1, 2]), np.array([[0, 1, 1]]))) == 8


def test_concat_of_variable_and_uniform_kjts_takes_the_largest_batch():
    variable = KeyedJaggedTensor(
        ["v"],
        np.array([7], np.int32),
        lengths=np.array([1, 0], np.int32),
        stride_per_key_per_rank=[[2]],
    )
    uniform = KeyedJaggedTensor(
        ["u"], np.array([1, 2, 3], np.int32), lengths=np.array([1, 1, 1], np.int32)
    )
    assert KeyedJaggedTensor.concat([variable, uniform]).stride() == 3


def test_expand_to_batch_of_no_samples_and_of_no_keys():
    no_samples = KeyedJaggedTensor(
        ["a"],
        np.zeros(0, np.int32),
        lengths=np.array([0], np.int32),
        stride_per_key_per_rank=[[1]],
        inverse_indices=(["a"], np.zeros((1, 0), np.int32)),
    )
    out = no_samples.expand_to_batch()
    assert (out.keys(), out.stride(), out.lengths().shape, out.values().shape) == (
        ["a"],
        0,
        (0,),
        (0,),
    )
    no_keys = KeyedJaggedTensor(
        [],
        np.zeros(0, np.int32),
        lengths=np.zeros(0, np.int32),
        stride_per_key_per_rank=[],
        inverse_indices=([], np.zeros((0, 3), np.int32)),
    )
    out = no_keys.expand_to_batch()
    assert (out.keys(), out.stride(), out.lengths().shape) == ([], 3, (0,))


def test_variable_batch_sizes_per_key_from_either_argument_and_their_refusals():
    ids, lengths = np.array([1, 2, 3], np.int32), np.array([1, 0, 2], np.int32)
    by_key = KeyedJaggedTensor(["a", "b"], ids, lengths=lengths, stride_per_key=[2, 1])
    assert by_key.stride_per_key_per_rank() == [[2], [1]] and by_key.stride_per_key() == [2, 1]
    assert by_key.stride() == 2 and by_key.variable_stride_per_key()
    from_array = KeyedJaggedTensor(
        ["a", "b"],
        ids,
        lengths=lengths,
        stride_per_key_per_rank=np.array([[1, 1], [1, 0]]),
        stride_per_key=np.array([2, 1]),
    )
    assert from_array.stride_per_key_per_rank() == [[1, 1], [1, 0]]

    def refused(message, **kw):
        with pytest.raises(
            ValueError, match="^" + re.escape(f"KeyedJaggedTensor: {message}") + "$"
        ):
            KeyedJaggedTensor(
                kw.pop("keys", ["a", "b"]), kw.pop("values", ids), **{"lengths": lengths, **kw}
            )

    refused(
        "stride_per_key [3, 0] disagrees with stride_per_key_per_rank [[2], [1]] (per-key sums [2, 1])",
        stride_per_key_per_rank=[[2], [1]],
        stride_per_key=[3, 0],
    )
    refused("3 entries in stride_per_key(_per_rank) for 2 keys", stride_per_key=[1, 1, 1])
    refused(
        "stride_per_key_per_rank[1] = [2, -1] has a negative batch size",
        stride_per_key_per_rank=[[2], [2, -1]],
    )
    refused("3 lengths but the per-key batch sizes [2, 2] sum to 4", stride_per_key=[2, 2])
    refused("key 1 must be a string feature name, got 7", keys=["a", 7])
    refused("give lengths or offsets (ids per bag, num_keys * batch_size entries)", lengths=None)
    refused(
        "no keys but 3 bags; give one key per feature (lengths are num_keys * batch_size entries in key-major "
        "order)",
        keys=[],
    )


def test_under_jit_any_one_traced_array_skips_the_host_checks():
    values, weights = np.array([1, 2, 3], np.int32), np.array([0.5, 1.0, 2.0], np.float32)
    lengths, offsets = np.array([1, 2], np.int32), np.array([0, 1, 3], np.int32)
    for traced in ("values", "weights", "lengths", "offsets"):
        given = {"values": values, "weights": weights, "lengths": lengths, "offsets": offsets}
        if traced != "offsets":
            given.pop("offsets")

        @jax.jit
        def build(x, given=given, traced=traced):
            kjt = KeyedJaggedTensor(["a"], **{**given, traced: x})
            return (kjt.values().sum() + kjt.offsets()[-1]).astype(np.float32) + kjt.weights().sum()

        assert float(build(given[traced])) == 6 + 3 + 3.5, traced

    def derived(lengths_or_offsets, which):
        kjt = KeyedJaggedTensor(["a"], values, **{which: lengths_or_offsets})
        return kjt.lengths(), kjt.offsets()

    for which, arg in (
        ("lengths", lengths),
        ("offsets", offsets),
    ):  # the other one is derived under the trace
        got_lengths, got_offsets = jax.jit(derived, static_argnums=1)(arg, which)
        assert (np.asarray(got_lengths).tolist(), np.asarray(got_offsets).tolist()) == (
            [1, 2],
            [0, 1, 3],
        ), which


def test_construction_refusals_word_for_word():
    def refused(cls, message, *args, **kw):
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            cls(*args, **kw)

    refused(JaggedTensor, "JaggedTensor: give lengths or offsets (ids per bag)", np.array([1]))
    ids = np.array([1, 2, 3], np.int32)
    refused(
        KeyedJaggedTensor,
        "KeyedJaggedTensor: 3 lengths for 2 keys ['a', 'b']; lengths must hold num_keys * "
        "batch_size entries in key-major order",
        ["a", "b"],
        ids,
        lengths=np.array([1, 1, 1]),
    )
    refused(
        KeyedJaggedTensor,
        "KeyedJaggedTensor: 4 lengths but 2 keys x stride 3 = 6",
        ["a", "b"],
        ids,
        lengths=np.array([1, 1, 1, 0]),
        stride=3,
    )
    refused(
        KeyedJaggedTensor,
        "KeyedJaggedTensor: index_per_key={'a': 1, 'b': 0} but the keys give {'a': 0, 'b': 1}",
        ["a", "b"],
        ids,
        lengths=np.array([1, 1, 1, 0]),
        index_per_key={"a": 1, "b": 0},
    )
    other = {
        "a": JaggedTensor(np.array([1, 2]), lengths=np.array([1, 1])),
        "b": JaggedTensor(np.array([3]), lengths=np.array([1, 0])),
    }
    refused(
        KeyedJaggedTensor,
        "KeyedJaggedTensor: jt_dict does not hold this KJT's bags (keys ['a', 'b']); leave it "
        "out (to_dict computes it)",
        ["a", "b"],
        ids,
        lengths=np.array([1, 1, 0, 1]),
        jt_dict=other,
    )
    assert KeyedJaggedTensor(
        ["a", "b"], ids, lengths=np.array([1, 1, 1, 0]), jt_dict=other
    ).keys() == ["a", "b"]
    no_samples = KeyedJaggedTensor(
        ["a"],
        np.zeros(0, np.int32),
        lengths=np.array([0], np.int32),
        stride_per_key=[1],
        inverse_indices=(["a"], [[]]),
    )  # an empty list is no floats
    assert no_samples.inverse_indices()[1].shape == (1, 0)
    empty = JaggedTensor(np.zeros(0, np.int32), lengths=[])
    assert np.asarray(empty.lengths()).dtype == np.int32 and np.asarray(
        empty.offsets()
    ).tolist() == [0]
