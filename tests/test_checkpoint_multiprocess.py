"""Checkpoints written by every process (the "orbax" format, hybrid/checkpoint/_sharded.py):
2 processes x 4 CPU devices (torchrun, gloo on loopback) and 1 process x 8 devices, one mesh.

One uninterrupted single-process run is the reference. A 2-process run resumes from its
step-2 checkpoint (1 -> 2 processes), saves step 4, and one rank is killed with SIGKILL
during the asynchronous save of step 6; the run then resumes from step 4 (the last committed)
on 2 processes (the same layout: read shard by shard), on 1 process with another mesh
(data=2 x model=4: another plan, read whole and resharded) and on 2 processes with
model=4 x data=2 (resharded into global arrays, a table on one process), and every following step equals the reference: tables,
optimizer state and step count, a managed-collision table's id maps, dense weights, dense optimizer, losses (the data position is
the step here: each process reads its share of batch `step`). A damaged or missing shard
file is detected and the previous checkpoint used.
"""

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybrid import train
from hybrid.checkpoint import CheckpointError, checkpoint_arrays, latest_checkpoint
from hybrid.checkpoint import verify_checkpoint as verify
from hybrid.training import ConfigError, load_config
from hybrid.training._distributed import free_master_port

pytest.importorskip("orbax.checkpoint")

ROOT = pathlib.Path(__file__).resolve().parents[1]

SETTINGS = [
    "data.source='synthetic'",
    "data.num_samples=2048",
    "data.num_eval_samples=128",
    "data.num_sparse=3",
    "data.num_dense=3",
    "data.num_embeddings=400",
    "train.batch_size=128",
    "train.eval_batch_size=128",
    "train.mesh='data=4,model=2'",
    "train.sharding={t_cat_0='row_wise', t_cat_1='table_wise'}",
    "managed_collision.tables={t_cat_2=96}",  # its id maps are saved, resumed and resharded too
    "train.steps=8",
    "train.eval_every=0",
    "log.every=2",
    "log.metrics_path=''",
    "checkpoint.every=2",
    "checkpoint.keep=5",
    "checkpoint.format='orbax'",
]


def _config(directory, *extra):
    return load_config(
        "configs/synthetic.toml", [*SETTINGS, f"checkpoint.dir='{directory}'", *extra]
    )


def _two_processes(directory, *extra, kill_step=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT)  # this checkout, not an installed copy
    if kill_step is not None:
        env.update(KILL_RANK="1", KILL_STEP=str(kill_step))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={free_master_port()}",
            "tests/mp_checkpoint_worker.py",
            "--config=configs/synthetic.toml",
            "--resume",
            *(f"--set={s}" for s in SETTINGS),
            f"--set=checkpoint.dir='{directory}'",
            *(f"--set={s}" for s in extra),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_same(got, want):
    """Two checkpoints hold the same training state."""
    a, b = checkpoint_arrays(got), checkpoint_arrays(want)
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
    da, db = (torch.load(p / "dense.pt", weights_only=True) for p in (got, want))
    for key in db["dense"]:
        torch.testing.assert_close(da["dense"][key], db["dense"][key], rtol=1e-5, atol=1e-6)
    for x, y in zip(
        da["optimizer"]["state"].values(), db["optimizer"]["state"].values(), strict=True
    ):
        for key in y:
            torch.testing.assert_close(x[key], y[key], rtol=1e-5, atol=1e-6)
    ma, mb = (json.loads((p / "meta.json").read_text()) for p in (got, want))
    assert ma["step"] == mb["step"]
    np.testing.assert_allclose(
        ma["loss_tracker"]["recent"], mb["loss_tracker"]["recent"], rtol=1e-5
    )


def _copy_run(src, dst, *steps):
    dst.mkdir()
    shutil.copy(src / "run.json", dst / "run.json")
    for step in steps:
        shutil.copytree(src / f"step_{step:08d}", dst / f"step_{step:08d}")


