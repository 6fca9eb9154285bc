"""The XLA-vs-FBGEMM harness (benchmarks/) at tiny sizes: gate, failure on wrong inputs, outputs.

Runs the CLI in-process (`benchmarks.xla_vs_fbgemm.main`) on one tiny workload with few
repeats; the memory subprocess path is exercised once, on its own. Tests that run FBGEMM
are marked `parity` and skip without fbgemm_gpu.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import gate, memory, xla_vs_fbgemm
from benchmarks.workloads import Workload, make_batch


@pytest.fixture
def fbgemm():
    return pytest.importorskip("fbgemm_gpu")


FAST = ["--tiny", "--alpha", "1.15", "--repeats", "3", "--warmup", "1", "--budget-s", "2", "--quiet"]


@pytest.mark.parity
def test_tiny_run_passes_gate_and_writes_outputs(tmp_path, fbgemm):
    rc = xla_vs_fbgemm.main([*FAST, "--no-memory", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "xla_vs_fbgemm.json").read_text())
    (wr,) = res["workloads"]
    assert wr["gate_ok"] and wr["gate"] and all(c["ok"] for c in wr["gate"])
    # per path of ours: pooled output, weights after one update per optimizer, row state (adagrad)
    ours = [p for p in ("auto", "xla", "reference") if p in wr["forward"]["cases"]]
    assert {"xla", "reference"} <= set(ours)
    assert len(wr["gate"]) == 3 * len(ours) + 2 * len(ours)
    for block in [wr["forward"], *wr["train"].values()]:
        assert set(block["ratios"]) >= {"xla"}
        assert block["ratios"]["xla"]["ratio_of_medians"] > 0
        assert block["cases"]["fbgemm"]["total"]["n"] >= 3
    assert set(wr["train"]) == {"rowwise_adagrad", "sgd"}
    assert all(wr["train"]["rowwise_adagrad"]["update_in_place"].values())
    assert wr["roofline"]["copy"]["gbps"] > 0 and wr["roofline"]["gather_pooled"]["gbps"] > 0
    for key in ("cpu_model", "cores"):
        assert res["machine"][key]
    for key in ("jax", "torch", "fbgemm_gpu"):
        assert res["versions"][key]
    md = (tmp_path / "xla_vs_fbgemm.md").read_text()
    assert "ours / FBGEMM" in md and wr["workload"]["name"] in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "xla_vs_fbgemm.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parity
@pytest.mark.parametrize("fault", ["weights", "update"])
def test_gate_refuses_to_time_wrong_results(tmp_path, fault, fbgemm):
    rc = xla_vs_fbgemm.main([*FAST, "--no-memory", "--optimizers", "rowwise_adagrad",
                             "--inject-fault", fault, "--out", str(tmp_path)])
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
    assert gate.update_rtol("fp32") == gate.RTOL < gate.update_rtol("fp16") < gate.update_rtol("bf16")


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
    spec = {"side": "fbgemm", "optimizer": "rowwise_adagrad", "lr": 0.01, "eps": 1e-8, "fbgemm_dtype": None,
            "workload": {k: v for k, v in w.as_dict().items() if k != "name"}, "steps": 2}
    out = memory.measure_side(spec, timeout_s=120)
    assert "error" not in out, out
    assert out["rss_ready"] >= out["rss_base"] > 0
    assert out["peak_steps"] >= out["rss_ready"] - (1 << 20)
    assert out["table_bytes"] == w.table_bytes()
