"""`torchrun --nproc-per-node 2 -m hybrid.train` on loopback (gloo) matches one process."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hybrid.training._distributed import free_master_port

ARGS = [
    "--config=configs/synthetic.toml",
    "--steps=8",
    "--mesh=data=2",
    "--set=log.every=1",
    "--set=data.source=synthetic",
    "--set=data.num_samples=2048",
    "--set=data.num_eval_samples=1024",
    "--set=data.num_sparse=4",
    "--set=data.num_dense=3",
    "--set=data.num_embeddings=200",
    "--set=train.batch_size=128",
    "--set=train.eval_batch_size=512",
]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.multiprocess
def test_two_processes_match_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    single = subprocess.run(
        [sys.executable, "-m", "hybrid.train", *ARGS, f"--set=log.metrics_path='{one}'"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    multi = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={free_master_port()}",
            "-m",
            "hybrid.train",
            # no --mesh, as the README's torchrun command: several processes default to
            # data=<every device>, the single run's mesh; each process reads only its share
            *(a for a in ARGS if not a.startswith("--mesh")),
            f"--set=log.metrics_path='{two}'",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert multi.returncode == 0, multi.stderr[-3000:]
    a, b = _records(one), _records(two)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    losses = [[r["loss"] for r in rs if r["kind"] == "train"] for rs in (a, b)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    evals = [next(r for r in rs if r["kind"] == "eval") for rs in (a, b)]
    for key in ("auc", "log_loss", "ne", "accuracy"):
        assert evals[1][key] == pytest.approx(evals[0][key], rel=1e-5), key
