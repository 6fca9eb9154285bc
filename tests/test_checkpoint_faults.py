"""Checkpoints never lose work: run identity, verified files, preflight, fault injection."""

import hashlib
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
import torch

import hybrid
from hybrid import checkpoint, train
from hybrid._files import sha256_file
from hybrid.checkpoint import CheckpointError, _arrays, _format, _preflight, _store
from hybrid.training import ConfigError, load_config

SMALL = [
    "data.source=synthetic",
    "data.num_samples=1024",
    "data.num_eval_samples=256",
    "data.num_sparse=3",
    "data.num_dense=3",
    "data.num_embeddings=64",
    "train.batch_size=64",
    "train.eval_batch_size=256",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[8, 8]",
    "model.over_arch_layer_sizes=[8, 1]",
    "sparse_optimizer.lr=0.1",
    "log.every=1",
]
FILES = ("tables.npz", "dense.pt", "meta.json", "manifest.json")


def _quiet(*_args):
    pass


def _config(ckpt, *extra, steps=8, every=4):
    return load_config(
        None,
        [
            *SMALL,
            f"train.steps={steps}",
            f"checkpoint.every={every}",
            f"checkpoint.dir='{ckpt}'",
            *extra,
        ],
    )


def _run(ckpt, *extra, resume=False, **kw):
    lines = []
    result = train.run(_config(ckpt, *extra, **kw), resume=resume, echo=lines.append)
    return result, "\n".join(map(str, lines))


def _snapshot(root):
    """{relative path: sha256} of every file under root."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _damage(path, how):
    if how == "flip":
        data = bytearray(path.read_bytes())
        for i in range(len(data) // 2, min(len(data), len(data) // 2 + 8)):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    else:
        path.unlink()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 8-step run with checkpoints at steps 4 and 8 (copied per test)."""
    ckpt = tmp_path_factory.mktemp("trained") / "ckpt"
    result, _ = _run(ckpt)
    return ckpt, result


