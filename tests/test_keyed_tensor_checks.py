"""`sparse_jax.KeyedTensor`: every refusal with its full message, the cache arguments checked
against the lengths, key_dim honoured by from_tensor_list and regroup, an empty group.
Found by mutation testing of `_keyed_tensor.py`."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import KeyedTensor

V = np.arange(12.0, dtype=np.float32).reshape(
    2, 6
)  # numpy: importing the module starts no XLA backend


def _raises(exc, message, fn, *args, **kw):
    with pytest.raises(exc, match="^" + re.escape(message)):
        fn(*args, **kw)


def test_constructor_refusals():
    _raises(
        ValueError,
        "KeyedTensor: 2 keys but 1 entries in length_per_key",
        KeyedTensor,
        ["a", "b"],
        [6],
        V,
    )
    _raises(
        ValueError,
        "KeyedTensor: key(s) ['a'] appear twice; keys must be unique",
        KeyedTensor,
        ["a", "b", "a"],
        [2, 2, 2],
        V,
    )
    _raises(
        ValueError,
        "KeyedTensor: key(s) ['b'] have a negative length; lengths must be >= 0",
        KeyedTensor,
        ["a", "b", "c"],
        [4, -1, 3],
        V,
    )
    _raises(
        ValueError,
        "KeyedTensor: values has shape (2, 6) but the keys need 5 entries along dim 1",
        KeyedTensor,
        ["a", "b"],
        [2, 3],
        V,
    )
    _raises(
        ValueError,
        "KeyedTensor: values has shape (12,) but the keys need 12 entries along dim 1",
        KeyedTensor,
        ["a"],
        [12],
        jnp.arange(12.0),
    )
    _raises(
        ValueError,
        "KeyedTensor: offset_per_key=[0, 3, 6] but the lengths give [0, 2, 6]",
        KeyedTensor,
        ["a", "b"],
        [2, 4],
        V,
        offset_per_key=[0, 3, 6],
    )
    _raises(
        ValueError,
        "KeyedTensor: index_per_key={'a': 1, 'b': 0} but the keys give {'a': 0, 'b': 1}",
        KeyedTensor,
        ["a", "b"],
        [2, 4],
        V,
        index_per_key={"a": 1, "b": 0},
    )
    kt = KeyedTensor(
        ["a", "b"], [2, 4], V, offset_per_key=[0, 2, 6], index_per_key={"a": 0, "b": 1}
    )
    assert kt.offset_per_key() == [0, 2, 6] and all(type(x) is int for x in kt.offset_per_key())
    _raises(
        KeyError,
        "\"feature 'z' is not in this KeyedTensor (keys: ['a', 'b'])\"",
        kt.__getitem__,
        "z",
    )
    np.testing.assert_array_equal(kt["b"], V[:, 2:])


def test_from_tensor_list_key_dim_and_refusals():
    a, b = jnp.ones((3, 2)), jnp.zeros((4, 2))
    kt = KeyedTensor.from_tensor_list(["a", "b"], [a, b], key_dim=0, cat_dim=0)
    assert kt.key_dim() == 0 and kt.length_per_key() == [3, 4] and kt.values().shape == (7, 2)
    np.testing.assert_array_equal(kt["b"], b)
    _raises(
        ValueError,
        "KeyedTensor.from_tensor_list: 1 keys and 2 tensors; give one tensor per key",
        KeyedTensor.from_tensor_list,
        ["a"],
        [a, b],
    )
    _raises(
        ValueError,
        "KeyedTensor.from_tensor_list: no tensors; build KeyedTensor([], [], values) directly",
        KeyedTensor.from_tensor_list,
        [],
        [],
    )


def test_regroup_refusals_key_dim_and_empty_group():
    x = KeyedTensor(["a", "b"], [2, 4], V)
    y = KeyedTensor(["c"], [1], jnp.ones((2, 1)))
    _raises(
        ValueError,
        "KeyedTensor.regroup: no KeyedTensors; pass at least one",
        KeyedTensor.regroup,
        [],
        [["a"]],
    )
    _raises(
        ValueError,
        "KeyedTensor.regroup: keyed_tensors[1] has key_dim=0 but keyed_tensors[0] has 1",
        KeyedTensor.regroup,
        [x, KeyedTensor(["d"], [2], V, key_dim=0)],
        [["a"]],
    )
    _raises(
        ValueError,
        "KeyedTensor.regroup: key 'a' is in more than one KeyedTensor; a group naming it is ambiguous",
        KeyedTensor.regroup,
        [x, KeyedTensor(["a"], [1], jnp.ones((2, 1)))],
        [["c"]],
    )
    _raises(
        KeyError,
        "\"regroup: feature(s) ['z'] are in none of the KeyedTensors\"",
        KeyedTensor.regroup,
        [x, y],
        [["a"], ["z"]],
    )
    empty, ca, tail = KeyedTensor.regroup([x, y], [[], ["c", "a"], ["b"]])
    assert empty.shape == (2, 0) and empty.dtype == V.dtype
    np.testing.assert_array_equal(ca, np.concatenate([np.ones((2, 1)), V[:, :2]], axis=1))
    np.testing.assert_array_equal(tail, V[:, 2:])
    rows = KeyedTensor(["p", "q"], [1, 2], jnp.arange(6.0).reshape(3, 2), key_dim=0)
    (qp,) = KeyedTensor.regroup([rows], [["q", "p"]])
    np.testing.assert_array_equal(qp, np.arange(6.0).reshape(3, 2)[[1, 2, 0]])
    (e,) = KeyedTensor.regroup([rows], [[]])
    assert e.shape == (0, 2)
    d = KeyedTensor.regroup_as_dict([x, y], [["b"], ["a", "c"]], ["g1", "g2"])
    assert list(d) == ["g1", "g2"] and d["g2"].shape == (2, 3)
    _raises(
        ValueError,
        "KeyedTensor.regroup_as_dict: 2 groups but 1 keys; give one key per group",
        KeyedTensor.regroup_as_dict,
        [x],
        [["a"], ["b"]],
        ["g"],
    )


def test_pytree_device_to_and_repr():
    import jax

    kt = KeyedTensor(["a", "b"], [2, 4], jnp.asarray(V), key_dim=1)
    out = jax.jit(lambda k: k)(kt)  # through jit: flattened and rebuilt
    assert (
        isinstance(out, KeyedTensor) and out.keys() == ["a", "b"] and out.length_per_key() == [2, 4]
    )
    assert out.key_dim() == 1
    np.testing.assert_array_equal(out.values(), V)
    devices = jax.devices()
    assert kt.device() == devices[0]
    moved = kt.to(devices[1], non_blocking=True)
    assert (
        moved.device() == devices[1]
        and moved.keys() == kt.keys()
        and moved.length_per_key() == [2, 4]
    )
    np.testing.assert_array_equal(moved["b"], V[:, 2:])
    spread = jax.device_put(
        kt.values(),
        jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(devices[:2]), ("x",)), jax.sharding.PartitionSpec("x")
        ),
    )
    _raises(
        ValueError,
        "this KeyedTensor's values span 2 devices",
        KeyedTensor(["a", "b"], [2, 4], spread).device,
    )
    assert repr(kt).startswith("KeyedTensor(keys=['a', 'b'], length_per_key=[2, 4], values=[[")
    assert kt.size_in_bytes() == 12 * 4
