"""`python -m benchmarks.serving_load --tiny --format binary`, run in-process so it cannot
rot: a server subprocess on 127.0.0.1 answers every client request (safetensors bodies) of
both request sizes, reloads twice under load without failing one (the requests reach all
three models), answers every garbage request with a 4xx and is still healthy after; the run
writes its JSON and Markdown. The JSON and binary bodies hold the same request. No figure is
asserted (the machine is shared: the numbers of a smoke run mean nothing)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import safetensors.numpy

from benchmarks import serving_load


def test_tiny_load_run_reloads_under_load_and_answers_garbage_with_4xx(tmp_path):
    assert serving_load.main(["--tiny", "--format", "binary", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "serving_load.json").read_text())
    assert result["ok"] and not result["failures"]
    assert [(p["server"], p["samples"]) for p in result["phases"]] == [("ours", 1), ("ours", 4)]
    for phase in result["phases"]:
        assert phase["summary"]["requests"] > 0 and phase["summary"]["errors"] == 0
    reload_phase = result["reload_phase"]
    assert [r["status"] for r in reload_phase["reloads"]] == [200, 200]
    assert reload_phase["load"]["errors"] == 0
    assert set(reload_phase["load"]["model_generations"]) == {"1", "2", "3"}
    garbage = reload_phase["garbage"]
    assert garbage["sent"] >= 7 and garbage["answered_4xx"] == garbage["sent"]
    assert reload_phase["healthz_after"] == 200
    text = (tmp_path / "serving_load.md").read_text()
    assert "| ours | 4 |" in text and "Checks: passed" in text and "not run (--tiny" in text
    assert "binary requests" in text


def test_the_json_and_binary_bodies_hold_the_same_request():
    args = serving_load._parser().parse_args(["--tables", "2", "--rows", "50", "--pooling", "3"])
    as_json = json.loads(serving_load._body(args, 4))
    binary = argparse.Namespace(**{**vars(args), "format": "binary"})
    arrays = safetensors.numpy.load(serving_load._body(binary, 4))
    np.testing.assert_allclose(arrays["dense"], as_json["dense"], rtol=1e-6)
    for f, bags in as_json["sparse"].items():
        assert arrays[f"{f}.values"].tolist() == [i for bag in bags for i in bag]
        assert arrays[f"{f}.lengths"].tolist() == [len(bag) for bag in bags] == [3] * 4