@pytest.fixture
def ckpt(trained, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(trained[0], path)
    return path


@pytest.fixture(scope="module")
def fresh_model():
    model, dense_opt, *_ = train.build(load_config(None, SMALL))
    return model, dense_opt


def test_run_json_and_manifest_are_written(ckpt):
    run = json.loads((ckpt / "run.json").read_text())
    assert run["config"]["seed"] == 0 and run["run_id"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["run.json", "step_00000004", "step_00000008"]
    for step in ("step_00000004", "step_00000008"):
        meta = checkpoint.verify_checkpoint(ckpt / step)
        assert meta["run_id"] == run["run_id"]
        manifest = json.loads((ckpt / step / "manifest.json").read_text())
        assert manifest["version"] == 1 and sorted(manifest["files"]) == [
            "dense.pt",
            "meta.json",
            "tables.npz",
        ]
        files = json.loads((ckpt / step / "manifest.json").read_text())["files"]
        assert sorted(files) == ["dense.pt", "meta.json", "tables.npz"]


def test_fresh_run_into_used_dir_refuses_and_deletes_nothing(ckpt):
    before = _snapshot(ckpt)
    run_id = json.loads((ckpt / "run.json").read_text())["run_id"]
    with pytest.raises(ConfigError) as e:
        _run(ckpt)
    message = str(e.value)
    for part in (str(ckpt), run_id, "--resume", "another checkpoint.dir", "checkpoint.overwrite"):
        assert part in message
    assert _snapshot(ckpt) == before
    assert hybrid.CheckpointError is CheckpointError


def test_overwrite_moves_the_old_run_aside(ckpt):
    before = _snapshot(ckpt)
    _, out = _run(ckpt, "checkpoint.overwrite=true", steps=4, every=0)
    (aside,) = [p for p in ckpt.iterdir() if p.name.startswith(".replaced-")]
    assert _snapshot(aside) == before  # the old run's files, intact
    run = json.loads((aside / "run.json").read_text())
    assert (
        f"checkpoint.overwrite: moved the checkpoints of run {run['run_id']} (created {run['created']}) "
        f"(step_00000004, step_00000008) aside to {aside}; delete it yourself to free the space"
    ) in out.splitlines()
    assert sorted(p.name for p in _format._step_dirs(ckpt)) == ["step_00000004"]
    new_id = json.loads((ckpt / "run.json").read_text())["run_id"]
    assert _preflight._run_id_of(ckpt / "step_00000004") == new_id


def test_rotation_keeps_newest_intact_and_never_another_runs(ckpt, tmp_path, fresh_model):
    model, dense_opt = fresh_model
    run_id = json.loads((ckpt / "run.json").read_text())["run_id"]
    other = tmp_path / "other"
    checkpoint.save_checkpoint(other, step=900, model=model, dense_optimizer=dense_opt)
    shutil.copytree(other / "step_00000900", ckpt / "step_00000900")  # another run's, copied in
    # the newest of this run is damaged: the next save must keep step 4 (newest intact
    # before it) and drop the damaged step 8
    _damage(ckpt / "step_00000008" / "tables.npz", "flip")
    save = dict(model=model, dense_optimizer=dense_opt, run_id=run_id, keep=2)
    checkpoint.save_checkpoint(ckpt, step=12, **save)
    names = [p.name for p in _format._step_dirs(ckpt)]
    assert names == ["step_00000004", "step_00000012", "step_00000900"]
    checkpoint.save_checkpoint(ckpt, step=16, **{**save, "keep": 1})
    names = [p.name for p in _format._step_dirs(ckpt)]
    assert names == ["step_00000016", "step_00000900"]  # another run's step 900 survives
    with pytest.raises(CheckpointError, match="belongs to run"):
        checkpoint.save_checkpoint(ckpt, step=20, **{**save, "run_id": "someone-else"})


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("name", FILES)
def test_damaged_file_raises_naming_it(ckpt, fresh_model, name, how):
    model, dense_opt = fresh_model
    path = ckpt / "step_00000008"
    _damage(path / name, how)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load_checkpoint(path, model=model, dense_optimizer=dense_opt)
    message = str(e.value)
    assert name in message and str(path) in message
    reason = {
        "flip": "unreadable json" if name == "manifest.json" else "hash mismatch",
        "truncate": "unreadable json" if name == "manifest.json" else "truncated",
        "delete": "missing",
    }[how]
    assert reason in message
    assert checkpoint.latest_checkpoint(ckpt).name == "step_00000004"


def test_resume_falls_back_to_newest_intact_and_reports_it(ckpt, trained):
    _damage(ckpt / "step_00000008" / "dense.pt", "truncate")
    result, out = _run(ckpt, resume=True, steps=12)
    assert "skipped step_00000008" in out and "dense.pt is truncated" in out
    assert "resumed from" in out and "step_00000004 at step 4" in out
    assert sorted(result["losses"]) == list(range(5, 13))
    # exact: steps 5..8 of the resumed run are those of the uninterrupted run
    np.testing.assert_array_equal(
        [result["losses"][s] for s in range(5, 9)], [trained[1]["losses"][s] for s in range(5, 9)]
    )
    assert [p.name for p in _format._step_dirs(ckpt)] == ["step_00000008", "step_00000012"]


def test_resume_with_every_checkpoint_damaged_refuses(ckpt):
    for step in ("step_00000004", "step_00000008"):
        _damage(ckpt / step / "meta.json", "flip")
    with pytest.raises(ConfigError, match="no intact checkpoint.*meta.json hash mismatch"):
        _run(ckpt, resume=True, steps=12)


def test_unwritable_dir_fails_before_training(tmp_path):
    metrics = tmp_path / "m.jsonl"
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    targets = [blocker / "ckpt"]  # cannot be created, even by root
    readonly = tmp_path / "ro"
    readonly.mkdir()
    os.chmod(readonly, 0o555)
    if not os.access(readonly, os.W_OK):  # not root: a real read-only directory too
        targets.append(readonly)
    try:
        for target in targets:
            with pytest.raises(
                ConfigError,
                match="^"
                + re.escape(f"checkpoint.dir {str(target)!r} is not writable (")
                + r"\w+Error: .+\); "
                + re.escape(
                    "checkpoints could not be saved. Choose a writable checkpoint.dir (--set "
                    "checkpoint.dir=...) or fix its permissions"
                )
                + "$",
            ) as e:
                _run(target, f"log.metrics_path='{metrics}'")
            assert str(target) in str(e.value)
            assert not metrics.exists()  # no step ran
    finally:
        os.chmod(readonly, 0o755)


def test_no_room_for_two_checkpoints_fails_before_training(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(_preflight.shutil, "disk_usage", lambda _p: usage._replace(free=1000))
    model, dense_opt, *_ = train.build(_config(tmp_path / "ckpt"))
    need = 2 * checkpoint.estimate_bytes(model) / 2**20
    with pytest.raises(
        ConfigError,
        match="^"
        + re.escape(
            f"checkpoint.dir {str(tmp_path / 'ckpt')!r}: 0.0 MiB free on its disk but two checkpoints need about "
            f"{need:.1f} MiB (tables + optimizer state); free space or choose another checkpoint.dir"
        )
        + "$",
    ):
        _run(tmp_path / "ckpt")


def test_sgd_checkpoints_and_resumes_exactly(tmp_path):
    sgd = "sparse_optimizer.name=sgd"
    reference, _ = _run(tmp_path / "ref", sgd, steps=12, every=0)
    first, _ = _run(tmp_path / "ckpt", sgd, steps=8, every=4)
    resumed, out = _run(tmp_path / "ckpt", sgd, resume=True, steps=12)
    assert "step_00000008 at step 8" in out
    np.testing.assert_array_equal(
        [resumed["losses"][s] for s in range(9, 13)],
        [reference["losses"][s] for s in range(9, 13)],
    )
    assert resumed["eval"]["auc"] == reference["eval"]["auc"]


def test_config_change_on_resume_refuses_unless_allowed(ckpt):
    with pytest.raises(ConfigError) as e:
        _run(ckpt, "seed=3", "train.batch_size=32", resume=True, steps=12)
    message = str(e.value)
    assert "seed: 0 -> 3" in message and "train.batch_size: 64 -> 32" in message
    assert "checkpoint.allow_config_change=true" in message
    with pytest.raises(ConfigError, match=r"data.num_samples: 1024 -> 2048"):
        _run(ckpt, "data.num_samples=2048", resume=True, steps=12)
    with pytest.raises(
        ConfigError, match=r"model.data_type: 'FP32' -> 'FP16'"
    ):  # rounds the stored rows
        _run(ckpt, "model.data_type='FP16'", resume=True, steps=12)
    with pytest.raises(ConfigError, match=r"sparse_optimizer.stochastic_rounding: true -> false"):
        _run(ckpt, "sparse_optimizer.stochastic_rounding=false", resume=True, steps=12)
    result, out = _run(ckpt, "seed=3", "checkpoint.allow_config_change=true", resume=True, steps=12)
    assert (
        "checkpoint.allow_config_change: resuming with changed seed" in out.splitlines()
        and result["step"] == 12
    )


def test_interrupted_save_leaves_no_partial_checkpoint(ckpt, fresh_model, monkeypatch):
    model, dense_opt = fresh_model
    run_id = json.loads((ckpt / "run.json").read_text())["run_id"]
    real = _store._write_file

    written = []

    def dying(path, data):
        written.append(path)
        if path.name == "dense.pt":  # tables.npz is written, then the process "dies"
            raise KeyboardInterrupt("killed during save")
        return real(path, data)

    monkeypatch.setattr(_store, "_write_file", dying)
    before = _snapshot(ckpt)
    for step in (12, 8):  # a new step, and rewriting an existing one
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save_checkpoint(
                ckpt, step=step, model=model, dense_optimizer=dense_opt, run_id=run_id
            )
        assert _snapshot(ckpt) == before  # nothing visible, nothing lost, no .tmp-* left
    # written beside the checkpoints (one file system: the rename is atomic) under the
    # prefix that readers skip and a resume cleans
    assert written and all(
        p.parent.parent == ckpt and p.parent.name.startswith(".tmp-") for p in written
    )
    monkeypatch.undo()
    latest = checkpoint.latest_checkpoint(ckpt)
    assert latest.name == "step_00000008"
    meta = checkpoint.load_checkpoint(latest, model=model, dense_optimizer=dense_opt)
    assert meta["step"] == 8


def test_resume_into_another_models_checkpoints_is_refused_naming_every_table_that_differs(
    ckpt, capsys
):
    """The config-change refusal suggests checkpoint.allow_config_change; with it, a checkpoint of
    other tables is refused by name before anything is loaded (was: a ValueError traceback)."""
    before = _snapshot(ckpt)
    other = [
        "data.num_sparse=4",
        "model.embedding_dim=4",
        "model.dense_arch_layer_sizes=[8, 4]",
        "checkpoint.allow_config_change=true",
    ]
    with pytest.raises(ConfigError) as e:
        _run(ckpt, *other, resume=True, steps=12)
    message = str(e.value)
    assert message.startswith(
        f"--resume from {ckpt / 'step_00000008'}: the checkpoint holds other tables than "
        "this config builds: this config's tables ['t_cat_3'] are not in the checkpoint; "
        "table 't_cat_0' is saved as [64, 8] but configured as [64, 4]"
    ), message
    for part in (
        "not even checkpoint.allow_config_change",
        str(ckpt / "step_00000008" / "meta.json"),
        "fresh run in another checkpoint.dir",
    ):
        assert part.lower() in message.lower(), message
    with pytest.raises(
        ConfigError, match=r"the checkpoint's tables \['t_cat_2'\] are not in this config"
    ):
        _run(
            ckpt, "data.num_sparse=2", "checkpoint.allow_config_change=true", resume=True, steps=12
        )
    capsys.readouterr()
    code = train.main(
        [
            "--config",
            "configs/synthetic.toml",
            "--steps",
            "12",
            "--resume",
            *(f"--set={s}" for s in SMALL),
            f"--set=checkpoint.dir='{ckpt}'",
            "--set=log.metrics_path=''",
            *(f"--set={s}" for s in other),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --resume from") and "Traceback" not in err, err
    assert _snapshot(ckpt) == before


def test_killed_save_leftover_is_ignored_and_cleaned_on_resume(ckpt):
    leftover = ckpt / ".tmp-abc123"
    leftover.mkdir()
    (leftover / "tables.npz").write_bytes(b"partial")
    assert checkpoint.latest_checkpoint(ckpt).name == "step_00000008"
    _, out = _run(ckpt, resume=True, steps=8)
    assert "at step 8" in out and not leftover.exists()


def test_a_checkpoint_written_before_the_precision_keys_resumes_as_fp32():
    """Configs stored before `model.data_type` / `sparse_optimizer.stochastic_rounding`
    existed held their defaults: no change to refuse."""
    from hybrid.checkpoint import config_changes

    old = {"seed": 0, "model": {"arch": "DLRM"}, "sparse_optimizer": {"name": "sgd"}}
    new = {
        "seed": 0,
        "model": {"arch": "DLRM", "data_type": "FP32"},
        "sparse_optimizer": {"name": "sgd", "stochastic_rounding": True},
    }
    assert config_changes(old, new) == []
    assert config_changes(old, {**new, "model": {"data_type": "BF16"}}) == [
        ("model.data_type", "FP32", "BF16")
    ]


def test_a_resume_key_on_one_side_only_is_a_change_to_or_from_unset():
    from hybrid.checkpoint import config_changes

    base = {"seed": 0, "data": {"path": "a.tsv"}}
    assert config_changes(base, {"seed": 0}) == [("data.path", "a.tsv", "<unset>")]
    assert config_changes({"seed": 0}, base) == [("data.path", "<unset>", "a.tsv")]
    none = {"seed": 0, "data": {"path": None}}  # set to None is not unset
    assert config_changes({"seed": 0}, none) == [("data.path", "<unset>", None)]
    assert config_changes(none, {"seed": 0}) == [("data.path", None, "<unset>")]
    assert (
        config_changes(
            {"seed": 0, "model": {"arch": "DLRM"}}, {"seed": 0, "model": {"arch": "DCN"}}
        )
        == []
    )


def test_overwrite_names_the_aside_directory_by_old_run_and_time(tmp_path):
    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "run.json").write_text("{}")
    aside = _preflight._moved_aside(tmp_path, "0123456789abcdefXYZ")
    assert re.fullmatch(r"\.replaced-0123456789ab-\d{8}T\d{6}", aside.name), aside.name
    assert sorted(p.name for p in aside.iterdir()) == ["run.json", "step_00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name]


def test_a_meta_json_that_is_not_an_object_has_no_run_id(tmp_path):
    (tmp_path / "meta.json").write_text("[1, 2]")
    assert _preflight._run_id_of(tmp_path) is None
    (tmp_path / "meta.json").write_text('{"run_id": "r1"}')
    assert _preflight._run_id_of(tmp_path) == "r1"


def test_a_row_statistic_read_over_other_column_blocks_is_their_column_weighted_mean():
    """Column-wise resharding: a row's statistic for columns c0:c0+cn is the mean of the saved
    blocks' statistics weighted by how many of those columns each block holds."""
    arrays = {
        "state/t/m/cols_0_4": np.array([1.0, 2.0], np.float32),
        "state/t/m/cols_4_2": np.array([4.0, 8.0], np.float32),
        "state/t/m/cols_6_2": np.array([100.0, 100.0], np.float32),
    }
    np.testing.assert_allclose(
        _arrays._row_values(arrays, "t", "m", 0, 6, "w"), [2.0, 4.0]
    )  # (4*1+2*4)/6
    np.testing.assert_allclose(
        _arrays._row_values(arrays, "t", "m", 2, 4, "w"), [2.5, 5.0]
    )  # (2*1+2*4)/4
    np.testing.assert_array_equal(_arrays._row_values(arrays, "t", "m", 4, 2, "w"), [4.0, 8.0])
    np.testing.assert_allclose(
        _arrays._row_values(arrays, "t", "m", 3, 2, "w"), [2.5, 5.0]
    )  # one column each
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape("w: no row-wise state 'v' for table 't'; was it written by another optimizer?")
        + "$",
    ):
        _arrays._row_values(arrays, "t", "v", 0, 4, "w")


def _exactly(text):
    return "^" + re.escape(text) + "$"


def _tables_of(path):
    with np.load(path / "tables.npz") as f:
        return {k: f[k] for k in f.files}


def test_restore_refusals_name_the_table_and_the_fix(trained, fresh_model):
    model, _ = fresh_model
    arrays = _tables_of(trained[0] / "step_00000008")
    without = {k: v for k, v in arrays.items() if k != "weight/t_cat_0"}
    with pytest.raises(
        ValueError,
        match=_exactly(
            "W: table 't_cat_0' is not in the checkpoint (it holds ['t_cat_1', 't_cat_2']); load with the "
            "same dataset and tables"
        ),
    ):
        _arrays._restore_sparse(model, without, "W")
    with pytest.raises(
        ValueError,
        match=_exactly(
            "W: table 't_cat_1' is saved as [10, 8] but configured as [64, 8] (num_embeddings, embedding_dim); "
            "use the checkpoint's table sizes"
        ),
    ):
        _arrays._restore_sparse(
            model, {**arrays, "weight/t_cat_1": arrays["weight/t_cat_1"][:10]}, "W"
        )
    adagrad, _, *_ = train.build(load_config(None, [*SMALL, "sparse_optimizer.name=adagrad"]))
    saved = checkpoint.sparse_state_arrays(adagrad)
    del saved["state/t_cat_1/momentum1"]
    with pytest.raises(
        ValueError, match=_exactly("W: no optimizer state 'momentum1' for table 't_cat_1'")
    ):
        _arrays._restore_sparse(adagrad, saved, "W")


def test_elementwise_state_round_trips_with_its_dtype(tmp_path):
    model, dense_opt, *_ = train.build(load_config(None, [*SMALL, "sparse_optimizer.name=adagrad"]))
    state = model.sparse_opt_state
    rng = np.random.default_rng(0)
    filled = {
        b: {k: rng.random(v.shape, np.float32) for k, v in leaves.items()}
        for b, leaves in state.tables.items()
    }
    model.load_sparse_opt_state(state._replace(tables=filled, count=np.int32(7)))
    before = checkpoint.sparse_state_arrays(model)
    assert {v.dtype for k, v in before.items() if k != "count"} == {
        np.dtype(np.float32)
    }  # as held, not widened
    for (
        buffer,
        table,
        start,
        r0,
        rn,
        c0,
        cn,
    ) in model.sparse_module.stored_blocks():  # what the state holds
        np.testing.assert_array_equal(
            before[f"state/{table}/momentum1"][r0 : r0 + rn, c0 : c0 + cn],
            filled[buffer]["momentum1"][start : start + rn, :cn],
            err_msg=table,
        )
    path = checkpoint.save_checkpoint(tmp_path, step=7, model=model, dense_optimizer=dense_opt)
    other, other_opt, *_ = train.build(load_config(None, [*SMALL, "sparse_optimizer.name=adagrad"]))
    checkpoint.load_checkpoint(path, model=other, dense_optimizer=other_opt)
    after = checkpoint.sparse_state_arrays(other)
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        assert after[key].dtype == value.dtype, key
        np.testing.assert_array_equal(after[key], value, err_msg=key)
    leaf = jax.tree_util.tree_leaves(other.sparse_opt_state.tables)[0]
    assert leaf.dtype == np.float32 and int(after["count"]) == 7


def _rewrite_manifest(path, edit):
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(edit(manifest)))


def test_verify_names_the_checkpoint_the_file_and_the_reason(ckpt):
    path = ckpt / "step_00000008"
    where = f"checkpoint {path}"
    size = (path / "tables.npz").stat().st_size

    def refused(message):
        with pytest.raises(CheckpointError, match=_exactly(f"{where}: {message}")):
            checkpoint.verify_checkpoint(path)

    with pytest.raises(
        CheckpointError,
        match=_exactly(f"checkpoint {ckpt / 'nothing'}: no such checkpoint directory"),
    ):
        checkpoint.verify_checkpoint(ckpt / "nothing")
    with open(path / "tables.npz", "ab") as f:
        f.write(b"x")
    refused(f"tables.npz has {size + 1} bytes, the manifest says {size} (hash mismatch)")
    (path / "tables.npz").write_bytes((path / "tables.npz").read_bytes()[:-2])
    refused(f"tables.npz is truncated ({size - 1} of {size} bytes)")
    good = (ckpt / "step_00000004" / "tables.npz").read_bytes()
    (path / "tables.npz").write_bytes(good)  # same size, other bytes
    entry = json.loads((path / "manifest.json").read_text())["files"]["tables.npz"]
    digest = sha256_file(path / "tables.npz")
    assert len(good) == size and digest != entry["sha256"]
    refused(
        f"tables.npz hash mismatch (sha256 {digest[:12]}..., the manifest says {entry['sha256'][:12]}...): "
        "the file is damaged"
    )
    _rewrite_manifest(
        path,
        lambda m: {**m, "files": {**m["files"], "tables.npz": {"sha256": digest, "size": size}}},
    )
    checkpoint.verify_checkpoint(path)  # the manifest now vouches for these bytes
    _rewrite_manifest(
        path, lambda m: {**m, "files": {k: v for k, v in m["files"].items() if k != "dense.pt"}}
    )
    refused("manifest.json does not list dense.pt")
    for broken in ({"files": 3}, [1], {"files": {"meta.json": {"sha256": "x"}}}):
        (path / "manifest.json").write_text(json.dumps(broken))
        refused("manifest.json is unreadable (no valid 'files' table)")
    (path / "manifest.json").unlink()
    refused(
        "manifest.json is missing (the save did not finish, the file was deleted, or the checkpoint predates "
        "manifests: load it with verify=False at your own risk)"
    )


def test_a_manifest_that_vouches_for_a_meta_without_step_is_refused(ckpt):
    path = ckpt / "step_00000008"
    (path / "meta.json").write_text("{}")
    _rewrite_manifest(
        path,
        lambda m: {
            **m,
            "files": {
                **m["files"],
                "meta.json": {"sha256": sha256_file(path / "meta.json"), "size": 2},
            },
        },
    )
    with pytest.raises(
        CheckpointError, match=_exactly(f"checkpoint {path}: meta.json is unreadable (no 'step')")
    ):
        checkpoint.verify_checkpoint(path)
    (path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=_exactly(f"checkpoint {path}: meta.json is missing")):
        _format._read_json(path / "meta.json", f"checkpoint {path}")


def test_load_names_unreadable_files_and_a_dense_tower_of_another_shape(ckpt, fresh_model):
    model, dense_opt = fresh_model
    path = ckpt / "step_00000008"
    other, other_opt, *_ = train.build(
        load_config(None, [*SMALL, "model.dense_arch_layer_sizes=[16, 8]"])
    )
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            f"checkpoint {path}: the dense tower does not match the [model] config (Error(s) in loading state_dict"
        ),
    ):
        checkpoint.load_checkpoint(path, model=other, dense_optimizer=other_opt)
    adagrad, adagrad_opt, *_ = train.build(
        load_config(None, [*SMALL, "sparse_optimizer.name=adagrad"])
    )
    with pytest.raises(
        ValueError,
        match=_exactly(
            f"checkpoint {path}: written with sparse optimizer 'rowwise_adagrad' but sparse_optimizer.name is "
            "'adagrad'; use the same optimizer"
        ),
    ):
        checkpoint.load_checkpoint(path, model=adagrad, dense_optimizer=adagrad_opt)
    for name, error in (("dense.pt", "UnpicklingError"), ("tables.npz", "ValueError")):
        copy = ckpt / f"copy_{name}"
        shutil.copytree(path, copy)
        (copy / name).write_bytes(b"not a checkpoint file")
        with pytest.raises(
            CheckpointError,
            match="^" + re.escape(f"checkpoint {copy}: {name} is unreadable ({error}: "),
        ):
            checkpoint.load_checkpoint(copy, model=model, dense_optimizer=dense_opt, verify=False)
        (copy / "meta.json").write_text("{,")
        with pytest.raises(
            CheckpointError,
            match="^" + re.escape(f"checkpoint {copy}: meta.json is unreadable json ("),
        ):
            checkpoint.load_checkpoint(copy, model=model, dense_optimizer=dense_opt, verify=False)


class _Payload:
    """Not a tensor, dict or number: `torch.load(weights_only=True)` refuses to unpickle it."""


def test_a_dense_pt_carrying_other_pickled_objects_is_refused_not_run(ckpt, fresh_model):
    model, dense_opt = fresh_model
    path = ckpt / "step_00000008"
    dense = torch.load(path / "dense.pt", weights_only=True)
    torch.save({**dense, "payload": _Payload()}, path / "dense.pt")
    with pytest.raises(
        CheckpointError,
        match="^"
        + re.escape(
            f"checkpoint {path}: dense.pt is unreadable (UnpicklingError: Weights only load failed"
        ),
    ):
        checkpoint.load_checkpoint(path, model=model, dense_optimizer=dense_opt, verify=False)
    torch.save(dense, path / "dense.pt")
    arrays = _tables_of(path)
    del arrays["weight/t_cat_2"]
    np.savez(path / "tables.npz", **arrays)
    with pytest.raises(
        ValueError,
        match="^" + re.escape(f"checkpoint {path}: table 't_cat_2' is not in the checkpoint"),
    ):
        checkpoint.load_checkpoint(path, model=model, dense_optimizer=dense_opt, verify=False)


def test_run_identity_refusals_name_both_runs(ckpt, fresh_model):
    model, dense_opt = fresh_model
    run = json.loads((ckpt / "run.json").read_text())
    with pytest.raises(
        CheckpointError,
        match=_exactly(
            f"checkpoint directory {ckpt} belongs to run {run['run_id']} (created {run['created']}), not to this "
            "run someone-else; resume that run, or choose another checkpoint.dir"
        ),
    ):
        checkpoint.save_checkpoint(
            ckpt, step=20, model=model, dense_optimizer=dense_opt, run_id="someone-else"
        )
    with pytest.raises(
        ConfigError,
        match=_exactly(
            f"checkpoint.dir {str(ckpt)!r} already holds checkpoints of run {run['run_id']} (created {run['created']}): "
            "step_00000004, step_00000008. Refusing to start a fresh run over them. Resume that run (--resume), "
            "choose another checkpoint.dir, or pass --set checkpoint.overwrite=true (its checkpoints are moved "
            "aside into the directory's .replaced-* folder)"
        ),
    ):
        _run(ckpt)
    (ckpt / "run.json").unlink()
    meta_id = _preflight._run_id_of(ckpt / "step_00000008")
    with pytest.raises(
        ConfigError, match=re.escape(f"of a run with unknown id ({meta_id}): step_00000004")
    ):
        _run(ckpt)
    (ckpt / "run.json").write_text("{,")
    with pytest.raises(
        ConfigError,
        match="^"
        + re.escape(
            f"checkpoint.dir {str(ckpt)!r}: checkpoint directory {ckpt}: run.json is unreadable json ("
        ),
    ):
        _run(ckpt)
    (ckpt / "run.json").write_text("{}")
    with pytest.raises(
        ConfigError,
        match=_exactly(
            f"checkpoint.dir {str(ckpt)!r}: checkpoint directory {ckpt}: run.json has no run_id; move the directory "
            "aside or choose another"
        ),
    ):
        _run(ckpt)


def test_resume_with_nothing_intact_lists_every_reason(ckpt):
    for step in ("step_00000004", "step_00000008"):
        (ckpt / step / "dense.pt").unlink()
    with pytest.raises(
        ConfigError,
        match=_exactly(
            f"--resume: no intact checkpoint in checkpoint.dir {str(ckpt)!r} (checkpoint {ckpt / 'step_00000008'}: "
            f"dense.pt is missing; checkpoint {ckpt / 'step_00000004'}: dense.pt is missing). Nothing can be resumed; "
            "start over with a fresh run and --set checkpoint.overwrite=true (the damaged checkpoints are moved "
            "aside), or choose another checkpoint.dir"
        ),
    ):
        _run(ckpt, resume=True, steps=12)


class _WithState:
    """A model whose sparse optimizer state is replaced (rules a checkpoint cannot hold)."""

    def __init__(self, model, tables):
        self._model = model
        self.sparse_opt_state = model.sparse_opt_state._replace(tables=tables)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_an_optimizer_state_a_checkpoint_cannot_hold_is_refused_before_training(
    fresh_model, tmp_path
):
    model, dense_opt = fresh_model
    (buffer,) = model.sparse_opt_state.tables
    rows = model.sparse_params[buffer].shape[0]
    name = model.sparse_optimizer.name
    for tables, why in (
        (
            {buffer: [jax.numpy.zeros(rows)]},
            f"checkpoint: sparse optimizer state of buffer {buffer!r} is a list; only "
            "rules whose per-table state is a dict of arrays (sgd, adagrad, rowwise_adagrad, adam) can be checkpointed",
        ),
        (
            {buffer: {"m": jax.numpy.zeros(())}},
            f"sparse optimizer state leaf 'm' of buffer {buffer!r} is not per-row (shape ())",
        ),
        (
            {buffer: {"m": jax.numpy.zeros(rows + 1)}},
            f"sparse optimizer state leaf 'm' of buffer {buffer!r} is not "
            f"per-row (shape ({rows + 1},))",
        ),
    ):
        with pytest.raises(
            ConfigError,
            match=_exactly(
                f"sparse_optimizer.name = {name!r} cannot be checkpointed ({why}); choose another sparse optimizer "
                "or unset checkpoint.dir"
            ),
        ):
            checkpoint.prepare_run(
                tmp_path, config={}, model=_WithState(model, tables), resume=False
            )
    with pytest.raises(
        TypeError,
        match=_exactly(
            f"checkpoint: sparse optimizer state leaf 'm' of buffer {buffer!r} is not per-row (shape ()); such rules "
            "cannot be checkpointed"
        ),
    ):
        checkpoint.sparse_state_arrays(_WithState(model, {buffer: {"m": jax.numpy.zeros(())}}))
    assert _arrays._leaves(model.sparse_opt_state._replace(tables={buffer: ()}), buffer) == {}


def _two_leaf_rule():
    """A rule with a row-wise leaf before an elementwise one (every leaf must be restored)."""
    from sparse_jax.optim import RowRule

    def init_table(table):
        return {
            "a_rows": jax.numpy.zeros(table.shape[:1], jax.numpy.float32),
            "m": jax.numpy.zeros(table.shape, jax.numpy.float32),
        }

    def update_rows(rows, state, grads, step):
        return rows - 0.1 * grads, {"a_rows": state["a_rows"] + 1.0, "m": state["m"] + grads}

    return RowRule("two_leaf", init_table, update_rows)


def test_a_rule_with_row_wise_and_elementwise_leaves_restores_both(tmp_path):
    import dense_torch
    from sparse_jax import EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(name="t0", num_embeddings=12, embedding_dim=4, feature_names=["a"])
    ]

    def build():
        return hybrid.Model(
            tables,
            dense_torch.DLRM(4, 3, 2, [4], [4, 1]),
            sparse_optimizer=_two_leaf_rule(),
        )

    model = build()
    rng = np.random.default_rng(1)
    state = model.sparse_opt_state
    model.load_sparse_opt_state(
        state._replace(
            tables={
                b: {k: rng.random(v.shape, np.float32) for k, v in leaves.items()}
                for b, leaves in state.tables.items()
            }
        )
    )
    before = checkpoint.sparse_state_arrays(model)
    assert {k for k in before if k.startswith("state/")} == {
        "state/t0/a_rows/cols_0_4",
        "state/t0/m",
    }
    assert {v.dtype for k, v in before.items() if k != "count"} == {np.dtype(np.float32)}
    dense_opt = torch.optim.SGD(model.dense.parameters(), lr=0.1)
    path = checkpoint.save_checkpoint(tmp_path, step=1, model=model, dense_optimizer=dense_opt)
    other = build()
    checkpoint.load_checkpoint(
        path, model=other, dense_optimizer=torch.optim.SGD(other.dense.parameters(), lr=0.1)
    )
    after = checkpoint.sparse_state_arrays(other)
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value, err_msg=key)
    without_rows = {k: v for k, v in before.items() if "/a_rows/" not in k}
    with pytest.raises(
        ValueError,
        match=_exactly(
            "W: no row-wise state 'a_rows' for table 't0'; was it written by another optimizer?"
        ),
    ):
        _arrays._restore_sparse(other, without_rows, "W")


