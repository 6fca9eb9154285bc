"""hybridrec (JAX) vs FBGEMM's CPU table-batched embedding: forward, and forward +
backward + fused update (EXACT_ROWWISE_ADAGRAD, EXACT_ADAGRAD, EXACT_SGD), same tables / ids
/ offsets / weights on both sides. Ours runs two ways, both timed: the library default
(kernel="auto": the fused C++ kernels through jax.ffi when built, else XLA) and
kernel="xla" (the path a GPU runs); kernel="reference" is gated, and timed with --reference.

    python -m benchmarks.xla_vs_fbgemm                 # default set: W1 uniform, W1 Zipf(1.15)
    python -m benchmarks.xla_vs_fbgemm --tiny          # smoke run (seconds)
    python -m benchmarks.xla_vs_fbgemm --T 32 --D 128 --B 512 --alpha 1.0 1.15 --dtype fp32 fp16

Per workload: the roofline (stream copy, random-row gather), the correctness gate (pooled
outputs and the weights after one update must match FBGEMM; nothing is timed otherwise),
interleaved timing (every timer stops only when the JAX arrays its case produced are
computed: `timing.clocked`), the default update's phases, every side timed again alone in
a fresh process (`benchmarks.alone`), and peak RSS of each side in its own process. Results
go to a fresh runs/bench/xla_vs_fbgemm-<time>/ (`--out DIR` elsewhere; `--update-results`: the
committed benchmarks/results/): xla_vs_fbgemm.json / .md / .png. Exit status 1
if any gate failed, 3 if a side's time in the harness is more than 15% away from its time
alone (the ratios are then void).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import platform
import shlex
import subprocess
import sys
import time

import numpy as np

from benchmarks import gate, report, roofline
from benchmarks.timing import clocked, interleaved, paired_ratio, summarize
from benchmarks.workloads import DTYPES, Workload, default_set, make_batch, tiny_set

__all__ = ["main", "run_workload", "parse_args"]

OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd")
PATHS = (
    "auto",
    "xla",
    "xla_insort",
    "reference",
)  # ours: the library default (kernel="auto"), pure XLA (host-sorted runs), pure XLA with the
# sort in the program (before the host sort; "xla" / "xla_insort" is the A/B), reference
TINY = dict(T=2, E=1000, D=16, B=64, L=4)
FAULTS = ("weights", "update", "harness-delay")
HARNESS_DELAY_S = 0.2  # --inject-fault harness-delay: added to FBGEMM's cases in the harness only


# -- machine / versions ---------------------------------------------------------------------
def machine_info() -> dict:
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("unknown", "", "x86_64"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    caches = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    if os.path.isdir(base):
        for idx in sorted(os.listdir(base)):
            try:
                with open(f"{base}/{idx}/level") as f:
                    level = f.read().strip()
                with open(f"{base}/{idx}/type") as f:
                    kind = f.read().strip()
                with open(f"{base}/{idx}/size") as f:
                    size = f.read().strip()
                caches[f"L{level}{'' if kind == 'Unified' else kind[0].lower()}"] = size
            except OSError:
                continue
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            mem_total = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    isa = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if x in flags]
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "isa": ", ".join(isa) or "unknown",
        "caches_per_core_or_shared": caches,
        "mem_total_bytes": mem_total,
        "platform": platform.platform(),
        "loadavg_start": list(os.getloadavg()),
        # both sides run in processes started with it (huge-page buffers, hybrid._cpu_env)
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


def versions() -> dict:
    from importlib import metadata

    import jax
    import torch

    from benchmarks import fbgemm_side

    def ver(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    out = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": ver("jaxlib"),
        "torch": torch.__version__,
        "fbgemm_gpu": fbgemm_side.version(),
        "torchrec": ver("torchrec"),
        "numpy": np.__version__,
        "matplotlib": ver("matplotlib"),
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:  # read-only git queries
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        out["hybridrec_commit"] = (commit or "?") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        out["hybridrec_commit"] = "?"
    return out


# -- one workload -----------------------------------------------------------------------------
def _gate_sides(ours: dict, fb, what: str, dtype: str) -> list[dict]:
    checks = []
    ref_pooled = fb.pooled()
    for name, side in ours.items():
        checks.append(
            gate.close(f"{what}: pooled output {name} vs FBGEMM", side.pooled(), ref_pooled)
        )
    fb.step()
    ref_tables, ref_state = fb.tables(), fb.row_state()
    for name, side in ours.items():
        side.step()
        checks.append(
            gate.close(
                f"{what}: weights after one update, {name} vs FBGEMM",
                side.tables(),
                ref_tables,
                gate.update_rtol(dtype),
            )
        )
        if ref_state is not None:
            checks.append(
                gate.close(
                    f"{what}: row-wise Adagrad state after one update, {name} vs FBGEMM",
                    side.row_state(),
                    ref_state,
                )
            )
    return checks


def _gbps(w: Workload, case: dict, roof: float) -> dict:
    out = {}
    fwd = case.get("fwd", case["total"])["median_ms"] / 1e3
    out["fwd"] = roofline.gbps(w.fwd_bytes(), fwd)
    out["fwd_pct"] = roofline.percent_of(out["fwd"], roof)
    if "bwd" in case:
        out["bwd"] = roofline.gbps(w.bwd_bytes(), case["bwd"]["median_ms"] / 1e3)
        out["bwd_pct"] = roofline.percent_of(out["bwd"], roof)
    return out


def _block(w: Workload, samples: dict, roof: float) -> dict:
    cases = {p: {seg: summarize(xs) for seg, xs in segs.items()} for p, segs in samples.items()}
    ratios, ratios_bwd = {}, {}
    for p in samples:
        if p == "fbgemm":
            continue
        ratios[p] = paired_ratio(samples[p]["total"], samples["fbgemm"]["total"])
        if "bwd" in samples[p]:
            ratios_bwd[p] = paired_ratio(samples[p]["bwd"], samples["fbgemm"]["bwd"])
    out = {
        "cases": cases,
        "ratios": ratios,
        "gbps": {p: _gbps(w, c, roof) for p, c in cases.items()},
    }
    if ratios_bwd:
        out["ratios_bwd_only"] = ratios_bwd
    if "xla" in samples and "xla_insort" in samples:  # the A/B, measured interleaved
        out["xla_vs_insort"] = paired_ratio(samples["xla"]["total"], samples["xla_insort"]["total"])
    return out


def _harness_case(fn, args, side: str):
    """`fn(clock)` as a timing case; under --inject-fault harness-delay, FBGEMM's cases are
    slowed inside the harness only (the alone comparison must catch it)."""
    if args.inject_fault == "harness-delay" and side == "fbgemm":

        def slowed(clock):
            time.sleep(HARNESS_DELAY_S)
            return fn(clock)

        return clocked(slowed)
    return clocked(fn)


def _time_block(cases: dict, args) -> dict:
    return interleaved(
        cases,
        warmup=args.warmup,
        repeats=args.repeats,
        budget_s=args.budget_s,
        pause_s=args.pause_ms / 1e3,
        lead_in_s=args.lead_in_ms / 1e3,
    )


def _alone_checks(w: Workload, res: dict, harness: dict, args, log) -> None:
    """Every timed side again, alone in a fresh process; each block gets `vs_alone`."""
    from benchmarks import alone

    phases = ["forward", *args.optimizers]
    for side in sorted({s for segs in harness.values() for s in segs}):
        log(f"== {w.name}: {side} alone in a fresh process")
        spec = {
            "side": side,
            "workload": {k: v for k, v in w.as_dict().items() if k != "name"},
            "phases": [p for p in phases if side in harness.get(p, {})],
            "lr": args.lr,
            "eps": args.eps,
            "fbgemm_dtype": res["fbgemm_timing_dtype"],
            "torch_threads": args.torch_threads,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "budget_s": args.budget_s,
            "pause_s": args.pause_ms / 1e3,
            "lead_in_s": args.lead_in_ms / 1e3,
        }
        for phase, rounds in alone.time_alone(spec).items():
            block = res["forward"] if phase == "forward" else res["train"][phase]
            block.setdefault("vs_alone", {})[side] = alone.compare(
                harness[phase][side], rounds, args.alone_tolerance
            )
    checks = [
        c
        for block in [res["forward"], *res["train"].values()]
        for c in block.get("vs_alone", {}).values()
    ]
    res["alone_ok"] = all(c["agrees"] for c in checks)


def run_workload(w: Workload, args, log) -> dict:
    from benchmarks.fbgemm_side import FbgemmSide, backward_path, supports
    from benchmarks.xla_side import XlaSide

    res: dict = {
        "workload": w.as_dict(),
        "itemsize": w.itemsize,
        "fwd_bytes": w.fwd_bytes(),
        "bwd_bytes": w.bwd_bytes(),
        "gate": [],
        "gate_ok": False,
    }
    log(f"== {w.name}: roofline")
    res["roofline"] = roofline.measure(**args.roofline_kwargs)
    roof = res["roofline"]["roofline_gbps"]
    batch = make_batch(w)
    gate_dtype = (
        w.dtype if supports(w.dtype) else "fp32"
    )  # bf16: FBGEMM fp32 on bf16-rounded tables
    time_dtype = (
        w.dtype if supports(w.dtype) else "fp16"
    )  # bf16: time FBGEMM fp16 (same bytes per row)
    res["fbgemm_gate_dtype"], res["fbgemm_timing_dtype"] = gate_dtype, time_dtype
    fb_tables = batch.tables
    if args.inject_fault == "weights":  # gate self-test: FBGEMM starts from different weights
        fb_tables = batch.tables.copy()
        fb_tables[0, batch.ids[0]] += 0.01
    fb_batch = dataclasses.replace(batch, tables=fb_tables)
    fb_lr = args.lr * (1.01 if args.inject_fault == "update" else 1.0)
    res["train"] = {}
    harness: dict[str, dict[str, list[float]]] = {}  # phase -> side -> total seconds per round
    kw = dict(lr=args.lr, eps=args.eps)
    for k, opt in enumerate(args.optimizers):
        log(f"== {w.name}: {opt}: build + correctness gate")
        ours = {p: XlaSide(w, batch, p, opt, **kw) for p in PATHS}
        res["paths"] = {p: side.resolved for p, side in ours.items()}
        if ours["auto"].resolved == "xla":  # no C++ kernels here: the default *is* the xla path
            del ours["auto"]
        fb = FbgemmSide(w, fb_batch, opt, lr=fb_lr, eps=args.eps, dtype=gate_dtype)
        checks = _gate_sides(ours, fb, opt, w.dtype)
        res["gate"] += checks
        if not all(c["ok"] for c in checks):
            for c in checks:
                if not c["ok"]:
                    log(f"   GATE FAILED: {c}")
            log(f"== {w.name}: correctness gate failed; refusing to time this workload")
            return res
        if time_dtype != gate_dtype:
            fb = FbgemmSide(w, batch, opt, lr=args.lr, eps=args.eps, dtype=time_dtype)
        timed = {p: side for p, side in ours.items() if p != "reference" or args.reference}
        if k == 0:
            log(f"== {w.name}: forward timing")
            cases = {p: _harness_case(side.time_forward, args, p) for p, side in timed.items()}
            cases["fbgemm"] = _harness_case(fb.time_forward, args, "fbgemm")
            samples = _time_block(cases, args)
            harness["forward"] = {p: seg["total"] for p, seg in samples.items()}
            res["forward"] = _block(w, samples, roof)
            res["xla_forward_program_memory"] = ours["xla"].forward_memory()
        log(f"== {w.name}: {opt}: forward + backward + update timing")
        cases = {
            p: _harness_case(side.time_step, args, p)
            for p, side in timed.items()
            if p != "reference" or args.reference_backward
        }
        cases["fbgemm"] = _harness_case(fb.time_step, args, "fbgemm")
        samples = _time_block(cases, args)
        harness[opt] = {p: seg["total"] for p, seg in samples.items()}
        block = _block(w, samples, roof)
        block["fbgemm_path"] = backward_path(opt, time_dtype)
        if "auto" in ours and opt in _kernels_rules():
            block["update_phases"] = ours["auto"].update_phases(
                args.warmup, max(5, args.repeats // 2)
            )
        block["update_in_place"] = {
            p: bool(side.in_place) and all(side.in_place)
            for p, side in ours.items()
            if side.in_place
        }
        block["update_program_memory"] = {
            p: ours[p].update_memory() for p in ours if p != "reference"
        }
        block["table_bytes"] = ours["xla"].table_bytes()
        block["state_bytes"] = ours["xla"].state_bytes()
        res["train"][opt] = block
        del ours, fb, timed
    res["gate_ok"] = True
    if args.alone:
        _alone_checks(w, res, harness, args, log)
    if args.memory:
        from benchmarks import memory

        opt = args.optimizers[0]
        log(f"== {w.name}: memory ({opt}, one process per side)")
        wd = {k: v for k, v in w.as_dict().items() if k != "name"}
        mem_sides = (["auto"] if res["paths"].get("auto", "xla") != "xla" else []) + [
            "xla",
            "fbgemm",
        ]
        sides = memory.measure_all(
            wd, mem_sides, opt, lr=args.lr, eps=args.eps, fbgemm_dtype=time_dtype
        )
        note = _memory_note(w, sides)
        res["memory"] = {"optimizer": opt, "sides": sides, "note": note}
    return res


def _kernels_rules() -> tuple[str, ...]:
    from sparse_jax import _kernels

    return tuple(_kernels.RULES)


def _memory_note(w: Workload, sides: dict) -> str:
    notes = []
    for name in ("auto", "xla"):
        x = sides.get(name, {})
        if "error" in x or "step_overhead" not in x:
            continue
        prog = x.get("xla_update_memory") or {}
        notes.append(
            f"{name}: update in place (donated buffer kept) = {x.get('update_in_place')}; XLA aliases "
            f"{prog.get('alias_bytes', 0) / 2**20:.0f} MiB of params + state into the outputs, and the update "
            f"program's temp buffers are {prog.get('temp_bytes', 0) / 2**20:.0f} MiB (table "
            f"{w.table_bytes() / 2**20:.0f} MiB)."
        )
    if not notes:
        return ""
    return (
        "Second table copy? No, if the update is in place and its temps are not table-sized: "
        + " ".join(notes)
        + " xla's temps are [id capacity, D] fp32 buffers (per-id and per-unique-row gradients, "
        "gathered rows), paged in again on every step (the minor faults column)."
    )


# -- CLI ----------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.xla_vs_fbgemm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tiny", action="store_true", help=f"smoke sizes {TINY}")
    for k in ("T", "E", "D", "B", "L"):
        p.add_argument(
            f"--{k}",
            type=int,
            default=None,
            help=f"override {k} (W1 default: {getattr(Workload(), k)})",
        )
    p.add_argument(
        "--alpha",
        type=float,
        nargs="+",
        default=None,
        help="Zipf alphas (<= 1.0: uniform); default 1.0 1.15",
    )
    p.add_argument("--weighted", action="store_true", help="per-id weights")
    p.add_argument(
        "--dtype",
        nargs="+",
        choices=sorted(DTYPES),
        default=None,
        help="table dtypes (default fp32)",
    )
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--repeats", type=int, default=30, help="interleaved rounds per block (max)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--budget-s", type=float, default=20.0, help="stop a block's rounds after this many seconds"
    )
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument(
        "--pause-ms",
        type=float,
        default=0.0,
        help="untimed sleep before each case in a round (idle thread pools stop spinning)",
    )
    p.add_argument(
        "--lead-in-ms",
        type=float,
        default=60.0,
        help="untimed runs of each case (at least one) for this long right before its timed run in a "
        "round: its thread pools awake, the previous case's asleep, as in a loop of it alone",
    )
    p.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also time the reference forward (gather + segment_sum; it is always gated)",
    )
    p.add_argument(
        "--reference-backward",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --reference, also time reference forward + update (the same program as xla's)",
    )
    p.add_argument(
        "--alone",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time every side again alone in a fresh process and compare (exit 3 on disagreement)",
    )
    p.add_argument(
        "--alone-tolerance",
        type=float,
        default=None,
        help="largest |harness / alone - 1| accepted (default benchmarks.alone.TOLERANCE = 0.15)",
    )
    p.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="peak RSS per side (one subprocess each)",
    )
    report.add_output_args(p, "xla_vs_fbgemm")
    p.add_argument(
        "--inject-fault",
        choices=FAULTS,
        default=None,
        help="self-tests: feed FBGEMM wrong initial weights / a wrong lr (the gate must refuse), "
        "or slow FBGEMM inside the harness only (the alone comparison must refuse)",
    )
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    args.out = report.output_dir(p, args, "xla_vs_fbgemm")
    if args.alone_tolerance is None:
        from benchmarks.alone import TOLERANCE

        args.alone_tolerance = TOLERANCE
    base = dict(TINY) if args.tiny else {}
    for k in ("T", "E", "D", "B", "L"):
        if getattr(args, k) is not None:
            base[k] = getattr(args, k)
    custom = (
        args.alpha is not None
        or args.dtype is not None
        or args.weighted
        or any(getattr(args, k) is not None for k in ("T", "E", "D", "B", "L"))
    )
    if not custom:
        args.workloads = tiny_set() if args.tiny else default_set()
    else:
        alphas = args.alpha or [1.0, 1.15]
        dtypes = args.dtype or ["fp32"]
        args.workloads = [
            Workload(**base, alpha=a, dtype=d, weighted=args.weighted)
            for a, d in itertools.product(alphas, dtypes)
        ]
    if args.tiny:
        small = dict(copy_mib=16, table_rows=20_000, bags=1024, L=20, repeats=5, warmup=1)
        args.roofline_kwargs = small
    else:
        args.roofline_kwargs = {}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    t0 = time.perf_counter()

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    prev_threads = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    try:
        results = {
            "command": "python -m benchmarks.xla_vs_fbgemm "
            + shlex.join(sys.argv[1:] if argv is None else argv),
            "machine": machine_info(),
            "versions": versions(),
            "config": {
                "repeats": args.repeats,
                "warmup": args.warmup,
                "budget_s": args.budget_s,
                "pause_ms": args.pause_ms,
                "lead_in_ms": args.lead_in_ms,
                "torch_threads": args.torch_threads,
                "lr": args.lr,
                "eps": args.eps,
                "optimizers": list(args.optimizers),
                "reference": args.reference,
                "reference_backward": args.reference_backward,
                "alone": args.alone,
                "alone_tolerance": args.alone_tolerance,
                "gate_rtol": gate.RTOL,
                "inject_fault": args.inject_fault,
                "byte_convention": "fwd = B*T*L*D*bytes + B*T*D*4; bwd = 2x fwd (FBGEMM benchmark)",
            },
            "workloads": [],
        }
        probe = not args.tiny  # W1's pooled lookup with 1 and 2 threads, in a fresh process
        if probe:
            from benchmarks.e2e_step import quietness_probe

            log("quietness probe (before)")
            results["probe"] = {"before": quietness_probe()}
        for w in args.workloads:
            results["workloads"].append(run_workload(w, args, log))
        if probe:
            log("quietness probe (after)")
            results["probe"]["after"] = quietness_probe()
            results["probe"]["quiet"] = all(p["quiet"] for p in results["probe"].values())
        results["machine"]["loadavg_end"] = list(os.getloadavg())
        results["elapsed_s"] = time.perf_counter() - t0
        paths = report.write_all(results, args.out)
    finally:
        torch.set_num_threads(prev_threads)
    log(f"wrote {', '.join(paths.values())} in {results['elapsed_s']:.0f} s")
    if not args.quiet:
        print(report.markdown(results))
    print(f"results: {args.out}")
    if not results.get("probe", {}).get("quiet", True):
        print(
            "CONTENDED: the quietness probe says another process loaded the cores; every "
            "ratio to FBGEMM above is void (the xla / xla_insort A/B, timed interleaved, is "
            "less sensitive). Rerun on a quiet machine.",
            file=sys.stderr,
        )
    if not all(wr["gate_ok"] for wr in results["workloads"]):
        return 1
    disagree = [
        wr["workload"]["name"] for wr in results["workloads"] if not wr.get("alone_ok", True)
    ]
    if disagree:
        print(
            f"BASELINE VOID: a side timed in the harness is more than {args.alone_tolerance:.0%} away from the "
            f"same side timed alone in a fresh process ({', '.join(disagree)}); see the 'alone' columns. "
            "Do not quote these ratios.",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    from hybrid._cpu_env import reexec_with_hugepages

    reexec_with_hugepages()  # XLA:CPU's fresh buffers in huge pages, both sides alike
    sys.exit(main())
