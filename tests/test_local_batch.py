"""`split_batch` / `pad_parts` (the per-device split of a global KJT) against plain loops:
device d gets samples [d * B_l, (d + 1) * B_l) of every key, key-major, padded with id 0 and
weight 0 to one ladder rung; lengths per device; the length cap the rung of `_LENGTH_RUNGS`
above the longest bag. Fast and
independent of the sharded programs that consume the split (tests/test_sharding.py)."""

import re

import numpy as np
import pytest

from sparse_jax import KeyedJaggedTensor
from sparse_jax.sharding._local_batch import pad_parts, split_batch

# the length caps, written out: 1, 2, 4, then multiples of 4 to 32, then 4 rungs an octave
_LENGTH_RUNGS = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)


def _random_kjt(rng, num_keys, batch, weighted, longest=6):
    lengths = rng.integers(0, longest, num_keys * batch)
    lengths[rng.random(lengths.size) < 0.3] = 0  # empty bags
    n = int(lengths.sum())
    values = rng.integers(0, 1000, n).astype(np.int32)
    weights = rng.random(n).astype(np.float32) + 0.5 if weighted else None
    return KeyedJaggedTensor(
        [f"k{i}" for i in range(num_keys)], values, lengths=lengths, weights=weights
    )


def _loop_split(kjt, devices):
    """Per device: (ids, weights, lengths) in key-major order, by walking the bags one by one."""
    stride, keys = kjt.stride(), kjt.keys()
    b_local = stride // devices
    lengths = np.asarray(kjt.lengths())
    values = np.asarray(kjt.values())
    w = kjt.weights_or_none()
    weights = np.ones(values.size, np.float32) if w is None else np.asarray(w)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    out = []
    for d in range(devices):
        ids, ws, ls = [], [], []
        for k in range(len(keys)):
            for b in range(d * b_local, (d + 1) * b_local):
                bag = k * stride + b
                ids += list(values[starts[bag] : starts[bag + 1]])
                ws += list(weights[starts[bag] : starts[bag + 1]])
                ls.append(lengths[bag])
        out.append((ids, ws, ls))
    return out


@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("weighted", [False, True])
def test_split_matches_a_loop_over_bags(devices, weighted):
    rng = np.random.default_rng(devices * 10 + weighted)
    ladder = (8, 16, 24, 40, 64, 128, 256, 512, 1024, 2048)
    for case in range(40):
        num_keys, batch = int(rng.integers(1, 4)), devices * int(rng.integers(1, 5))
        kjt = _random_kjt(rng, num_keys, batch, weighted, longest=int(rng.choice([6, 23, 45])))
        min_cap, min_len = int(rng.integers(0, 30)), int(rng.choice([1, 4, 16]))
        parts = split_batch(kjt, devices, ladder, min_capacity=min_cap, min_length_cap=min_len)
        want = _loop_split(kjt, devices)
        need = max([len(ids) for ids, _, _ in want] + [min_cap])
        cap = min(r for r in ladder if r >= need)
        max_len = int(np.max(np.asarray(kjt.lengths()), initial=0))
        rung = min(r for r in _LENGTH_RUNGS if r >= max_len)
        assert parts["values"].shape == parts["weights"].shape == (devices, cap), case
        assert parts["lengths"].shape == (devices, num_keys * (batch // devices)), case
        assert parts["keys"] == tuple(kjt.keys()) and parts["local_batch"] == batch // devices
        assert parts["length_cap"] == max(min_len, rung), (case, max_len)
        assert parts["values"].dtype == np.asarray(kjt.values()).dtype
        assert parts["lengths"].dtype == np.int32 and parts["weights"].dtype == np.float32
        for d, (ids, ws, ls) in enumerate(want):
            np.testing.assert_array_equal(parts["values"][d], ids + [0] * (cap - len(ids)))
            np.testing.assert_array_equal(
                parts["weights"][d], np.array(ws + [0] * (cap - len(ws)), np.float32)
            )
            np.testing.assert_array_equal(parts["lengths"][d], ls)


def test_split_refuses_a_batch_the_devices_do_not_divide_and_a_batch_above_the_ladder():
    kjt = KeyedJaggedTensor(["f"], np.arange(6, dtype=np.int32), lengths=np.array([1, 2, 3]))
    msg = (
        "batch size 3 is not divisible by the 2 devices of the mesh; the batch is split over every "
        "device, so use a multiple of the device count"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        split_batch(kjt, 2)
    with pytest.raises(
        ValueError,
        match=re.escape("local batch: 6 ids exceed the largest capacity 4 of the ladder"),
    ):
        split_batch(kjt, 1, (2, 4))
    parts = split_batch(kjt, 3, (2, 4))  # per device 1, 2 and 3 ids: the rung that holds 3
    assert parts["values"].shape == (3, 4) and parts["length_cap"] == 4


def test_an_empty_batch_splits_into_the_smallest_rung():
    kjt = KeyedJaggedTensor(["f", "g"], np.zeros(0, np.int32), lengths=np.zeros(4, np.int32))
    parts = split_batch(kjt, 2, (8, 16))
    assert parts["values"].shape == (2, 8) and parts["length_cap"] == 1
    assert not parts["lengths"].any() and not parts["weights"].any()


def test_pad_parts_pads_ids_after_the_last_bag_and_only_raises_the_cap():
    kjt = KeyedJaggedTensor(
        ["f"],
        np.array([5, 6, 7], np.int32),
        lengths=np.array([2, 1]),
        weights=np.array([0.5, 1.5, 2.0], np.float32),
    )
    parts = split_batch(kjt, 1, (4, 8))
    padded = pad_parts(parts, 8, 1)
    np.testing.assert_array_equal(padded["values"], [[5, 6, 7, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(padded["weights"], [[0.5, 1.5, 2.0, 0, 0, 0, 0, 0]])
    assert padded["length_cap"] == 2 and pad_parts(parts, 4, 8)["length_cap"] == 8
    np.testing.assert_array_equal(padded["lengths"], parts["lengths"])
    assert parts["values"].shape == (1, 4)  # the input is not modified
    with pytest.raises(ValueError, match=re.escape("capacity 2 is below the batch's 4")):
        pad_parts(parts, 2, 1)


@pytest.mark.parametrize("keys", [["f"], []])
def test_a_zero_sample_batch_splits_into_empty_devices(keys):
    kjt = KeyedJaggedTensor(keys, np.zeros(0, np.int32), lengths=np.zeros(0, np.int32))
    parts = split_batch(kjt, 4, (8, 16))
    assert parts["values"].shape == (4, 8) and parts["lengths"].shape == (4, 0)
    assert parts["local_batch"] == 0 and parts["length_cap"] == 1 and not parts["weights"].any()


@pytest.mark.parametrize("ladder", [(), (0, 8), (8, 8), (16, 8)])
def test_a_ladder_must_be_increasing_sizes_of_at_least_one(ladder):
    from sparse_jax._capacity import capacity_for

    msg = f"a capacity ladder must be a non-empty increasing list of sizes >= 1, got {ladder}"
    with pytest.raises(ValueError, match=re.escape(msg)):
        capacity_for(0, ladder)