def test_rotation_keeps_the_newest_intact_ones_logs_the_damaged_and_survives_a_stuck_one(
    tmp_path, fresh_model, caplog, monkeypatch
):
    model, dense_opt = fresh_model
    save = dict(model=model, dense_optimizer=dense_opt, run_id="r", keep=3)
    for step in (1, 2, 3, 4):
        checkpoint.save_checkpoint(tmp_path, step=step, **{**save, "keep": 10})
    _damage(tmp_path / "step_00000003" / "dense.pt", "truncate")
    with caplog.at_level("WARNING", logger="hybrid.checkpoint"):
        checkpoint.save_checkpoint(tmp_path, step=5, **save)
    # keep=3: step 5, then the two newest intact older ones (4 and 2); damaged 3 and old 1 go
    assert [p.name for p in _format._step_dirs(tmp_path)] == [
        "step_00000002",
        "step_00000004",
        "step_00000005",
    ]
    assert [r.getMessage() for r in caplog.records] == [
        f"rotation: deleting damaged checkpoint of this run: checkpoint {tmp_path / 'step_00000003'}: dense.pt is "
        f"truncated ({(tmp_path / 'step_00000004' / 'dense.pt').stat().st_size // 2} of "
        f"{(tmp_path / 'step_00000004' / 'dense.pt').stat().st_size} bytes)"
    ]
    real_rmdir = os.rmdir

    def stuck(path, *args, **kwargs):  # the disk refuses to remove step 2
        if "step_00000002" in str(path):
            raise PermissionError(f"cannot remove {path}")
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", stuck)
    checkpoint.save_checkpoint(tmp_path, step=6, **save)  # the save itself must not fail
    assert (tmp_path / "step_00000006").is_dir()


