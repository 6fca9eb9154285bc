"""Managed-collision tables across two processes x 2 CPU devices (jax.distributed, gloo on
loopback), each process preparing only its own samples: the same slots, rows, id maps and
counters as one process with the same 4 devices."""

import jax
import numpy as np
import pytest

from tests.managed_workload import run_managed_workload
from tests.test_sharding_multiprocess import run_workers


@pytest.mark.multiprocess
def test_two_processes_train_managed_tables_as_one(tmp_path):
    got = run_workers(tmp_path, "managed")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    want = run_managed_workload(mesh)
    assert set(got.files) == set(want)
    assert bool(got["sequence_refused"]) and not bool(want.pop("sequence_refused"))
    assert want["stats"][2] > 0  # ids were evicted and fresh rows drawn across the processes
    for key, value in want.items():
        if key.startswith(("mc/", "stats")):
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        else:
            np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
