"""The DLPack bridge's bookkeeping and edges (test_hybrid_bridge.py has the zero-copy
crossings themselves): counters that accumulate, the join of a process's shards at an
offset, placement onto a named device, conj/neg views, x64 ids, refusals in full."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import hybrid
from hybrid.model import _bridge


@pytest.fixture
def stats():
    s = hybrid.bridge_stats()
    s.reset()
    yield s
    s.reset()


def test_every_counter_accumulates(stats):
    x = jnp.arange(6, dtype=jnp.float32)
    hybrid.jax_to_torch(x)
    hybrid.jax_to_torch(x)
    hybrid.torch_to_jax(torch.ones(4))
    assert stats.zero_copy == 3
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for _ in range(2):
        hybrid.torch_to_jax(base.t())  # non-contiguous
        hybrid.torch_to_jax(torch.ones(64)[1:17])  # 4 bytes past an aligned start
        hybrid.torch_to_jax(
            torch.ones(8), sharding=NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))
        )
        hybrid.torch_ids_to_jax(torch.tensor([1, 2], dtype=torch.int32), capacity=4)
        hybrid.torch_ids_to_jax(torch.tensor([1, 2], dtype=torch.int64))
        hybrid.jax_to_torch(
            jax.device_put(jnp.zeros(8), NamedSharding(jax.make_mesh((8,), ("d",)), P("d")))
        )
    assert dict(stats.copies) == {
        "non_contiguous": 2,
        "unaligned": 2,
        "to_sharding": 2,
        "padded_ids": 2,
        "ids_to_int32": 2,
        "joined_shards": 2,
    }
    # the compacted / realigned copies then cross zero-copy: 3 + 2 * 2
    assert stats.total_copies == 12 and stats.zero_copy == 7


def test_join_places_each_part_relative_to_the_block_origin():
    """A process's shards sit at an offset in the global array (rows 4..8 of 12 here): the
    joined tensor starts at the smallest start, whatever the parts' order."""
    whole = torch.arange(12 * 6, dtype=torch.int32).reshape(12, 6)
    boxes = [((6, 8), (3, 6)), ((4, 6), (0, 3)), ((4, 6), (3, 6)), ((6, 8), (0, 3))]
    parts = [(b, whole[b[0][0] : b[0][1], b[1][0] : b[1][1]].clone()) for b in boxes]
    out = _bridge._join(parts, (12, 6), "S")
    assert out.dtype == torch.int32 and out.shape == (4, 6)
    assert torch.equal(out, whole[4:8])


def test_join_refuses_parts_that_do_not_tile_one_block():
    part = torch.zeros(2, 3)
    msg = (
        "jax_to_torch: the local shards of this (12, 6) array (sharding S) do not tile one block "
        "(they span [(0, 4), (0, 6)]); shard the batch dimension so each process holds one contiguous block"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        _bridge._join([(((0, 2), (0, 3)), part), (((2, 4), (3, 6)), part)], (12, 6), "S")


def test_joined_int_and_bf16_arrays_keep_their_dtype(stats):
    mesh = jax.make_mesh((8,), ("d",))
    for dtype, tdtype in ((jnp.int32, torch.int32), (jnp.bfloat16, torch.bfloat16)):
        x = jax.device_put(jnp.arange(16).astype(dtype), NamedSharding(mesh, P("d")))
        t = hybrid.jax_to_torch(x)
        assert t.dtype == tdtype and torch.equal(t.float(), torch.arange(16, dtype=torch.float32))


def test_torch_to_jax_onto_another_single_device_moves_it(stats):
    target = SingleDeviceSharding(jax.devices()[1])
    out = hybrid.torch_to_jax(torch.arange(4.0), sharding=target)
    assert out.sharding == target and out.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert dict(stats.copies) == {"to_sharding": 1}
    here = hybrid.torch_to_jax(torch.arange(4.0), sharding=SingleDeviceSharding(jax.devices()[0]))
    assert here.sharding.device_set == {jax.devices()[0]} and stats.zero_copy == 1


def test_conjugate_and_negative_views_cross_with_their_values():
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    np.testing.assert_array_equal(np.asarray(hybrid.torch_to_jax(c.conj())), np.conj(c.numpy()))
    neg = torch._neg_view(torch.tensor([1.0, -2.0]))  # what conj() of a real view can leave
    assert neg.is_neg()
    assert hybrid.torch_to_jax(neg).tolist() == [-1.0, 2.0]


def test_ids_with_x64_on_cross_as_int64_unchecked():
    with jax.enable_x64(True):
        big = torch.tensor([2**40, -(2**35), 7], dtype=torch.int64)
        out = hybrid.torch_ids_to_jax(big)
        assert out.dtype == jnp.int64 and out.tolist() == big.tolist()


def test_capacity_equal_to_the_ids_is_enough():
    out = hybrid.torch_ids_to_jax(torch.tensor([4, 5, 6]), capacity=3)
    assert out.dtype == jnp.int32 and out.tolist() == [4, 5, 6]
    padded = hybrid.torch_ids_to_jax(torch.tensor([4, 5, 6], dtype=torch.int32), capacity=5)
    assert padded.tolist() == [4, 5, 6, 0, 0]


def test_refusals_in_full():
    cases = [
        (
            lambda: hybrid.jax_to_torch(np.zeros(2)),
            TypeError,
            "jax_to_torch expects a jax.Array, got ndarray",
        ),
        (
            lambda: hybrid.torch_to_jax([1]),
            TypeError,
            "torch_to_jax expects a torch.Tensor, got list",
        ),
        (
            lambda: hybrid.torch_ids_to_jax(np.zeros(2)),
            TypeError,
            "ids: expected a torch.Tensor of integer ids, got ndarray",
        ),
        (
            lambda: hybrid.torch_ids_to_jax(torch.tensor([True])),
            ValueError,
            "ids: ids must be an integer tensor, got dtype torch.bool; convert with .long() (or hash strings to "
            "integers) first",
        ),
        (
            lambda: hybrid.torch_ids_to_jax(torch.zeros(2, 2, dtype=torch.int32)),
            ValueError,
            "ids: ids must be 1-D, got shape (2, 2)",
        ),
        (
            lambda: hybrid.torch_ids_to_jax(torch.tensor([1, 2, 3]), capacity=2),
            ValueError,
            "ids: capacity 2 is below the 3 ids",
        ),
        (
            lambda: hybrid.torch_ids_to_jax(torch.tensor([1, 2**31])),
            ValueError,
            "ids: id 2147483648 at index 1 does not fit in int32 and jax x64 is off (1 such ids); hash or remap ids "
            "into the table's range (e.g. ids % num_embeddings) before the batch reaches the model, or enable "
            "jax.config.update('jax_enable_x64', True)",
        ),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=f"^{re.escape(message)}$"):
            call()


def test_two_device_arrays_replicated_cross_zero_copy_and_sharded_are_joined(stats):
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    sharded = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("d")))
    replicated = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P()))
    for x in (sharded, replicated, replicated):
        assert hybrid.jax_to_torch(x).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert dict(stats.copies) == {"joined_shards": 1} and stats.zero_copy == 2