def test_run_json_holds_a_config_with_paths_as_text_and_keeps_two_by_default(tmp_path, fresh_model):
    model, dense_opt = fresh_model
    nested = tmp_path / "a" / "b"  # created with its parents
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(
            nested,
            step=step,
            model=model,
            dense_optimizer=dense_opt,
            meta={"config": {"checkpoint": {"dir": tmp_path / "x"}}},
        )
    run = checkpoint.read_run(nested)
    assert run["config"] == {"checkpoint": {"dir": str(tmp_path / "x")}}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", run["created"]), run["created"]
    assert [p.name for p in _format._step_dirs(nested)] == ["step_00000002", "step_00000003"]


def test_the_size_estimate_counts_tables_state_and_three_copies_of_the_dense_tower(fresh_model):
    model, _ = fresh_model
    tables = 3 * 64 * 8 * 4  # three fp32 tables of 64 x 8
    state = sum(leaf.size * 4 for leaf in jax.tree_util.tree_leaves(model.sparse_opt_state.tables))
    assert state == 3 * 64 * 4  # row-wise Adagrad: one fp32 per row
    dense = sum(p.numel() for p in model.dense.parameters()) * 4
    assert checkpoint.estimate_bytes(model) == tables + state + 3 * dense + 65536


def test_prepare_run_refuses_by_default(ckpt, fresh_model):
    model, dense_opt = fresh_model
    stored = json.loads((ckpt / "run.json").read_text())["config"]
    with pytest.raises(ConfigError, match="Refusing to start a fresh run over them"):
        checkpoint.prepare_run(ckpt, config=stored, model=model, resume=False, echo=_quiet)
    with pytest.raises(ConfigError, match="the config changes keys that exact resumption needs"):
        checkpoint.prepare_run(
            ckpt, config={**stored, "seed": 5}, model=model, resume=True, echo=_quiet
        )
    assert (
        checkpoint.prepare_run(
            ckpt, config=stored, model=model, resume=True, echo=_quiet
        ).resume_from.name
        == "step_00000008"
    )


