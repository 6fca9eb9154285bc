"""The XLA-vs-FBGEMM harness (benchmarks/) at tiny sizes: gate, failure on wrong inputs, outputs.

Runs the CLI in-process (`benchmarks.xla_vs_fbgemm.main`) on one tiny workload with few
repeats; the memory subprocess path is exercised once, on its own. Tests that run FBGEMM
are marked `parity` and skip without fbgemm_gpu.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from benchmarks import gate, memory, xla_vs_fbgemm
from benchmarks.workloads import Workload, make_batch


@pytest.fixture
def fbgemm():
    return pytest.importorskip("fbgemm_gpu")


FAST = [
    "--tiny",
    "--alpha",
    "1.15",
    "--repeats",
    "3",
    "--warmup",
    "1",
    "--budget-s",
    "2",
    # each case's untimed runs before its timed one: at least one still runs (the code path),
    # 5 ms instead of the 60 ms that steadies real timings (each case, round and block)
    "--lead-in-ms",
    "5",
    "--quiet",
]


@pytest.mark.parity
def test_tiny_run_passes_gate_and_writes_outputs(tmp_path, fbgemm, monkeypatch):
    # tiny cases take well under a millisecond and the suite shares the cores: the alone
    # comparison runs, with a tolerance that never trips (the next test proves it can)
    import torch

    from benchmarks import alone

    fresh, real = [], alone.time_alone

    def time_alone(spec, timeout_s=1800):
        # a fresh process (~5 s of imports and compiles each) for FBGEMM's side and one of
        # ours, each kind of side; our other paths' sides are built and timed by the same
        # `alone._child` in this process (the torch threads it sets, restored)
        if spec["side"] in ("fbgemm", "xla"):
            fresh.append(spec["side"])
            return real(spec, timeout_s)
        threads = torch.get_num_threads()
        try:
            return json.loads(json.dumps(alone._child(spec)))
        finally:
            torch.set_num_threads(threads)

    monkeypatch.setattr(alone, "time_alone", time_alone)
    rc = xla_vs_fbgemm.main(
        [*FAST, "--no-memory", "--alone-tolerance", "1000", "--out", str(tmp_path)]
    )
    assert rc == 0
    assert sorted(fresh) == ["fbgemm", "xla"]
    res = json.loads((tmp_path / "xla_vs_fbgemm.json").read_text())
    (wr,) = res["workloads"]
    assert wr["gate_ok"] and wr["gate"] and all(c["ok"] for c in wr["gate"])
    # per path of ours and optimizer: pooled output, weights after one update, Adagrad state (2 of 3)
    ours = [
        p
        for p in ("auto", "xla", "xla_insort", "reference")
        if wr["paths"].get(p) and (p != "auto" or wr["paths"][p] != "xla")
    ]
    assert {"xla", "xla_insort", "reference"} <= set(ours)
    assert len(wr["gate"]) == 8 * len(ours)
    assert set(wr["train"]) == {"rowwise_adagrad", "adagrad", "sgd"}
    timed = set(ours) - {"reference"}  # the reference is gated, timed only with --reference
    for block in [wr["forward"], *wr["train"].values()]:
        assert set(block["cases"]) == timed | {"fbgemm"}
        for p in timed:
            r = block["ratios"][p]["ratio_of_medians"]
            want = (
                block["cases"][p]["total"]["median_ms"]
                / block["cases"]["fbgemm"]["total"]["median_ms"]
            )
            assert r == pytest.approx(want)
        assert block["cases"]["fbgemm"]["total"]["n"] >= 3
        ab = block["xla_vs_insort"]  # the pure-XLA A/B, from the same interleaved rounds
        assert ab["ratio_of_medians"] == pytest.approx(
            block["cases"]["xla"]["total"]["median_ms"]
            / block["cases"]["xla_insort"]["total"]["median_ms"]
        )
        assert set(block["vs_alone"]) == timed | {"fbgemm"}  # every timed side, alone too
        for c in block["vs_alone"].values():
            assert c["harness_over_alone"] == pytest.approx(c["harness_ms"] / c["alone_ms"])
    assert wr["alone_ok"]
    for opt, block in wr["train"].items():
        assert block["update_in_place"] and all(block["update_in_place"].values()), opt
        if "auto" in timed:
            ph = block["update_phases"]
            assert set(ph) >= {"records", "sort", "apply"} and ph["unique_rows"] <= 2 * 64 * 4
    roof = wr["roofline"]  # each bandwidth is its case's bytes over its median time
    row, bags, L = roof["row_bytes"], roof["gather_bags"], roof["gather_L"]
    assert roof["copy"]["gbps"] == pytest.approx(
        roof["copy_bytes"] / (roof["copy"]["median_ms"] / 1e3) / 1e9
    )
    pooled_bytes = bags * L * row + bags * row  # the ids' rows read, one row written per bag
    assert roof["gather_pooled"]["gbps"] == pytest.approx(
        pooled_bytes / (roof["gather_pooled"]["median_ms"] / 1e3) / 1e9
    )
    assert roof["roofline_gbps"] == roof["gather_pooled"]["gbps"]
    for key in ("cpu_model", "cores"):
        assert res["machine"][key]
    for key in ("jax", "torch", "fbgemm_gpu"):
        assert res["versions"][key]
    md = (tmp_path / "xla_vs_fbgemm.md").read_text()
    assert "ours / FBGEMM" in md and wr["workload"]["name"] in md and "alone ms" in md
    assert "xla / xla_insort" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "xla_vs_fbgemm.png").read_bytes()[:4] == b"\x89PNG"


class _VirtualTime:
    """Stands in for the `time` module of the harness's clocks: every `perf_counter` read
    advances 1 ms and `sleep` advances by the seconds asked without sleeping, so a case's
    time is a count of its clock reads plus its sleeps, whatever the machine's load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-3
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parity
def test_a_side_slowed_only_inside_the_harness_voids_the_run(tmp_path, fbgemm, monkeypatch):
    """FBGEMM slowed by HARNESS_DELAY_S per repetition inside the harness only: its time alone
    disagrees, the report says VOID and the CLI exits 3, while the sides that were not slowed
    agree. On a virtual clock (the alone run in-process, on the same clock) the times are the
    same on a quiet or a loaded machine; `test_tiny_run_passes_gate_and_writes_outputs` runs
    the alone subprocess for real."""
    from benchmarks import alone, timing

    clock = _VirtualTime()
    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(xla_vs_fbgemm, "time", clock)
    monkeypatch.setattr(alone, "time_alone", lambda spec, timeout_s=None: alone._child(spec))
    rc = xla_vs_fbgemm.main(
        [
            *FAST,
            "--no-memory",
            "--optimizers",
            "sgd",
            "--inject-fault",
            "harness-delay",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 3
    (wr,) = json.loads((tmp_path / "xla_vs_fbgemm.json").read_text())["workloads"]
    assert not wr["alone_ok"]
    for block in (wr["forward"], wr["train"]["sgd"]):
        fb = block["vs_alone"].pop("fbgemm")
        assert not fb["agrees"] and fb["harness_ms"] >= 1e3 * xla_vs_fbgemm.HARNESS_DELAY_S
        assert fb["alone_ms"] < 0.15 * fb["harness_ms"]  # the delay, not the case, made it slow
        assert block["vs_alone"] and all(c["agrees"] for c in block["vs_alone"].values())
    assert "VOID" in (tmp_path / "xla_vs_fbgemm.md").read_text()


def test_clocked_cases_wait_for_asynchronous_jax_work(monkeypatch):
    """A JAX call returns before its work is done. A clocked case's marks and its total wait
    for the arrays they are given / it returns: every clock read that closes a segment finds
    them computed. Checked by readiness at each read, not by durations, so that a loaded
    machine cannot fail it."""
    import time

    import jax
    import jax.numpy as jnp

    from benchmarks import timing
    from benchmarks.timing import clocked

    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 60, lambda i, a: jnp.tanh(a @ a), x))
    x = jnp.full((384, 384), 1e-3, jnp.float32)
    slow(x).block_until_ready()
    pending = []
    for _ in range(3):
        y = slow(x)
        pending.append(not y.is_ready())
        y.block_until_ready()
    assert any(pending)  # the test can tell dispatch from work

    watched, reads = [], []

    class Watching:  # the clock's `time`: each read notes which watched arrays are computed
        @staticmethod
        def perf_counter() -> float:
            reads.append([a.is_ready() for a in watched])
            return time.perf_counter()

    monkeypatch.setattr(timing, "time", Watching)

    def tail(clock):  # marks a fast segment, returns the slow work unmarked
        clock.mark("fwd", jnp.ones(2))
        watched.append(slow(x))
        return watched[-1]

    def inside(clock):
        watched.append(slow(x))
        clock.mark("bwd", watched[-1])

    clocked(tail)()
    assert reads == [[], [], [True]]  # start, fwd, total: the total waited for the slow work
    watched.clear(), reads.clear()
    segments = clocked(inside)()
    assert reads == [[], [True], [True]]  # start, bwd, total
    assert segments["total"] >= segments["bwd"] > 0