@pytest.mark.multiprocess
def test_killed_during_async_save_resumes_on_two_and_on_one_process(tmp_path, caplog):
    ref = tmp_path / "reference"
    train.run(_config(ref))  # uninterrupted: 1 process x 8 devices, steps 2, 4, 6, 8 saved
    assert meta_of(ref / "step_00000008")["processes"] == 1

    killed = tmp_path / "killed"
    _copy_run(ref, killed, 2)  # resumed from 1 process onto 2
    crash = _two_processes(killed, kill_step=6)
    assert crash.returncode != 0, crash.stderr[-3000:]
    assert latest_checkpoint(killed) == killed / "step_00000004"  # 6 was never committed
    assert not (killed / "step_00000006").exists()
    assert any(p.name.startswith(".tmp-step_00000006") for p in killed.iterdir())
    assert meta_of(killed / "step_00000004")["processes"] == 2
    files = json.loads((killed / "step_00000004" / "manifest.json").read_text())["files"]
    assert {f.split("/")[1] for f in files if "ocdbt.process_" in f} == {
        "ocdbt.process_0",
        "ocdbt.process_1",
    }  # each process wrote its own shards
    _assert_same(killed / "step_00000004", ref / "step_00000004")

    one, other = tmp_path / "one", tmp_path / "other"
    shutil.copytree(killed, one)
    shutil.copytree(killed, other)
    resumed = _two_processes(killed)  # 2 processes from step 4
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step_00000004 at step 4" in resumed.stdout
    for step in (6, 8):
        _assert_same(killed / f"step_{step:08d}", ref / f"step_{step:08d}")

    # 1 process from the 2-process step 4, onto another mesh and plan (reshard on load)
    result = train.run(_config(one, "train.mesh='data=2,model=4'"), resume=True)
    assert sorted(result["losses"]) == [5, 6, 7, 8]
    for step in (6, 8):
        _assert_same(one / f"step_{step:08d}", ref / f"step_{step:08d}")

    # 2 processes from the 2-process step 4, onto another mesh and plan whose table-wise
    # table lives on one process's devices: the checkpoint is resharded into global arrays
    # that neither process can read whole (this crashed before)
    moved = _two_processes(other, "train.mesh='model=4,data=2'")
    assert moved.returncode == 0, moved.stderr[-3000:]
    for step in (6, 8):
        _assert_same(other / f"step_{step:08d}", ref / f"step_{step:08d}")

    # a damaged or missing shard file: found, and the previous checkpoint used
    newest = one / "step_00000008"
    shard = max(
        (p for p in newest.rglob("*") if p.is_file() and "/d/" in p.as_posix()),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="hash mismatch"):
        verify(newest)
    with caplog.at_level(logging.WARNING, logger="hybrid.checkpoint"):
        assert latest_checkpoint(one) == one / "step_00000006"
    assert "step_00000008" in caplog.text
    (one / "step_00000006" / shard.relative_to(newest)).unlink(missing_ok=True)
    next(
        p
        for p in (one / "step_00000006" / "sparse").rglob("*")
        if "/d/" in p.as_posix() and p.is_file()
    ).unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        verify(one / "step_00000006")
    assert latest_checkpoint(one) == one / "step_00000004"


def meta_of(path):
    return json.loads((path / "meta.json").read_text())


class _Stream:
    """Stands for a `CriteoStream`: records the position it is restored to."""

    def restore(self, state):
        self.state = state


def test_each_process_resumes_its_own_stream_position_and_only_on_as_many_processes():
    stream = _Stream()
    train._restore_stream(stream, {"data_streams": [{"rank": 0}]}, "step_00000004")
    assert stream.state == {"rank": 0}  # process 0 of 1 takes the first position
    with pytest.raises(ConfigError, match="written by 2 processes.*this run has 1.*on 2 processes"):
        train._restore_stream(stream, {"data_streams": [{"rank": 0}, {"rank": 1}]}, "step_4")