def test_a_run_json_without_checkpoints_is_taken_over_and_a_resume_without_run_json_keeps_the_run_id(
    ckpt, tmp_path
):
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "run.json").write_text(json.dumps({"run_id": "abandoned", "config": {}}))
    _run(lone, steps=4, every=4)  # nothing to lose: a fresh run takes the directory over
    assert checkpoint.read_run(lone)["run_id"] != "abandoned"
    old_id = _preflight._run_id_of(ckpt / "step_00000008")
    (ckpt / "run.json").unlink()  # the checkpoints still name their run
    result, out = _run(ckpt, resume=True, steps=12)
    assert result["step"] == 12 and _preflight._run_id_of(ckpt / "step_00000012") == old_id


def test_latest_logs_each_damaged_checkpoint_it_skips(ckpt, caplog):
    _damage(ckpt / "step_00000008" / "meta.json", "delete")
    with caplog.at_level("WARNING", logger="hybrid.checkpoint"):
        assert checkpoint.latest_checkpoint(ckpt).name == "step_00000004"
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping checkpoint {ckpt / 'step_00000008'}: checkpoint {ckpt / 'step_00000008'}: meta.json is missing"
    ]


def test_an_interrupted_save_whose_leftover_cannot_be_removed_still_raises_the_interruption(
    ckpt, fresh_model, monkeypatch
):
    model, dense_opt = fresh_model
    real_write, real_rmdir = _store._write_file, os.rmdir

    def dying(path, data):
        if path.name == "dense.pt":
            raise KeyboardInterrupt("killed during save")
        return real_write(path, data)

    def stuck(path, *args, **kwargs):
        if str(path).startswith(".tmp-") or "/.tmp-" in str(path):
            raise PermissionError(f"cannot remove {path}")
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(_store, "_write_file", dying)
    monkeypatch.setattr(os, "rmdir", stuck)
    with pytest.raises(KeyboardInterrupt, match="killed during save"):
        checkpoint.save_checkpoint(ckpt, step=12, model=model, dense_optimizer=dense_opt)
    monkeypatch.undo()
    assert checkpoint.latest_checkpoint(ckpt).name == "step_00000008"  # the leftover is ignored


