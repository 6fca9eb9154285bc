"""Write a run's results: JSON (every figure), Markdown (ratios, GB/s, memory), PNG (ratios).

Ratios are ours / FBGEMM of median times: below 1 ours is faster. "paired" is the median
of per-round ratios (both sides ran in the same round), the steadier figure on a shared
machine. GB/s use FBGEMM's byte convention (see `workloads.Workload.fwd_bytes`); the
backward is counted as 2x the forward bytes over the backward + update time alone.

Where every benchmark writes (`add_output_args` / `output_dir`): a fresh run directory
`runs/bench/<name>-<time>/` (git-ignored) by default, `--out DIR` when given, and the
committed `benchmarks/results/` (the figures the README and NOTES quote) only with
`--update-results`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

__all__ = [
    "RESULTS_DIR",
    "RUNS_DIR",
    "add_output_args",
    "fresh_run_dir",
    "output_dir",
    "write_all",
    "markdown",
    "plot",
]

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # committed
RUNS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "bench"
)  # git-ignored


def fresh_run_dir(name: str) -> str:
    """A new `runs/bench/<name>-<time>[-n]/` path (not created yet)."""
    base = os.path.join(RUNS_DIR, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def add_output_args(parser: argparse.ArgumentParser, name: str) -> None:
    """`--out` and `--update-results` for benchmark `name` (resolve them with `output_dir`)."""
    parser.add_argument(
        "--out",
        default=None,
        help=f"output directory (default: a fresh runs/bench/{name}-<time>/, git-ignored)",
    )
    parser.add_argument(
        "--update-results",
        action="store_true",
        help="write into the committed benchmarks/results/ (the figures the docs quote) instead",
    )


def output_dir(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> str:
    """Where this run writes: `--out`, the committed results with `--update-results`, else a
    fresh run directory. Exits with a usage error for both flags, or `--update-results` with
    `--tiny` (smoke sizes would replace the committed figures)."""
    if args.update_results and args.out:
        parser.error(f"--out {args.out} and --update-results name two places; give one")
    if args.update_results and getattr(args, "tiny", False):
        parser.error(
            "--update-results with --tiny would replace the committed benchmarks/results/ with smoke-size "
            "figures; drop --tiny (or --update-results: the run then goes to runs/bench/)"
        )
    if args.update_results:
        return RESULTS_DIR
    return args.out or fresh_run_dir(name)


PATH_LABEL = {
    "auto": "hybridrec default (kernel=auto)",
    "xla": "hybridrec xla",
    "xla_insort": "hybridrec xla, sort in the program (before host sort)",
    "reference": "hybridrec reference",
    "fbgemm": "FBGEMM TBE",
}
OURS = ("auto", "xla", "xla_insort", "reference")
PHASE_LABEL = {
    "forward": "forward",
    "rowwise_adagrad": "fwd+bwd+rowwise adagrad",
    "adagrad": "fwd+bwd+adagrad",
    "sgd": "fwd+bwd+sgd",
}


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.0f}"


def _ratio_cell(r: dict | None) -> str:
    if not r:
        return "-"
    return f"**{r['ratio_of_medians']:.2f}x** (paired {r['paired_median']:.2f}, IQR {r['paired_p25']:.2f}-{r['paired_p75']:.2f})"


def _phases(wr: dict) -> list[tuple[str, dict]]:
    out = []
    if wr.get("forward"):
        out.append(("forward", wr["forward"]))
    for opt, block in wr.get("train", {}).items():
        out.append((opt, block))
    return out


def markdown(results: dict) -> str:
    m, v = results["machine"], results["versions"]
    lines = [
        "# hybridrec vs FBGEMM CPU TBE (SplitTableBatchedEmbeddingBagsCodegen, HOST / CPU)",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores ({m.get('isa', '?')}), shared; load average "
        f"{m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at end. torch threads "
        f"{results['config']['torch_threads']}, XLA its own pool; GLIBC_TUNABLES "
        f"`{m.get('glibc_tunables') or '(none)'}` (every side's process).",
        f"Versions: jax {v['jax']}, torch {v['torch']}, fbgemm-gpu-cpu {v['fbgemm_gpu']}, numpy {v['numpy']}, "
        f"python {v['python']}, hybridrec {v.get('hybridrec_commit', '?')}.",
        f"Command: `{results['command']}`; {results['elapsed_s']:.0f} s. Timing: {results['config']['warmup']} "
        f"warm-up rounds, up to {results['config']['repeats']} interleaved rounds (budget "
        f"{results['config']['budget_s']} s per block; in each round, a case runs untimed for "
        f"{results['config'].get('lead_in_ms', 0):g} ms (at least once) right before its timed run, and an untimed {results['config'].get('pause_ms', 0):g} ms "
        "pause before each case), medians; every clock stops only once the JAX arrays its case produced are "
        "computed.",
        *_probe_lines(results),
        "",
        "Ratio = ours / FBGEMM median time (lower is better; < 1 means ours is faster). "
        "GB/s: FBGEMM's convention, forward bytes = B*T*L*D*bytes + B*T*D*4; backward = 2x forward "
        "bytes over the backward + fused update time alone (FBGEMM's benchmark convention); "
        "% = of the pooled random-row gather roofline measured in the same run (torch.embedding_bag over "
        "uniform random rows of an 800k x 64 fp32 table); above 100% means faster than that: Zipf ids hit "
        "cache (the convention counts bytes requested, not DRAM traffic), and FBGEMM's TBE kernel can "
        "beat torch.embedding_bag's path.",
        "",
        "## Ratios (ours / FBGEMM)",
        "",
        "| workload | path | " + " | ".join(PHASE_LABEL.values()) + " |",
        "|---|---|" + "---|" * len(PHASE_LABEL),
    ]
    for wr in results["workloads"]:
        name = wr["workload"]["name"]
        if not wr.get("gate_ok"):
            lines.append(f"| {name} | - | GATE FAILED: not timed |" + " |" * len(PHASE_LABEL))
            continue
        for path in OURS:
            cells = []
            for phase in PHASE_LABEL:
                block = wr["forward"] if phase == "forward" else wr.get("train", {}).get(phase)
                cells.append(
                    _ratio_cell((block or {}).get("ratios", {}).get(path)) if block else "-"
                )
            if all(c == "-" for c in cells):
                continue
            resolved = wr.get("paths", {}).get(path)
            label = PATH_LABEL[path] + (f" -> {resolved}" if path == "auto" and resolved else "")
            lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    lines += _ab_lines(results)
    for wr in results["workloads"]:
        w = wr["workload"]
        lines += ["", f"## {w['name']}", ""]
        if not wr.get("gate_ok"):
            lines.append("Correctness gate FAILED; nothing was timed. Failed checks:")
            lines += [f"- {c['what']}: {c}" for c in wr["gate"] if not c["ok"]]
            continue
        roof = wr["roofline"]
        lines.append(
            f"Roofline (same run): stream copy {roof['copy']['gbps']:.1f} GB/s, pooled random 256-byte-row "
            f"gather {roof['gather_pooled']['gbps']:.1f} GB/s (the 100% below), unpooled row gather "
            f"{roof['gather_rows']['gbps']:.1f} GB/s. Forward bytes {wr['fwd_bytes'] / 1e6:.3g} MB. "
            f"Gate: {len(wr['gate'])} checks passed."
        )
        if wr.get("fbgemm_timing_dtype") and wr["fbgemm_timing_dtype"] != w["dtype"]:
            lines.append(
                f"FBGEMM's CPU TBE has no {w['dtype']} weights: it is timed with "
                f"{wr['fbgemm_timing_dtype']} weights (same bytes per row), and gated in fp32 on the "
                f"{w['dtype']}-rounded tables."
            )
        lines += [
            "",
            "| phase | path | median ms [IQR] | fwd ms | bwd+update ms | ours/FBGEMM | GB/s (% roof) fwd | GB/s (% roof) bwd |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for phase, block in _phases(wr):
            for path, s in block["cases"].items():
                tot = s["total"]
                r = block.get("ratios", {}).get(path)
                fwd = s.get("fwd")
                bwd = s.get("bwd")
                g = block["gbps"][path]
                fwd_g = f"{g['fwd']:.1f} ({g['fwd_pct']:.0f}%)" if g.get("fwd") is not None else "-"
                bwd_g = f"{g['bwd']:.1f} ({g['bwd_pct']:.0f}%)" if g.get("bwd") is not None else "-"
                fwd_ms = f"{(fwd or tot)['median_ms']:.2f}"
                bwd_ms = f"{bwd['median_ms']:.2f}" if bwd else "-"
                ratio = f"{r['ratio_of_medians']:.2f}x" if r else "1 (baseline)"
                lines.append(
                    f"| {PHASE_LABEL[phase]} | {PATH_LABEL[path]} | {tot['median_ms']:.2f} "
                    f"[{tot['p25_ms']:.2f}-{tot['p75_ms']:.2f}] (n={tot['n']}) | {fwd_ms} | {bwd_ms} | "
                    f"{ratio} | {fwd_g} | {bwd_g} |"
                )
            if block.get("fbgemm_path"):
                lines.append(f"| | FBGEMM backward path: {block['fbgemm_path']} | | | | | | |")
            if block.get("reference_note"):
                lines.append(f"| | {block['reference_note']} | | | | | | |")
        lines += _alone_lines(wr)
        lines += _update_phase_lines(wr)
        mem = wr.get("memory")
        if mem:
            lines += [
                "",
                f"Memory ({mem['optimizer']}, each side in a fresh process; MiB): tables "
                f"{_mib(w['T'] * w['E'] * w['D'] * wr['itemsize'])} MiB per copy.",
                "",
                "| side | RSS with libraries + batch | RSS ready (tables, state, programs) | peak while building | peak during steps | step overhead (peak - ready) | minor faults / step |",
                "|---|---|---|---|---|---|---|",
            ]
            for side, s in mem["sides"].items():
                if "error" in s:
                    lines.append(
                        f"| {PATH_LABEL.get(side, side)} | error: {s['error']} | | | | | |"
                    )
                    continue
                lines.append(
                    f"| {PATH_LABEL.get(side, side)} | {_mib(s['rss_base'])} | {_mib(s['rss_ready'])} | "
                    f"{_mib(s.get('peak_setup'))} | {_mib(s.get('peak_steps'))} | {_mib(s.get('step_overhead'))} | "
                    f"{s['minor_faults_per_step']:.0f} |"
                )
            if mem.get("note"):
                lines += ["", mem["note"]]
    return "\n".join(lines) + "\n"


def _alone_lines(wr: dict) -> list[str]:
    rows = [
        (phase, side, c)
        for phase, block in _phases(wr)
        for side, c in block.get("vs_alone", {}).items()
    ]
    if not rows:
        return []
    verdict = (
        "every side agrees"
        if wr.get("alone_ok")
        else "**VOID: a side disagrees; do not quote these ratios**"
    )
    out = [
        "",
        f"Each side timed alone in a fresh process (same batch, warm-up and rounds) beside its time in the "
        f"harness: {verdict}.",
        "",
        "| phase | side | in harness ms | alone ms | harness / alone | agrees |",
        "|---|---|---|---|---|---|",
    ]
    for phase, side, c in rows:
        out.append(
            f"| {PHASE_LABEL[phase]} | {PATH_LABEL[side]} | {c['harness_ms']:.2f} | {c['alone_ms']:.2f} | "
            f"{c['harness_over_alone']:.2f} | {'yes' if c['agrees'] else '**NO**'} |"
        )
    ours = [p for p in OURS if any(p in b.get("vs_alone", {}) for _, b in _phases(wr))]
    out += [
        "",
        "Ours / FBGEMM from the times alone (each side in its own fresh process):",
        "",
        "| path | " + " | ".join(PHASE_LABEL[p] for p, _ in _phases(wr)) + " |",
        "|---|" + "---|" * len(_phases(wr)),
    ]
    for path in ours:
        cells = []
        for _, block in _phases(wr):
            a = block.get("vs_alone", {})
            cells.append(
                f"{a[path]['alone_ms'] / a['fbgemm']['alone_ms']:.2f}x"
                if path in a and "fbgemm" in a
                else "-"
            )
        out.append(f"| {PATH_LABEL[path]} | " + " | ".join(cells) + " |")
    return out


def _probe_lines(results: dict) -> list[str]:
    """The quietness probe taken before and after the timings (absent with --tiny)."""
    probe = results.get("probe")
    if not probe or "after" not in probe:
        return []
    from benchmarks.e2e_step import quietness_line

    line = quietness_line(probe["before"], probe["after"])
    if not probe["quiet"]:
        line += " **VOID: do not quote the ratios to FBGEMM below.**"
    return ["", line]


def _ab_lines(results: dict) -> list[str]:
    """The pure-XLA A/B: host-sorted runs ("xla") over the sort in the program
    ("xla_insort"), timed interleaved in the same rounds (steadier than either side's
    ratio to FBGEMM on a shared machine)."""
    rows = []
    for wr in results["workloads"]:
        for phase, block in _phases(wr) if wr.get("gate_ok") else []:
            if block.get("xla_vs_insort"):
                rows.append((wr["workload"]["name"], phase, block["xla_vs_insort"]))
    if not rows:
        return []
    out = [
        "",
        "## Pure XLA: host-sorted runs / sort in the program (interleaved A/B)",
        "",
        "| workload | phase | xla / xla_insort |",
        "|---|---|---|",
    ]
    out += [f"| {name} | {PHASE_LABEL[phase]} | {_ratio_cell(r)} |" for name, phase, r in rows]
    return out


def _update_phase_lines(wr: dict) -> list[str]:
    roof = wr["roofline"]["roofline_gbps"]
    rows = [
        (opt, block["update_phases"])
        for opt, block in wr.get("train", {}).items()
        if block.get("update_phases")
    ]
    if not rows:
        return []
    out = [
        "",
        "Where the default (C++) update's time goes (medians of waited-for updates; bytes are the least "
        "each phase must move; % of the pooled-gather roofline):",
        "",
        "| optimizer | unique rows | records ms (GB/s, %) | sort ms, radix passes (GB/s, %) | "
        "apply: sum gradients + rule + write back ms (GB/s, %) |",
        "|---|---|---|---|---|",
    ]
    for opt, ph in rows:
        cells = []
        for name in ("records", "sort", "apply"):
            x = ph[name]
            gbps = x["bytes"] / (x["median_ms"] / 1e3) / 1e9 if x["median_ms"] > 0 else float("nan")
            extra = f", {ph['radix_passes']} passes" if name == "sort" else ""
            cells.append(f"{x['median_ms']:.2f}{extra} ({gbps:.1f}, {100 * gbps / roof:.0f}%)")
        out.append(f"| {opt} | {ph['unique_rows']:,} | " + " | ".join(cells) + " |")
    return out


def plot(results: dict, path: str) -> bool:
    """Bar chart of ours / FBGEMM per workload and phase; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups, series, shapes = [], {p: [] for p in OURS}, set()
    for wr in results["workloads"]:
        if not wr.get("gate_ok"):
            continue
        w = wr["workload"]
        shapes.add(f"T={w['T']} E={w['E']} D={w['D']} B={w['B']} L={w['L']}")
        dist = "uniform" if w["alpha"] <= 1.0 else f"Zipf {w['alpha']:g}"
        short = f"{dist} {w['dtype']}{' weighted' if w['weighted'] else ''}"
        for phase, block in _phases(wr):
            r = block.get("ratios", {})
            groups.append(f"{short}\n{PHASE_LABEL[phase]}")
            for p in OURS:
                series[p].append(r[p]["ratio_of_medians"] if p in r else float("nan"))
    series = {p: v for p, v in series.items() if any(x == x for x in v)}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * len(groups)), 4.8))
    xs = list(range(len(groups)))
    width = 0.8 / max(1, len(series))
    for i, (p, vals) in enumerate(series.items()):
        off = (i - (len(series) - 1) / 2) * width
        bars = ax.bar([x + off for x in xs], vals, width=width, label=PATH_LABEL[p])
        for bar, v in zip(bars, vals, strict=True):
            if v == v:  # not NaN
                ax.annotate(
                    f"{v:.2f}",
                    (bar.get_x() + bar.get_width() / 2, v),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
    ax.axhline(1.0, color="k", lw=1, ls="--", label="FBGEMM = 1")
    ax.set_yscale("log")
    ax.set_ylabel("time ours / FBGEMM (lower is better)")
    ax.set_xticks(xs)
    ax.set_xticklabels(groups, fontsize=7)
    ax.set_title(
        "hybridrec vs FBGEMM CPU TBE, median time ratio (" + "; ".join(sorted(shapes)) + ")",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_all(results: dict, out_dir: str, stem: str = "xla_vs_fbgemm") -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": os.path.join(out_dir, f"{stem}.json"),
        "md": os.path.join(out_dir, f"{stem}.md"),
    }
    png = os.path.join(out_dir, f"{stem}.png")
    if plot(results, png):
        paths["png"] = png
    results["files"] = dict(paths)
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1, sort_keys=False)
    with open(paths["md"], "w") as f:
        f.write(markdown(results))
    return paths
