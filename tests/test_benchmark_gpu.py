"""`python -m benchmarks.gpu` cannot rot: on CPU its smoke run executes every case (Pallas in
interpret mode, tiny shapes) and its checks hold; on a GPU the same code times W1."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu
from benchmarks.workloads import tiny_set


def test_the_gpu_benchmark_runs_in_interpret_mode_and_its_checks_hold(
    tmp_path, capsys, monkeypatch
):
    # the Zipf workload only: uniform ids run the same code, and its duplicated ids are the
    # ones that make runs longer than one position
    monkeypatch.setattr(gpu, "tiny_set", lambda: [w for w in tiny_set() if w.alpha > 1.0])
    results = gpu.main(["--tiny", "--out", str(tmp_path)])
    assert [w["workload"]["alpha"] for w in results["workloads"]] == [1.15]
    assert results["interpret"] is True
    assert json.loads((tmp_path / "gpu.json").read_text())["workloads"]
    md = (tmp_path / "gpu.md").read_text()
    assert (
        "INTERPRET MODE" in md
        and "forward pallas" in md
        and "library forward + guarded update" in md
    )
    for entry in results["workloads"]:
        checks = entry["checks"]
        assert checks["forward_max_abs_diff"] < 1e-5, checks
        assert (
            checks["rowwise_adagrad_max_abs_diff"] < 1e-5 and checks["sgd_max_abs_diff"] < 1e-5
        ), checks
        assert (
            checks["rowwise_adagrad_bitwise_reproducible"] and checks["sgd_bitwise_reproducible"]
        ), checks
        for weight_type, q in entry["quantized"].items():  # interpret mode: the XLA form's bits
            assert q["checks"]["bitwise_equal"] and q["checks"]["reproducible"], (weight_type, q)
            assert set(q["forward"]) >= {"pallas", "xla"} == set(q["launches"]), q
        assert "quantized forward int8 pallas" in md and "quantized forward int4 xla" in md
        launches = entry["update_launches"]["rowwise_adagrad"]["pallas"]
        assert launches["sorts"] + launches["custom_calls"] >= 1  # the sort is in the program


def test_without_a_gpu_the_full_run_is_refused_with_the_way_out():
    with pytest.raises(SystemExit):
        gpu.main([])