def test_files_that_exist_but_cannot_be_read_are_named_with_the_reason(ckpt, fresh_model):
    model, dense_opt = fresh_model
    path = ckpt / "step_00000008"
    where = f"checkpoint {path}"

    def refused(pattern):
        with pytest.raises(CheckpointError, match="^" + re.escape(f"{where}: ") + pattern + "$"):
            checkpoint.verify_checkpoint(path)

    def vouch(name, **entry):
        _rewrite_manifest(path, lambda m: {"files": {**m["files"], name: entry}})

    vouch("meta.json/x", sha256="0", size=1)  # stat fails: meta.json is a file
    refused(re.escape("meta.json/x is unreadable ([Errno 20] Not a directory: ") + ".*'\\)")
    _rewrite_manifest(
        path, lambda m: {"files": {k: v for k, v in m["files"].items() if k != "meta.json/x"}}
    )
    (path / "dense.pt").unlink()
    (path / "dense.pt").mkdir()  # stat works, reading does not
    vouch("dense.pt", sha256="0", size=(path / "dense.pt").stat().st_size)
    refused(re.escape("dense.pt is unreadable ([Errno 21] Is a directory: ") + ".*dense.pt'\\)")
    (path / "dense.pt").rmdir()
    (path / "dense.pt").write_bytes(b"")
    vouch("dense.pt", sha256=hashlib.sha256(b"").hexdigest(), size=0)
    (path / "meta.json").write_text("{not json")
    vouch("meta.json", sha256=sha256_file(path / "meta.json"), size=9)
    refused(re.escape("meta.json is unreadable json (") + ".*\\)")
    (path / "meta.json").unlink()
    (path / "meta.json").mkdir()
    with pytest.raises(
        CheckpointError,
        match="^"
        + re.escape(f"{where}: meta.json is unreadable ([Errno 21] Is a directory: ")
        + ".*meta.json'\\)$",
    ):
        checkpoint.load_checkpoint(path, model=model, dense_optimizer=dense_opt, verify=False)


