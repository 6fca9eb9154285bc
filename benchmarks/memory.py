"""Peak resident memory of each side, each measured in its own fresh process.

`python -m benchmarks.memory '<json spec>'` builds one side for one workload, runs a few
forward + backward + update steps and prints one JSON line:

* `rss_base`: RSS after imports and the workload's numpy batch, before the side exists;
* `rss_ready`: RSS once the side's tables, optimizer state and (ours) compiled programs exist;
* `peak_steps`: the peak RSS over the steps (the high-water mark is reset before them
  through /proc/self/clear_refs, so setup transients do not count);
* `peak_setup`: the high-water mark while building the side (tables, state, compiles);
* `ru_maxrss` is recorded but not used: Linux carries it over fork + exec from the parent
  (the benchmark process), so a child's figure is at least the parent's RSS;
* `minor_faults_per_step`: page faults per step (fresh temp buffers are paged in again).

`step_overhead = peak_steps - rss_ready` is what a training step holds on top of the
model: a second copy of the table would show up there as ~table size.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

__all__ = ["measure_side", "measure_all"]

KIB = 1024


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * KIB
    return out


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(spec: dict) -> dict:
    side_name, optimizer, steps = spec["side"], spec["optimizer"], int(spec.get("steps", 3))
    if side_name == "fbgemm":
        import torch

        torch.set_num_threads(int(spec.get("torch_threads", 2)))
    from benchmarks.workloads import Workload, make_batch

    if side_name == "fbgemm":  # libraries first: the baseline includes them
        from benchmarks.fbgemm_side import FbgemmSide
    else:
        from benchmarks.xla_side import XlaSide
    w = Workload(**spec["workload"])
    batch = make_batch(w)
    table_bytes_np = batch.tables.nbytes
    rss_base = _status()["VmRSS"]
    if side_name == "fbgemm":
        side = FbgemmSide(
            w, batch, optimizer, lr=spec["lr"], eps=spec["eps"], dtype=spec.get("fbgemm_dtype")
        )
    else:
        side = XlaSide(w, batch, side_name, optimizer, lr=spec["lr"], eps=spec["eps"])
    side.step()  # compiles (ours); first touch of everything
    time.sleep(
        0.5
    )  # XLA releases a call's temp buffers asynchronously, after the outputs are ready
    st = _status()
    rss_ready, peak_setup = st["VmRSS"], st["VmHWM"]
    reset = _reset_peak()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        side.step()
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    st = _status()
    out = {
        "side": side_name,
        "optimizer": optimizer,
        "rss_base": rss_base,
        "rss_ready": rss_ready,
        "peak_steps": st["VmHWM"] if reset else None,
        "rss_after": st["VmRSS"],
        "peak_setup": peak_setup,
        "ru_maxrss_inherited": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB,
        "minor_faults_per_step": (f1 - f0) / steps,
        "table_bytes": side.table_bytes(),
        "numpy_batch_table_bytes": table_bytes_np,
        "steps": steps,
    }
    if side_name != "fbgemm":
        out["state_bytes"] = side.state_bytes()
        out["update_in_place"] = bool(side.in_place) and all(side.in_place)
        out["xla_update_memory"] = side.update_memory()
    if out["peak_steps"] is not None:
        out["step_overhead"] = out["peak_steps"] - rss_ready
    return out


def measure_side(spec: dict, timeout_s: float = 600) -> dict:
    """Run `_worker` in a fresh interpreter (same venv, repo root on the path)."""
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=root,
    )
    if proc.returncode != 0:
        return {
            "side": spec["side"],
            "error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"],
        }
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_all(
    workload: dict,
    sides: list[str],
    optimizer: str,
    *,
    lr: float,
    eps: float,
    fbgemm_dtype: str | None,
) -> dict[str, dict]:
    out = {}
    for side in sides:
        spec = {
            "side": side,
            "optimizer": optimizer,
            "workload": workload,
            "lr": lr,
            "eps": eps,
            "fbgemm_dtype": fbgemm_dtype,
        }
        out[side] = measure_side(spec)
    return out


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
