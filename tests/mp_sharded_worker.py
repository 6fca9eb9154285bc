"""One process of the multi-controller sharding test (run by tests/test_sharding_multiprocess.py).

argv: process_id num_processes port out.npz. Each process sees 2 CPU devices; the mesh
spans every process's devices; every process feeds the same global batch.
"""

import sys

import jax
import numpy as np

PID, NPROC, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=NPROC, process_id=PID)

from tests.sharding_workload import run_workload  # noqa: E402

mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(NPROC, -1), ("data", "model"))
result = run_workload(mesh)
if PID == 0:
    np.savez(OUT, **result)
jax.distributed.shutdown()
