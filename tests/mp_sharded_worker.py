"""One process of a multi-controller sharding test (run by tests/test_sharding_multiprocess.py
and tests/test_managed_multiprocess.py).

argv: process_id num_processes port out.npz [workload]. Each process sees 2 CPU devices;
the mesh spans every process's devices. Workloads: "plain" (tests/sharding_workload.py,
the default: every process feeds the same global batch) and "managed"
(tests/managed_workload.py: each process feeds its own samples).
"""

import sys

import jax
import numpy as np

PID, NPROC, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
WORKLOAD = sys.argv[5] if len(sys.argv) > 5 else "plain"
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=NPROC, process_id=PID)

if WORKLOAD == "managed":
    from tests.managed_workload import run_managed_workload as run  # noqa: E402
else:
    from tests.sharding_workload import run_workload as run  # noqa: E402

mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(NPROC, -1), ("data", "model"))
result = run(mesh)
if PID == 0:
    np.savez(OUT, **result)
jax.distributed.shutdown()
