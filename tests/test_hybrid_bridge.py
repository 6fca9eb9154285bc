"""The DLPack bridge: zero-copy proven by pointers, counted copies, ids never truncated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hybrid
from sparse_jax import KeyedJaggedTensor


@pytest.fixture
def stats():
    s = hybrid.bridge_stats()
    s.reset()
    return s


def _single(x):
    return jax.device_put(x, jax.devices()[0])


# ------------------------------------------------------------------ zero-copy, both ways


def test_jax_to_torch_single_device_is_zero_copy(stats):
    x = _single(jnp.arange(24, dtype=jnp.float32).reshape(6, 4))
    t = hybrid.jax_to_torch(x)
    assert t.data_ptr() == x.unsafe_buffer_pointer()
    assert t.dtype == torch.float32 and tuple(t.shape) == (6, 4)
    np.testing.assert_array_equal(t.numpy(), np.asarray(x))
    assert stats.zero_copy == 1 and stats.total_copies == 0


def test_torch_to_jax_is_zero_copy(stats):
    t = torch.randn(8, 16)
    x = hybrid.torch_to_jax(t)
    assert x.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(x), t.numpy())
    assert stats.zero_copy == 1 and stats.total_copies == 0


def test_requires_grad_tensor_is_detached_without_copy(stats):
    t = torch.randn(4, 3, requires_grad=True)
    x = hybrid.torch_to_jax(t)
    assert x.unsafe_buffer_pointer() == t.data_ptr()
    assert stats.total_copies == 0


def test_bf16_crosses_both_ways():
    t = torch.randn(4, 8).to(torch.bfloat16)
    x = hybrid.torch_to_jax(t)
    assert x.dtype == jnp.bfloat16 and x.unsafe_buffer_pointer() == t.data_ptr()
    back = hybrid.jax_to_torch(x)
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)


# ------------------------------------------------------------------ counted copies


def test_non_contiguous_tensor_is_made_contiguous_once(stats):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    x = hybrid.torch_to_jax(t)
    np.testing.assert_array_equal(np.asarray(x), t.numpy())
    assert x.unsafe_buffer_pointer() != t.data_ptr()
    assert dict(stats.copies) == {"non_contiguous": 1}


def test_misaligned_tensor_is_copied_and_counted(stats):
    base = torch.arange(20, dtype=torch.float32)
    t = base[1:13]  # contiguous, but 4 bytes past a 64-byte boundary
    assert t.is_contiguous() and t.data_ptr() % 64
    x = hybrid.torch_to_jax(t)
    np.testing.assert_array_equal(np.asarray(x), t.numpy())
    assert x.unsafe_buffer_pointer() % 64 == 0
    assert dict(stats.copies) == {"unaligned": 1}


def test_batch_sharded_array_is_joined_with_exactly_one_copy(stats):
    mesh = hybrid.make_mesh("data=8")
    host = np.arange(16 * 5, dtype=np.float32).reshape(16, 5)
    x = jax.device_put(host, NamedSharding(mesh, P("data")))
    assert len(x.addressable_shards) == 8
    t = hybrid.jax_to_torch(x)
    np.testing.assert_array_equal(t.numpy(), host)
    assert dict(stats.copies) == {"joined_shards": 1} and stats.zero_copy == 0
    assert all(t.data_ptr() != s.data.unsafe_buffer_pointer() for s in x.addressable_shards)


def test_2d_mesh_joins_distinct_shards_only(stats):
    mesh = hybrid.make_mesh({"data": 2, "model": 4})
    host = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    x = jax.device_put(host, NamedSharding(mesh, P("data", "model")))
    np.testing.assert_array_equal(hybrid.jax_to_torch(x).numpy(), host)
    y = jax.device_put(host, NamedSharding(mesh, P("data")))  # replicated over "model"
    np.testing.assert_array_equal(hybrid.jax_to_torch(y).numpy(), host)
    assert dict(stats.copies) == {"joined_shards": 2}


def test_replicated_array_crosses_zero_copy(stats):
    mesh = hybrid.make_mesh("data=8")
    x = jax.device_put(np.ones((4, 3), np.float32), NamedSharding(mesh, P()))
    t = hybrid.jax_to_torch(x)
    assert t.data_ptr() in {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    assert stats.total_copies == 0


def test_torch_to_jax_onto_a_batch_sharding():
    mesh = hybrid.make_mesh("data=8")
    sharding = NamedSharding(mesh, P("data"))
    t = torch.randn(16, 4)
    x = hybrid.torch_to_jax(t, sharding=sharding)
    assert x.sharding == sharding
    np.testing.assert_array_equal(np.asarray(x), t.numpy())


# ------------------------------------------------------------------ ids


def test_int32_range_int64_ids_convert_exactly(stats):
    ids = torch.tensor([0, 1, 2**31 - 1, -(2**31), 7], dtype=torch.int64)
    x = hybrid.torch_ids_to_jax(ids)
    assert x.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(x), ids.numpy())
    assert dict(stats.copies) == {"ids_to_int32": 1}


def test_int32_ids_cross_zero_copy():
    ids = torch.arange(10, dtype=torch.int32)
    assert hybrid.torch_ids_to_jax(ids).unsafe_buffer_pointer() == ids.data_ptr()


@pytest.mark.parametrize("bad", [2**31, 2**40 + 3, -(2**31) - 1])
def test_ids_outside_int32_raise_naming_the_id(bad):
    with pytest.raises(ValueError, match=rf"id {bad} at index 2 does not fit in int32"):
        hybrid.torch_ids_to_jax(torch.tensor([1, 2, bad, 4]))


def test_float_ids_are_rejected():
    with pytest.raises(ValueError, match="integer tensor"):
        hybrid.torch_ids_to_jax(torch.tensor([1.0, 2.0]))


def test_torch_kjt_names_the_feature_of_an_id_above_2_31():
    lengths = torch.tensor([1, 2, 2, 1])  # keys a, b; batch 2
    values = torch.tensor([3, 4, 5, 6, 3_000_000_000, 8])
    with pytest.raises(
        ValueError, match=r"id 3000000000 at feature 'b', batch position 0, index 1"
    ):
        hybrid.torch_kjt(["a", "b"], values, lengths)


def test_torch_kjt_matches_a_padded_jax_kjt():
    values = torch.tensor([3, 4, 5, 2**31 - 1, 0, 8])
    lengths = torch.tensor([1, 2, 2, 1])
    weights = torch.rand(6, dtype=torch.float64)
    kjt = hybrid.torch_kjt(["a", "b"], values, lengths, weights)
    ref = KeyedJaggedTensor(
        ["a", "b"],
        values.numpy(),
        weights=weights.numpy().astype(np.float32),
        lengths=lengths.numpy(),
    )
    ref = ref.pad()
    assert kjt.keys() == ["a", "b"] and kjt.stride() == 2
    assert kjt.capacity() == ref.capacity() and kjt.length_caps() == ref.length_caps() == (2, 2)
    assert jax.tree_util.tree_structure(kjt) == jax.tree_util.tree_structure(ref)
    for got, want in zip(
        jax.tree_util.tree_leaves(kjt), jax.tree_util.tree_leaves(ref), strict=True
    ):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_torch_kjt_never_aliases_the_callers_tensors():
    values, lengths = (
        torch.tensor([1, 2, 3], dtype=torch.int32),
        torch.tensor([2, 1], dtype=torch.int32),
    )
    kjt = hybrid.torch_kjt(["a"], values, lengths)
    values.zero_()
    lengths.zero_()
    np.testing.assert_array_equal(np.asarray(kjt.values())[:3], [1, 2, 3])
    np.testing.assert_array_equal(np.asarray(kjt.lengths()), [2, 1])


@pytest.mark.parametrize(
    ("keys", "values", "lengths", "weights", "message"),
    [
        (
            ["a", "b"],
            [1, 2],
            [1, -1, 2, 0],
            None,
            "length -1 at feature 'a', batch position 1 is negative",
        ),
        (["a"], [1, 2], [1, 2], None, "lengths sum to 3"),
        (["a"], [1, 2], [1, 1], [0.5], "one floating-point weight per id"),
        (["a", "a"], [1, 2], [1, 1], None, "key 'a' appears twice"),
        (["a", "b"], [1, 2], [1, 1, 0], None, "num_keys \\* batch_size"),
    ],
)
def test_torch_kjt_errors(keys, values, lengths, weights, message):
    w = None if weights is None else torch.tensor(weights)
    with pytest.raises(ValueError, match=message):
        hybrid.torch_kjt(keys, torch.tensor(values), torch.tensor(lengths), w)


def test_as_kjt_reads_every_documented_form():
    values, lengths = torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 2, 0])
    forms = [
        (["a", "b"], values, lengths),
        {"a": (values[:2], lengths[:2]), "b": (values[2:], lengths[2:])},
        hybrid.torch_kjt(["a", "b"], values, lengths),
        KeyedJaggedTensor(["a", "b"], values.numpy(), lengths=lengths.numpy()),
    ]
    for form in forms:
        kjt = hybrid.as_kjt(form, ladder=[8, 16])
        assert kjt.keys() == ["a", "b"] and kjt.capacity() == 8 and kjt.length_caps() == (1, 2)
        np.testing.assert_array_equal(np.asarray(kjt.values()), [1, 2, 3, 4, 0, 0, 0, 0])
        np.testing.assert_array_equal(np.asarray(kjt.lengths()), lengths.numpy())
    floors = hybrid.as_kjt(forms[0], ladder=[8], length_caps={"a": 4})
    assert floors.length_caps() == (4, 2)
    with pytest.raises(TypeError, match="bare array"):
        hybrid.as_kjt(values)
    with pytest.raises(ValueError, match="different batch sizes"):
        hybrid.as_kjt({"a": (values[:2], lengths[:2]), "b": (values[2:], lengths[2:3])})


# ------------------------------------------------------------------ mesh, GPU env, process env


def test_make_mesh_from_string_and_dict():
    mesh = hybrid.make_mesh("data=2,model=4")
    assert dict(mesh.shape) == {"data": 2, "model": 4} and mesh.devices.size == 8
    assert dict(hybrid.make_mesh({"data": 8}).shape) == {"data": 8}
    assert hybrid.parse_mesh(" data = 2 , model=4") == {"data": 2, "model": 4}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("data=2,model=2", "needs 4 devices but there are 8"),
        ("data=3", "needs 3 devices but there are 8"),
        ("data=2,model", "entry 'model' is not name=size"),
        ("data=two", "size 'two', not an integer$"),
        ("data=2;model=4", "not an integer; separate axes with ',', not ';'"),
        ("data=2,data=4", "named twice"),
        ({"data": 0}, "integer size >= 1"),
    ],
)
def test_make_mesh_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        hybrid.make_mesh(spec)


def test_configure_gpu_env_sets_only_what_is_missing():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    changed = hybrid.configure_gpu_env(env, ftz_atomics=True)
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=8",
        "--xla_backend_extra_options=-nvptx-allow-ftz-atomics",
    ]
    assert set(changed) == {"XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS"}
    assert hybrid.configure_gpu_env(env, ftz_atomics=True) == {}  # idempotent
    env2 = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    assert hybrid.configure_gpu_env(env2, ftz_atomics=False) == {}
    assert hybrid.configure_gpu_env({}, memory_fraction=0.5, ftz_atomics=False) == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"
    }


def test_configure_gpu_env_after_backends_started_raises():
    jax.devices()
    with pytest.raises(RuntimeError, match="before the first JAX operation"):
        hybrid.configure_gpu_env()


TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_read_torchrun_env():
    env = hybrid.read_torchrun_env(TORCHRUN)
    assert (env.rank, env.world_size, env.local_rank) == (1, 2, 1)
    assert env.coordinator_address == "127.0.0.1:29501"
    assert hybrid.read_torchrun_env({}) is None
    assert hybrid.read_torchrun_env({"WORLD_SIZE": "1"}) is None
    assert hybrid.init_distributed({"WORLD_SIZE": "1"}) is None  # single process: no-op


def test_a_free_master_port_lies_below_the_ephemeral_range(tmp_path, monkeypatch):
    """Ports from `bind(0)` are ephemeral: a connection opened before the job binds them (the
    store's, gloo's) may take the one after (jax.distributed's coordinator). The port and
    the one after it are drawn below the kernel's ephemeral range, and both bind."""
    import socket

    from hybrid.training import _distributed

    start = _distributed._ephemeral_start()
    for _ in range(20):
        port = _distributed.free_master_port()
        assert 20000 <= port and port + 1 < start, (port, start)
        for p in (port, port + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
    held = tmp_path / "range"
    held.write_text("40000\t60999\n")
    assert _distributed._ephemeral_start(str(held)) == 40000
    assert _distributed._ephemeral_start(str(tmp_path / "none")) == 32768
    # a range starting too low for a draw below it: the kernel's ports, as before
    monkeypatch.setattr(_distributed, "_ephemeral_start", lambda: 20001)
    port = _distributed.free_master_port()
    assert port >= 1024


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"MASTER_PORT": None}, "MASTER_PORT not set"),
        ({"RANK": "2"}, r"RANK=2 must be in \[0, WORLD_SIZE=2\)"),
        ({"RANK": "x"}, "RANK='x' must be an integer"),
        ({"MASTER_PORT": "65535"}, "MASTER_PORT must be"),
    ],
)
def test_read_torchrun_env_errors(change, message):
    env = {k: v for k, v in {**TORCHRUN, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        hybrid.read_torchrun_env(env)
