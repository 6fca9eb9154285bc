"""Checkpoints: exact resume after SIGKILL, and reshard on load (another mesh and plan)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hybrid import checkpoint, train
from hybrid.training import load_config

SMALL = [
    "data.source=synthetic",
    "data.num_samples=2048",
    "data.num_eval_samples=1024",
    "data.num_sparse=4",
    "data.num_dense=3",
    "data.num_embeddings=200",
    "train.batch_size=128",
    "train.eval_batch_size=512",
    "sparse_optimizer.lr=0.1",
]


def _losses(path):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    steps, every = 120, 20
    common = [*SMALL, "log.every=1", f"checkpoint.every={every}", "train.mesh='data=2,model=4'"]
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    argv = [
        sys.executable,
        "-m",
        "hybrid.train",
        "--config",
        "configs/synthetic.toml",
        "--steps",
        str(steps),
        *(f"--set={s}" for s in common),
        f"--set=checkpoint.dir='{ckpt}'",
        f"--set=log.metrics_path='{metrics}'",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the script asks for the mesh's 8 CPU devices itself
    log = tmp_path / "first_run.log"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        latest = checkpoint.latest_checkpoint(ckpt)
        if latest is not None and int(latest.name[5:]) >= 2 * every:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-2000:]
    killed_at = max(_losses(metrics))
    assert 2 * every <= killed_at < steps
    resumed = subprocess.run(
        [*argv, "--resume"], env=env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    after = _losses(metrics)
    assert sorted(after) == list(range(1, steps + 1))

    reference = train.run(
        load_config(
            "configs/synthetic.toml", [*common, f"train.steps={steps}", "log.metrics_path=''"]
        ),
        echo=lambda *_: None,
    )
    np.testing.assert_array_equal(
        [after[s] for s in range(1, steps + 1)],
        [reference["losses"][s] for s in range(1, steps + 1)],
    )


def _trained(tmp_path, mesh, sharding):
    config = load_config(
        None,
        [
            *SMALL,
            "train.steps=24",
            f"train.mesh='{mesh}'",
            f"train.sharding={sharding}",
            f"checkpoint.dir='{tmp_path / 'ckpt'}'",
        ],
    )
    return config, train.run(config, echo=lambda *_: None)


@pytest.mark.parametrize(
    ("mesh", "sharding"),
    [
        (
            "model=8",
            "{t_cat_0='table_wise', t_cat_1='data_parallel', t_cat_2='row_wise', t_cat_3='column_wise'}",
        ),
        ("", "{}"),
    ],
    ids=["model=8", "one-device"],
)
def test_reshard_on_load_keeps_metrics_and_optimizer_state(tmp_path, mesh, sharding):
    written = (
        "{t_cat_0='row_wise', t_cat_1='table_wise', t_cat_2='data_parallel', t_cat_3='row_wise'}"
    )
    config, result = _trained(tmp_path, "data=2,model=4", written)
    path = checkpoint.latest_checkpoint(tmp_path / "ckpt")
    assert path.name == "step_00000024"
    meta = checkpoint.verify_checkpoint(path)  # where it was written, for the record
    assert meta["mesh"] == {"data": 2, "model": 4} and meta["step"] == 24
    assert meta["plan"] is not None and {"t_cat_0", "t_cat_3"} <= set(
        json.dumps(meta["plan"]).replace('"', " ").split()
    )
    with np.load(path / "tables.npz") as f:
        saved = {k: f[k] for k in f.files}

    other = load_config(None, [*SMALL, f"train.mesh='{mesh}'", f"train.sharding={sharding}"])
    model, dense_opt, _, evaluation, _ = train.build(other)
    checkpoint.load_checkpoint(path, model=model, dense_optimizer=dense_opt)
    metrics = train.evaluate(model, evaluation, other.train.eval_batch_size)
    for key in ("auc", "log_loss", "ne", "accuracy"):
        assert metrics[key] == pytest.approx(result["eval"][key], rel=1e-5, abs=1e-6), key

    loaded = checkpoint.sparse_state_arrays(model)
    # every table's weights come back as the file holds them, on the new mesh and plan
    weights = {k for k in saved if k.startswith("weight/")}
    assert weights == {f"weight/t_cat_{i}" for i in range(4)} and weights <= set(loaded)
    compared = 0
    for key, value in saved.items():
        if key in loaded:  # same column blocks: the state comes back as written
            np.testing.assert_allclose(loaded[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
            compared += 1
    assert compared >= len(weights) + 3  # weights, most states and the step count
    states = [k for k in saved if k.startswith("state/")]
    assert states and all(np.any(saved[k] > 0) for k in states)  # trained, not fresh
    if mesh == "model=8":  # t_cat_3 column-sharded now: each block takes the row's value
        blocks = [k for k in loaded if k.startswith("state/t_cat_3/")]
        assert len(blocks) > 1
        for k in blocks:
            np.testing.assert_allclose(
                loaded[k], saved["state/t_cat_3/momentum1/cols_0_16"], rtol=1e-6
            )
    assert int(loaded["count"]) == int(saved["count"]) == 24


def test_checkpoint_load_rejects_another_optimizer(tmp_path):
    _trained(tmp_path, "data=8", "{}")
    other = load_config(None, [*SMALL, "train.mesh='data=8'", "sparse_optimizer.name=adagrad"])
    model, dense_opt, *_ = train.build(other)
    with pytest.raises(ValueError, match="written with sparse optimizer 'rowwise_adagrad'"):
        checkpoint.load_checkpoint(
            checkpoint.latest_checkpoint(tmp_path / "ckpt"), model=model, dense_optimizer=dense_opt
        )
