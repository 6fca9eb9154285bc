"""Two processes on loopback: init_distributed gives torch (gloo) and jax one job."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from hybrid.training._distributed import free_master_port

ROOT = pathlib.Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent(
    """
    import numpy as np, torch, torch.distributed as dist, jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import hybrid

    env = hybrid.init_distributed()
    assert env is not None and dist.is_initialized() and dist.get_backend() == "gloo"
    t = torch.tensor([env.rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0, t
    assert (jax.process_count(), jax.process_index()) == (2, env.rank)
    assert (jax.device_count(), jax.local_device_count()) == (2, 1)

    mesh = hybrid.make_mesh("data=2")
    local = np.full((3, 4), env.rank + 1, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
    assert x.shape == (6, 4)
    total = jax.jit(lambda a: a.sum())(x)  # a cross-process reduction (gloo)
    assert float(total.addressable_data(0)) == 12 * 1 + 12 * 2, total
    block = hybrid.jax_to_torch(x)  # this process's block, zero-copy
    assert torch.equal(block, torch.from_numpy(local))
    assert block.data_ptr() == x.addressable_shards[0].data.unsafe_buffer_pointer()
    jax.distributed.shutdown()
    dist.destroy_process_group()
    print("ok", env.rank)
    """
)


@pytest.mark.multiprocess
def test_two_processes_on_loopback():
    port = free_master_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": str(ROOT),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"
        assert f"ok {rank}" in out
