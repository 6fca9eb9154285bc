"""One side of `xla_vs_fbgemm` timed alone, in a fresh process: the baseline's baseline.

A figure measured inside the harness is only trusted when the same side, with the same
workload, batch, warm-up and rounds, runs equally fast in a process of its own: nothing of
the other side (thread pools, allocator state, asynchronous work) is there to slow it or
speed it up. `time_alone` runs `python -m benchmarks.alone` with a JSON spec and returns,
per phase ("forward" and one per optimizer), the seconds of each round; `compare` sets
them beside the harness's medians.

    python -m benchmarks.alone '{"side": "fbgemm", "workload": {...}, "phases": ["forward", "sgd"], ...}'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

__all__ = ["TOLERANCE", "compare", "time_alone"]

TOLERANCE = 0.15  # |harness / alone - 1| above this voids the comparison
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build(spec: dict):
    """The side, built exactly as the harness builds it (same batch, same arguments)."""
    from benchmarks.workloads import Workload, make_batch

    w = Workload(**spec["workload"])
    batch = make_batch(w)
    sides = {}
    for phase in spec["phases"]:
        opt = None if phase == "forward" else phase
        if spec["side"] == "fbgemm":
            from benchmarks.fbgemm_side import FbgemmSide

            sides[phase] = FbgemmSide(
                w,
                batch,
                opt or "sgd",
                lr=spec["lr"],
                eps=spec["eps"],
                dtype=spec.get("fbgemm_dtype"),
            )
        else:
            from benchmarks.xla_side import XlaSide

            sides[phase] = XlaSide(w, batch, spec["side"], opt, lr=spec["lr"], eps=spec["eps"])
    return sides


def _child(spec: dict) -> dict:
    import torch

    from benchmarks.timing import clocked, interleaved

    torch.set_num_threads(spec["torch_threads"])
    out = {}
    for phase, side in _build(spec).items():  # one phase at a time, as the harness's blocks
        case = clocked(side.time_forward if phase == "forward" else side.time_step)
        samples = interleaved(
            {"alone": case},
            warmup=spec["warmup"],
            repeats=spec["repeats"],
            budget_s=spec["budget_s"],
            pause_s=spec.get("pause_s", 0.0),
            lead_in_s=spec.get("lead_in_s", 0.0),
        )
        out[phase] = samples["alone"]["total"]
        del side
    return out


def time_alone(spec: dict, timeout_s: float = 1800) -> dict[str, list[float]]:
    """Per phase, the seconds of each round of `spec["side"]` in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.alone", json.dumps(spec)],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"timing {spec['side']} alone failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(harness: list[float], alone: list[float], tolerance: float = TOLERANCE) -> dict:
    """The harness's median beside the median alone; `agrees` when within `tolerance`."""
    h, a = float(np.median(harness)), float(np.median(alone))
    return {
        "harness_ms": h * 1e3,
        "alone_ms": a * 1e3,
        "harness_over_alone": h / a,
        "agrees": abs(h / a - 1.0) <= tolerance,
    }


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