def test_steps_are_ordered_by_number_not_by_name(tmp_path, fresh_model):
    model, dense_opt = fresh_model
    for step in (100_000_000, 99_999_999):  # 9 digits sort before 8 by name
        checkpoint.save_checkpoint(
            tmp_path, step=step, model=model, dense_optimizer=dense_opt, keep=5
        )
    assert [p.name for p in _format._step_dirs(tmp_path)] == ["step_99999999", "step_100000000"]
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_100000000"


def test_a_fresh_run_gets_a_new_id_for_its_directory_and_overwrite_without_run_json_says_unknown(
    tmp_path, fresh_model
):
    model, dense_opt = fresh_model
    nested = tmp_path / "a" / "b" / "ckpt"  # parents are created
    first = checkpoint.prepare_run(nested, config={}, model=model, resume=False, echo=_quiet)
    second = checkpoint.prepare_run(nested, config={}, model=model, resume=False, echo=_quiet)
    assert first.directory == nested and first.resume_from is None and first.skipped == []
    assert re.fullmatch(r"[0-9a-f]{32}", first.run_id) and first.run_id != second.run_id
    assert sorted(p.name for p in nested.iterdir()) == []  # the write probe is gone
    checkpoint.save_checkpoint(
        nested, step=2, model=model, dense_optimizer=dense_opt, run_id="r" * 16
    )
    meta = json.loads((nested / "step_00000002" / "meta.json").read_text())
    (nested / "run.json").unlink()
    (nested / "step_00000002" / "meta.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k != "run_id"})
    )
    lines = []
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "holds checkpoints of a run with unknown id (no run.json): step_00000002. Refusing"
        ),
    ):
        checkpoint.prepare_run(nested, config={}, model=model, resume=False, echo=lines.append)
    checkpoint.prepare_run(
        nested, config={}, model=model, resume=False, overwrite=True, echo=lines.append
    )
    (aside,) = [p for p in nested.iterdir() if p.name.startswith(".replaced-")]
    assert re.fullmatch(r"\.replaced-unknown-\d{8}T\d{6}", aside.name), aside.name
    assert lines == [
        f"checkpoint.overwrite: moved the checkpoints of a run with unknown id (no run.json) "
        f"(step_00000002) aside to {aside}; delete it yourself to free the space"
    ]


def test_the_owner_of_checkpoints_without_run_json_is_the_newest_ones_run(ckpt, fresh_model):
    model, _ = fresh_model
    newest = _preflight._run_id_of(ckpt / "step_00000008")
    meta = json.loads((ckpt / "step_00000004" / "meta.json").read_text())
    (ckpt / "step_00000004" / "meta.json").write_text(json.dumps({**meta, "run_id": "older"}))
    (ckpt / "run.json").unlink()
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"holds checkpoints of a run with unknown id ({newest}): "
            "step_00000004, step_00000008. Refusing"
        ),
    ):
        checkpoint.prepare_run(ckpt, config={}, model=model, resume=False, echo=_quiet)
    run = {"run_id": "0123456789abcdef0123", "created": "then", "config": {}}
    (ckpt / "run.json").write_text(json.dumps(run))
    checkpoint.prepare_run(ckpt, config={}, model=model, resume=False, overwrite=True, echo=_quiet)
    (aside,) = [p for p in ckpt.iterdir() if p.name.startswith(".replaced-")]
    assert aside.name.startswith(".replaced-0123456789ab-")


