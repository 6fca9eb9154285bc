"""The end-to-end benchmark against TorchRec's DMP runs at tiny size and passes its gate."""

import json

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")


@pytest.mark.parity
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_e2e_tiny_gate_and_outputs(tmp_path, monkeypatch):
    import hybrid
    from benchmarks import e2e_vs_torchrec

    waits = []  # every timed round of ours ends by waiting for the sparse update it started
    real = hybrid.Model.wait_for_sparse_update
    monkeypatch.setattr(hybrid.Model, "wait_for_sparse_update", lambda self: (waits.append(1), real(self))[1])
    result = e2e_vs_torchrec.run(tiny=True, out_dir=tmp_path)
    w = e2e_vs_torchrec._workload(True)
    assert len(waits) == 1 + w["steps"] // w["steps_per_round"]  # warm-up + timed rounds
    assert result["gate"]["loss_rel_err"] <= 1e-4 and result["gate"]["table_rel_err"] <= 1e-4
    assert set(result["median_step_s"]) == {"hybridrec", "torchrec"}
    assert json.loads((tmp_path / "e2e_tiny.json").read_text())["workload"]["T"] == 3
    assert "| hybridrec |" in (tmp_path / "e2e_tiny.md").read_text()


@pytest.mark.parity
@pytest.mark.multiprocess
def test_e2e_sharded_tiny_gate(tmp_path):
    from benchmarks import e2e_sharded

    result = e2e_sharded.run(tiny=True, out_dir=tmp_path)
    assert result["first_step_loss"]["rel_err"] <= 1e-4
    assert (tmp_path / "e2e_sharded_tiny.json").exists()
