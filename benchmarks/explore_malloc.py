"""Issue 9: does the allocator policy cost our step? (page faults on XLA temp buffers)

Every call of our forward / update maps its XLA temp buffers afresh and unmaps them after
(strace of a W1 step: `mmap(NULL, 197230592)` + `munmap` for the update's temps,
`mmap(NULL, 136318976)` for the forward's), so each call page-faults its temps in again:
~48k minor faults per W1 update, ~33k per forward; FBGEMM's step takes ~25. This runs the
same program in worker processes that differ only in the environment glibc reads at
start-up, driven round-robin (interleaved), and counts faults per call:

  default          glibc defaults
  no_mmap          MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<huge>: malloc'ed big buffers come
                   from the heap and freed memory stays mapped (checked: this removes the
                   faults of a numpy 100 MB alloc/free loop)

Result (see NOTES.md): no effect; the fault counts are identical (the mmap calls stay under
MALLOC_MMAP_MAX_=0). Later (issue 31, 2026-11-27) glibc's `glibc.malloc.hugetlb=1` tunable
did cut them: the W1 rowwise update's 17,378 faults a call fell to 515 and its time to 0.64x,
with transparent huge pages in "madvise" mode; `hybrid._cpu_env` applies it.

    python -m benchmarks.explore_malloc [--tiny] [--alpha 1.15] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

from benchmarks import report

__all__ = ["ENVS", "main"]

ENVS = {
    "default": {},
    "no_mmap": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
}


def _worker(spec: dict) -> None:
    from benchmarks.workloads import Workload, make_batch
    from benchmarks.xla_side import XlaSide

    w = Workload(**spec["workload"])
    side = XlaSide(w, make_batch(w), "xla", spec["optimizer"], lr=0.01, eps=1e-8)
    side.step()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        if cmd == "fwd":
            side.forward().block_until_ready()
        else:
            side.run_update()
        dt = time.perf_counter() - t0
        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        print(json.dumps({"t": dt, "faults": f1 - f0}), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.explore_malloc",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--optimizer", default="rowwise_adagrad", choices=("rowwise_adagrad", "sgd"))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    report.add_output_args(p, "explore_malloc")
    args = p.parse_args(argv)
    args.out = report.output_dir(p, args, "explore_malloc")
    from benchmarks.timing import paired_ratio, summarize
    from benchmarks.workloads import Workload

    base = dict(T=2, E=1000, D=16, B=64, L=4) if args.tiny else {}
    w = Workload(**base, alpha=args.alpha)
    spec = {
        "workload": {k: v for k, v in w.as_dict().items() if k != "name"},
        "optimizer": args.optimizer,
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = {}
    for name, extra in ENVS.items():
        env = {**os.environ, **extra, "PYTHONPATH": root}
        env.setdefault("JAX_PLATFORMS", "cpu")
        procs[name] = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import json,sys; from benchmarks.explore_malloc import _worker; "
                "_worker(json.loads(sys.argv[1]))",
                json.dumps(spec),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,
        )
    for name, pr in procs.items():
        line = pr.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"worker {name} failed to start: {line!r}")

    def ask(name, cmd):
        procs[name].stdin.write(cmd + "\n")
        procs[name].stdin.flush()
        return json.loads(procs[name].stdout.readline())

    samples = {(n, c): {"t": [], "faults": []} for n in procs for c in ("fwd", "update")}
    names = list(procs)
    try:
        for r in range(args.warmup + args.repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            for cmd in ("fwd", "update"):
                for n in order:
                    out = ask(n, cmd)
                    if r >= args.warmup:
                        samples[(n, cmd)]["t"].append(out["t"])
                        samples[(n, cmd)]["faults"].append(out["faults"])
    finally:
        for pr in procs.values():
            try:
                pr.stdin.write("quit\n")
                pr.stdin.flush()
            except OSError:
                pass
            pr.wait(timeout=60)
    res = {"workload": w.name, "optimizer": args.optimizer, "envs": ENVS, "results": {}}
    lines = [
        f"# explore_malloc: {w.name}, {args.optimizer} (interleaved worker processes)",
        "",
        "| phase | env | median ms [IQR] | vs default (ratio of medians; paired) | minor faults / call |",
        "|---|---|---|---|---|",
    ]
    for cmd in ("fwd", "update"):
        for n in names:
            s = samples[(n, cmd)]
            summ = summarize(s["t"])
            ratio = paired_ratio(s["t"], samples[("default", cmd)]["t"])
            faults = float(np.median(s["faults"]))
            res["results"][f"{cmd}/{n}"] = {
                **summ,
                "vs_default": ratio,
                "minor_faults_median": faults,
            }
            lines.append(
                f"| {cmd} | {n} | {summ['median_ms']:.2f} [{summ['p25_ms']:.2f}-{summ['p75_ms']:.2f}] | "
                f"{ratio['ratio_of_medians']:.2f} ({ratio['paired_median']:.2f}) | {faults:.0f} |"
            )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "explore_malloc.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "explore_malloc.md"), "w") as f:
        f.write(md)
    print(md)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
