"""Two processes x 2 CPU devices (jax.distributed, gloo on loopback) give the same pooled
output and tables after 3 fused updates as one process with 4 devices."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from hybrid.training._distributed import free_master_port
from tests.sharding_workload import run_workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_workers(tmp_path, workload: str = "plain"):
    """Two worker processes of tests/mp_sharded_worker.py running `workload`: process 0's
    results (an npz)."""
    port, out = free_master_port(), tmp_path / "mp.npz"
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.mp_sharded_worker",
                str(i),
                "2",
                str(port),
                str(out),
                workload,
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0].decode())
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-process workers timed out")
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    return np.load(out)


@pytest.mark.multiprocess
def test_two_processes_match_one(tmp_path):
    got = run_workers(tmp_path)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    want = run_workload(mesh)
    assert set(got.files) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