def test_resume_compares_with_the_newest_checkpoints_config_else_the_run_json(ckpt, fresh_model):
    model, _ = fresh_model
    run = json.loads((ckpt / "run.json").read_text())
    stored = run["config"]
    newest = ckpt / "step_00000008"
    meta = json.loads((newest / "meta.json").read_text())
    (newest / "meta.json").write_text(
        json.dumps({**meta, "config": {**stored, "seed": 1}})
    )  # resumed with a change
    _rewrite_manifest(
        newest,
        lambda m: {
            **m,
            "files": {
                **m["files"],
                "meta.json": {
                    "sha256": sha256_file(newest / "meta.json"),
                    "size": (newest / "meta.json").stat().st_size,
                },
            },
        },
    )
    found = checkpoint.prepare_run(
        ckpt, config={**stored, "seed": 1}, model=model, resume=True, echo=_quiet
    )
    assert (found.directory, found.run_id, found.resume_from, found.skipped) == (
        ckpt,
        run["run_id"],
        newest,
        [],
    )
    with pytest.raises(
        ConfigError,
        match=_exactly(
            f"--resume from {newest}: the config changes keys that exact resumption needs (seed: 1 -> 0; "
            "train.batch_size: 64 -> 32); restore them, or pass --set checkpoint.allow_config_change=true to resume "
            "anyway (the run will not match an uninterrupted one)"
        ),
    ):
        checkpoint.prepare_run(
            ckpt,
            config={**stored, "train": {**stored["train"], "batch_size": 32}},
            model=model,
            resume=True,
            echo=_quiet,
        )
    lines = []
    checkpoint.prepare_run(
        ckpt,
        config={**stored, "data": {**stored["data"], "num_samples": 7}},
        model=model,
        resume=True,
        allow_config_change=True,
        echo=lines.append,
    )
    assert lines == ["checkpoint.allow_config_change: resuming with changed data.num_samples, seed"]
    (newest / "meta.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k != "config"})
    )  # no config
    _rewrite_manifest(
        newest,
        lambda m: {
            **m,
            "files": {
                **m["files"],
                "meta.json": {
                    "sha256": sha256_file(newest / "meta.json"),
                    "size": (newest / "meta.json").stat().st_size,
                },
            },
        },
    )
    with pytest.raises(
        ConfigError, match=re.escape("(seed: 0 -> 1)")
    ):  # the run.json's config then
        checkpoint.prepare_run(
            ckpt, config={**stored, "seed": 1}, model=model, resume=True, echo=_quiet
        )
    for step in ("step_00000004", "step_00000008"):
        shutil.rmtree(ckpt / step)
    with pytest.raises(
        ConfigError,
        match=_exactly(
            f"--resume from {ckpt}: the config changes keys that exact resumption needs (seed: 0 -> 1); restore them, "
            "or pass --set checkpoint.allow_config_change=true to resume anyway (the run will not match an "
            "uninterrupted one)"
        ),
    ):
        checkpoint.prepare_run(
            ckpt, config={**stored, "seed": 1}, model=model, resume=True, echo=_quiet
        )
    found = checkpoint.prepare_run(ckpt, config=stored, model=model, resume=True, echo=_quiet)
    assert (found.directory, found.run_id, found.resume_from, found.skipped) == (
        ckpt,
        run["run_id"],
        None,
        [],
    )


def test_a_resume_keeps_the_run_json_id_and_survives_a_leftover_it_cannot_remove(
    ckpt, fresh_model, tmp_path
):
    model, _ = fresh_model
    run_id = json.loads((ckpt / "run.json").read_text())["run_id"]
    newest = ckpt / "step_00000008"
    meta = json.loads((newest / "meta.json").read_text())
    (newest / "meta.json").write_text(json.dumps({**meta, "run_id": "other"}))
    _rewrite_manifest(
        newest,
        lambda m: {
            **m,
            "files": {
                **m["files"],
                "meta.json": {
                    "sha256": sha256_file(newest / "meta.json"),
                    "size": (newest / "meta.json").stat().st_size,
                },
            },
        },
    )
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    (ckpt / ".tmp-link").symlink_to(outside, target_is_directory=True)  # rmtree refuses a link
    (ckpt / ".tmp-killed-save").mkdir()
    found = checkpoint.prepare_run(
        ckpt,
        config=json.loads((ckpt / "run.json").read_text())["config"],
        model=model,
        resume=True,
        echo=_quiet,
    )
    assert found.run_id == run_id  # run.json names the run, not a checkpoint's meta
    assert (outside / "keep.txt").read_text() == "x" and (ckpt / ".tmp-link").is_symlink()
    assert not (ckpt / ".tmp-killed-save").exists()


def test_room_for_exactly_two_checkpoints_is_enough(tmp_path, monkeypatch):
    model, *_ = train.build(
        load_config(None, [*SMALL, "data.num_embeddings=100000"])
    )  # MiBs: figures that show
    need = 2 * checkpoint.estimate_bytes(model)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(_preflight.shutil, "disk_usage", lambda _p: usage._replace(free=need))
    assert checkpoint.prepare_run(
        tmp_path / "a", config={}, model=model, resume=False, echo=_quiet
    ).run_id
    free = need - 1
    monkeypatch.setattr(_preflight.shutil, "disk_usage", lambda _p: usage._replace(free=free))
    with pytest.raises(
        ConfigError,
        match=_exactly(
            f"checkpoint.dir {str(tmp_path / 'b')!r}: {free / 2**20:.1f} MiB free on its disk but two checkpoints "
            f"need about {need / 2**20:.1f} MiB (tables + optimizer state); free space or choose another "
            "checkpoint.dir"
        ),
    ):
        checkpoint.prepare_run(tmp_path / "b", config={}, model=model, resume=False, echo=_quiet)
    assert (
        f"{free / 2**20:.1f}" != f"{free / 2**21:.1f}"
        and f"{need / 2**20:.1f}" != f"{need / 2**21:.1f}"
    )


def test_a_write_probe_that_fails_in_the_directory_is_reported(tmp_path, fresh_model, monkeypatch):
    """A directory that takes no writes (a full disk): the probe must be written there."""
    model, _ = fresh_model
    target = tmp_path / "full"
    target.mkdir()
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(target)):
            raise OSError(28, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(_preflight.os, "fsync", fsync)
    with pytest.raises(
        ConfigError,
        match=_exactly(
            f"checkpoint.dir {str(target)!r} is not writable (OSError: [Errno 28] No space left on device); "
            "checkpoints could not be saved. Choose a writable checkpoint.dir (--set checkpoint.dir=...) or fix its "
            "permissions"
        ),
    ):
        checkpoint.prepare_run(target, config={}, model=model, resume=False, echo=_quiet)
    assert list(target.iterdir()) == []  # the probe is removed even then