def test_our_step_case_waits_for_the_update_it_dispatched(monkeypatch):
    """XlaSide.time_step's clock settles the table and optimizer state the update returns."""
    from benchmarks import timing
    from benchmarks.xla_side import XlaSide

    w = Workload(T=2, E=200, D=8, B=16, L=3)
    side = XlaSide(w, make_batch(w), "xla", "rowwise_adagrad", lr=0.01, eps=1e-8)
    settled = []
    real = timing.settle
    monkeypatch.setattr(timing, "settle", lambda out: (settled.extend(jax_leaves(out)), real(out)))
    timing.clocked(side.time_step)()
    produced = jax_leaves((side.params, side.state))
    assert produced and all(any(a is b for b in settled) for a in produced)


def jax_leaves(tree):
    import jax

    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


@pytest.mark.parity
@pytest.mark.parametrize("fault", ["weights", "update"])
def test_gate_refuses_to_time_wrong_results(tmp_path, fault, fbgemm):
    rc = xla_vs_fbgemm.main(
        [
            *FAST,
            "--no-memory",
            "--optimizers",
            "rowwise_adagrad",
            "--inject-fault",
            fault,
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 1
    res = json.loads((tmp_path / "xla_vs_fbgemm.json").read_text())
    (wr,) = res["workloads"]
    assert not wr["gate_ok"]
    failed = [c["what"] for c in wr["gate"] if not c["ok"]]
    assert failed
    if fault == "weights":
        assert any("pooled output" in f for f in failed)
    else:  # same forward, different update
        assert all("pooled output" not in f for f in failed)
    assert "forward" not in wr and not wr["train"]  # nothing was timed
    assert "GATE FAILED" in (tmp_path / "xla_vs_fbgemm.md").read_text()


def test_gate_close_tolerances():
    b = np.array([1.0, -2.0, 0.0, 1e-9], np.float32)
    assert gate.close("same", b, b)["ok"]
    assert gate.close("1e-5 rel", b * (1 + 1e-5), b)["ok"]
    assert not gate.close("1e-3 rel", b * (1 + 1e-3), b)["ok"]
    assert not gate.close("shape", b[:2], b)["ok"]
    assert not gate.close("nan", np.array([np.nan]), np.array([1.0]))["ok"]
    assert (
        gate.update_rtol("fp32") == gate.RTOL < gate.update_rtol("fp16") < gate.update_rtol("bf16")
    )


def test_zipf_ids_are_distinct_per_bag_and_skewed():
    w = Workload(T=2, E=1000, D=16, B=64, L=4, alpha=1.15)
    batch = make_batch(w)
    bags = batch.ids.reshape(w.T * w.B, w.L)
    assert all(len(set(bag.tolist())) == w.L for bag in bags)
    assert batch.ids.min() >= 0 and batch.ids.max() < w.E
    counts = np.bincount(batch.ids, minlength=w.E)
    assert counts.max() > 10 * counts.mean()  # a few hot rows
    assert w.fwd_bytes() == w.B * w.T * w.L * w.D * 4 + w.B * w.T * w.D * 4


@pytest.mark.parity
def test_memory_worker_reports_peak_rss(fbgemm):
    w = Workload(T=2, E=1000, D=16, B=64, L=4)
    spec = {
        "side": "fbgemm",
        "optimizer": "rowwise_adagrad",
        "lr": 0.01,
        "eps": 1e-8,
        "fbgemm_dtype": None,
        "workload": {k: v for k, v in w.as_dict().items() if k != "name"},
        "steps": 2,
    }
    out = memory.measure_side(spec, timeout_s=600)  # generous: a fresh process on a loaded machine
    assert "error" not in out, out
    assert out["rss_ready"] >= out["rss_base"] > 0
    assert out["peak_steps"] >= out["rss_ready"] - (1 << 20)
    assert out["table_bytes"] == w.table_bytes()


@pytest.fixture
def small_probe(monkeypatch):
    """The quietness probe (a pooled lookup with 1 and 2 torch threads, in a fresh process)
    still runs for real, before and after the timings, on a table of 100,000 rows instead of
    800,000 and 5 rounds instead of 11 (still large enough to gain from a second thread;
    ~2.4 s a probe instead of ~3.7): these tests check the benchmark's code paths and report,
    not whether this machine is quiet (any verdict is accepted)."""
    from benchmarks import e2e_step

    real = e2e_step.quietness_probe
    calls = []

    def probe(rows=None, bags=None, L=20, repeats=None):
        calls.append(rows)
        return real(rows=100_000, bags=2048, L=L, repeats=5)

    monkeypatch.setattr(e2e_step, "quietness_probe", probe)
    return calls


def test_quant_lookup_benchmark_gates_on_fbgemm_and_reports_bytes(capsys, monkeypatch, small_probe):
    from benchmarks import quant_lookup

    small = [
        "--rows",
        "300",
        "--dim",
        "8",
        "--batch",
        "16",
        "--pooling",
        "3",
        "--repeats",
        "2",
        "--alone-repeats",
        "2",
    ]
    assert quant_lookup.main(small) == 0
    assert len(small_probe) == 2  # before and after the timings
    out = capsys.readouterr().out
    assert "quietness probe" in out, out
    # bytes per row at dim 8: int8 8 + 4 (fp16 scale, bias), int4 4 + 4, fp16 16, fp32 32
    for line in ("| int8 | 12 |", "| int4 | 8 |", "| fp16 | 16 |", "| 32 |"):
        assert line in out, out
    real = quant_lookup.fbgemm_case
    monkeypatch.setattr(
        quant_lookup, "fbgemm_case", lambda *a: (lambda r, o: (r, o + 1e-3))(*real(*a))
    )
    with pytest.raises(AssertionError, match="int8: outputs differ"):
        quant_lookup.main(small)


def test_mc_remap_benchmark_gates_on_torchrec_slots_and_reports_both_calls(
    capsys, monkeypatch, small_probe
):
    pytest.importorskip("torchrec.modules.mc_modules")
    from benchmarks import mc_remap

    assert mc_remap.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "first 4 batches equal slot for slot" in out and "quietness probe" in out
    rows = [line for line in out.splitlines() if line.startswith("| 64 | zipf | lru |")]
    assert [r.split("|")[4].strip() for r in rows] == ["train", "eval"], out
    assert all(len(r.split("|")) == 12 and re.search(r"\| [\d.]+x", r) for r in rows), out
    assert all(re.search(r"\| [\d.]+x \|$", r) for r in rows), out  # ours against TorchRec alone
    assert re.search(
        r"hybrid.Model training step \(64 zipf lru\), 32 ids: [\d.]+ ms managed, [\d.]+ ms on a "
        r"plain table; the remap is \d+% of the managed step",
        out,
    ), out
    assert re.search(r"issue 34 \(.*\): (met|NOT met|void \(the machine was contended\))", out)
    real = mc_remap.theirs

    def shifted(case):  # TorchRec's slots, one off: the gate must refuse to time anything
        train, evaluate = real(case)
        return (lambda b: train(b) + 1), evaluate

    monkeypatch.setattr(mc_remap, "theirs", shifted)
    with pytest.raises(AssertionError, match="64 zipf lru: train batch 0"):
        mc_remap.main(["--tiny", "--no-share"])


def test_benchmarks_write_a_fresh_run_directory_unless_told_to_update_the_committed_results(
    tmp_path, capsys, monkeypatch
):
    """`python -m benchmarks.xla_vs_fbgemm --tiny` once replaced benchmarks/results/: now every
    benchmark writes runs/bench/<name>-<time>/ unless --out or --update-results says otherwise."""
    import argparse
    import inspect
    import os
    import pathlib

    from benchmarks import e2e_sharded, e2e_step, e2e_vs_torchrec, report

    root = pathlib.Path(report.__file__).resolve().parent.parent
    assert pathlib.Path(report.RUNS_DIR) == root / "runs" / "bench"  # runs/ is git-ignored
    assert "runs/" in (root / ".gitignore").read_text().split()
    assert pathlib.Path(report.RESULTS_DIR) == root / "benchmarks" / "results"
    monkeypatch.setattr(
        report, "RUNS_DIR", str(tmp_path / "runs" / "bench")
    )  # nothing made in the tree
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    report.add_output_args(parser, "demo")
    default = report.output_dir(parser, parser.parse_args(["--tiny"]), "demo")
    assert os.path.dirname(default) == report.RUNS_DIR and os.path.basename(default).startswith(
        "demo-"
    )
    assert report.RESULTS_DIR not in default and not os.path.exists(default)
    assert (
        report.output_dir(parser, parser.parse_args(["--update-results"]), "demo")
        == report.RESULTS_DIR
    )
    assert report.output_dir(parser, parser.parse_args(["--out", str(tmp_path)]), "demo") == str(
        tmp_path
    )
    for both in (["--out", str(tmp_path), "--update-results"], ["--tiny", "--update-results"]):
        with pytest.raises(SystemExit):
            report.output_dir(parser, parser.parse_args(both), "demo")
    assert "--update-results" in capsys.readouterr().err
    os.makedirs(default)
    assert report.fresh_run_dir("demo") != default  # never an existing directory
    os.rmdir(default)

    assert os.path.dirname(xla_vs_fbgemm.parse_args(["--tiny"]).out) == report.RUNS_DIR
    for module in (e2e_sharded, e2e_step, e2e_vs_torchrec):
        assert inspect.signature(module.run).parameters["out_dir"].default is None, module.__name__
    # every benchmark CLI with an output directory takes it from report (no default of its own)
    here = pathlib.Path(report.__file__).parent
    writers = [p for p in here.glob("*.py") if p.name != "report.py" and '"--out"' in p.read_text()]
    assert all("report.add_output_args(" in p.read_text() for p in writers), writers
    with_helper = sorted(
        p.stem for p in here.glob("*.py") if "report.add_output_args(" in p.read_text()
    )
    assert with_helper == [
        "criteo_scale",
        "e2e_sharded",
        "e2e_step",
        "e2e_vs_torchrec",
        "explore_malloc",
        "explore_update",
        "first_epoch",
        "gpu",
        "gpu_readiness",
        "mc_quality",
        "serving_load",
        "stream_throughput",
        "xla_vs_fbgemm",
    ]


def test_mc_quality_tiny_trains_every_policy_on_both_libraries(tmp_path):
    """`python -m benchmarks.mc_quality --tiny`: each hybridrec eviction policy and TorchRec's
    LRU, LFU and DistanceLFU trained on MovieLens raw ids (3 steps, one seed, one size), their
    eval AUCs in the JSON and the Markdown table, and both sides admitting the same ids."""
    pytest.importorskip("torchrec.modules.mc_modules")
    from benchmarks import mc_quality

    assert mc_quality.main(["--tiny", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "mc_quality_tiny.json").read_text())
    [size] = results["sizes"]
    cells = results["table"][size["label"]]
    kinds = {lib: {mc_quality.POLICIES[p][0] for p in cells[lib]} for lib in cells}
    assert kinds == {
        "hybridrec": {"lru", "lfu", "distance_lfu", "ttl"},
        "torchrec": {"lru", "lfu", "distance_lfu"},
    }
    for lib, policies in cells.items():
        for policy, c in policies.items():
            assert len(c["seeds"]) == 1 and 0.0 < c["median"] < 1.0, (lib, policy, c)
            assert c["min"] <= c["median"] <= c["max"]
            assert c["admitted"][0]["t_user"] > 0, (lib, policy, c)
    for policy, c in cells["torchrec"].items():  # the same remap: the same ids admitted
        assert c["admitted"] == cells["hybridrec"][policy]["admitted"], policy
    md = (tmp_path / "mc_quality_tiny.md").read_text()
    for lib, policies in cells.items():
        for policy in policies:
            assert re.search(rf"\| {lib} {policy} \| 0\.\d{{4}} \[", md), md
    [verdict] = results["verdicts"]
    assert verdict["ours_best"] in cells["hybridrec"]
    assert verdict["torchrec_best"] in cells["torchrec"]
    assert re.search(r"- 50%: hybridrec \S+ 0\.\d{4} is (NOT )?above TorchRec", md), md
    assert "the same on both sides" in md


def test_first_epoch_tiny_reads_build_and_epoch_times_of_both_configs(tmp_path, capsys):
    """`python -m benchmarks.first_epoch --tiny`: the training script run on the managed
    MovieLens config, its metrics' build and per-epoch records read back."""
    from benchmarks import first_epoch

    first_epoch.main(["--tiny", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "first_epoch.json").read_text())
    assert "plain" not in result
    for name in ("managed",):
        [one] = result[name]["runs"]
        assert len(one["epochs_s"]) == 2 and all(s > 0 for s in one["epochs_s"])
        assert one["build_s"] > 0
        ratio = one["epochs_s"][0] / one["epochs_s"][1]
        assert result[name]["first_over_later"] == pytest.approx(ratio)
    assert result["quiet"] is False  # --tiny never probes: its figures are never quoted
    assert "VOID" in (tmp_path / "first_epoch.md").read_text()
