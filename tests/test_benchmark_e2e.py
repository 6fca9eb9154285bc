"""The end-to-end benchmark against TorchRec's DMP runs at tiny size and passes its gate."""

import json

import pytest


@pytest.fixture
def torchrec():
    pytest.importorskip("fbgemm_gpu")
    return pytest.importorskip("torchrec")


@pytest.mark.parity
@pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)
def test_e2e_tiny_gate_and_outputs(tmp_path, monkeypatch, torchrec):
    import hybrid
    from benchmarks import e2e_vs_torchrec

    waits = []  # every timed round of ours ends by waiting for the sparse update it started
    real = hybrid.Model.wait_for_sparse_update
    monkeypatch.setattr(
        hybrid.Model, "wait_for_sparse_update", lambda self: (waits.append(1), real(self))[1]
    )
    result = e2e_vs_torchrec.run(tiny=True, out_dir=tmp_path)
    w = e2e_vs_torchrec._workload(True)
    assert len(waits) == 1 + w["steps"] // w["steps_per_round"]  # warm-up + timed rounds
    assert result["gate"]["loss_rel_err"] <= 1e-4 and result["gate"]["table_rel_err"] <= 1e-4
    assert set(result["median_step_s"]) == {"hybridrec", "torchrec"}
    assert json.loads((tmp_path / "e2e_tiny.json").read_text())["workload"]["T"] == 3
    assert "| hybridrec |" in (tmp_path / "e2e_tiny.md").read_text()


@pytest.mark.parity
@pytest.mark.multiprocess
def test_e2e_sharded_tiny_gate(tmp_path, torchrec):
    from benchmarks import e2e_sharded

    result = e2e_sharded.run(tiny=True, out_dir=tmp_path)
    assert result["first_step_loss"]["rel_err"] <= 1e-4
    assert (tmp_path / "e2e_sharded_tiny.json").exists()
    # a rank that aborted in teardown after finishing is accepted, and the result says so
    assert all("in teardown, after all" in note for note in result["torchrec_teardown"])


def test_e2e_sharded_forgives_a_teardown_abort_only_after_the_rank_finished(tmp_path):
    """A TorchRec rank sometimes aborts at interpreter teardown ("terminate called without an
    active exception", exit -6) after its work was written: accepted, with a note. A rank
    that died before writing its done file, or wrote it for fewer steps, fails the run."""
    from benchmarks.e2e_sharded import _check_ranks, _done_path

    out = tmp_path / "theirs.json"
    assert _check_ranks([0, 0], out, steps=4) == []
    _done_path(out, 0).write_text(json.dumps({"rank": 0, "steps": 4}))
    (note,) = _check_ranks([-6, 0], out, steps=4)
    assert note.startswith("TorchRec rank 0 exited with code -6 in teardown, after all 4 steps")
    with pytest.raises(
        RuntimeError,
        match=r"exit codes \[0, -6\]\): rank 1 exited with code -6 "
        r"before finishing its 4 steps \(done file: None\)",
    ):
        _check_ranks([0, -6], out, steps=4)  # rank 1 never wrote its done file
    _done_path(out, 1).write_text(json.dumps({"rank": 1, "steps": 2}))
    with pytest.raises(RuntimeError, match="rank 1 exited with code 1 before finishing"):
        _check_ranks([0, 1], out, steps=4)  # done file, but for fewer steps than the run's


@pytest.mark.parity
def test_the_one_process_torchrec_side_needs_no_port(torchrec):
    """A single-process gloo group opened on a TCP store at a chosen port failed a whole
    `make test` when another process held that port (EADDRINUSE): the one-process side opens
    its group with no port, so a held MASTER_PORT changes nothing."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(held.getsockname()[1]))
        code = (
            "import torch.distributed as dist\n"
            "from benchmarks import e2e_vs_torchrec as e2e\n"
            "e2e._torchrec_side(e2e._workload(True), 0.01)\n"
            "assert dist.is_initialized() and dist.get_world_size() == 1\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
    assert run.returncode == 0, run.stderr[-2000:]
