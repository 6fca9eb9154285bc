"""Managed-collision tables across two processes x 2 CPU devices (jax.distributed, gloo on
loopback), each process preparing only its own samples: the same slots, rows, id maps and
counters as one process with the same 4 devices."""

import jax
import numpy as np
import pytest

from tests.managed_workload import run_managed_workload
from tests.test_sharding_multiprocess import run_workers


@pytest.mark.multiprocess
@pytest.mark.parametrize("rows", [32, 31], ids=["even", "uneven"])
def test_two_processes_train_managed_tables_as_one(tmp_path, monkeypatch, rows):
    """31 rows over the 2 shards of the model axis: blocks of 16 and 15, maps of two sizes."""
    monkeypatch.setenv("HYBRIDREC_TEST_MANAGED_ROWS", str(rows))
    got = run_workers(tmp_path, "managed")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    want = run_managed_workload(mesh)
    assert set(got.files) == set(want)
    assert bool(got["sequence_refused"]) and not bool(want.pop("sequence_refused"))
    # a map per shard (stacked to the larger block), over the table's rows
    assert want["mc/sorted_hi"].shape == (2, 16) and want["weight/users"].shape[0] == rows
    assert want["stats"][2] > 0  # ids were evicted and fresh rows drawn across the processes
    for key, value in want.items():
        if key.startswith(("mc/", "stats")):
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        else:
            np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
