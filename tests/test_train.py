"""`python -m hybrid.train`: config errors, a small synthetic run, the MovieLens job."""

import json
import shlex

import numpy as np
import pytest
import torch

from hybrid import train
from hybrid.data import BatchLoader, eval_batches, load_movielens
from hybrid.training import ConfigError, eval_metrics, load_config

SMALL = [
    "data.source=synthetic",
    "data.num_samples=2048",
    "data.num_eval_samples=1024",
    "data.num_sparse=4",
    "data.num_dense=3",
    "data.num_embeddings=200",
    "train.batch_size=128",
    "train.eval_batch_size=512",
    "log.every=4",
]


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--config", "--mesh", "--set", "--resume", "--steps", "--overwrite"):
        assert flag in out


def test_no_config_is_a_usage_error_naming_the_config_files(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "4"])  # no silent default job
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--config" in err and "required" in err
    for name in ("configs/movielens.toml", "configs/synthetic.toml", "configs/criteo.toml"):
        assert name in err, err


def test_the_help_examples_parse_and_the_resume_example_names_a_checkpoint_dir():
    examples = [
        shlex.split(line)[3:]
        for line in train.__doc__.splitlines()
        if line.strip().startswith("python -m hybrid.train")
    ]
    assert len(examples) >= 3 and any("--resume" in e for e in examples)
    for argv in examples:
        args = train._parser().parse_args(argv)
        config = load_config(args.config, args.set)
        if args.resume:  # --resume reads checkpoint.dir: the example must give one
            assert config.checkpoint.dir, argv


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.batch_sz=3"], "unknown key 'train.batch_sz'"),
        (["train.batch_size='big'"], "train.batch_size must be int, got 'big'"),
        (["model.arch=MLP"], r"model.arch = 'MLP'; choose one of"),
        (["optimizer.lr=1"], "unknown key 'optimizer'"),
    ],
)
def test_bad_config_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/synthetic.toml", overrides)


def test_bad_toml_file_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[train]\nbatch_size = = 3\n")
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        load_config(str(path))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.mesh='data=3'"], r"needs 3 devices but JAX has 8"),
        (
            ["train.mesh='data=8'", "train.batch_size=100"],
            r"train.batch_size = 100 must divide by the 8 devices",
        ),
        (
            ["train.mesh='data=8'", "train.sharding={t_nope='row_wise'}"],
            r"train.sharding names tables \['t_nope'\]",
        ),
        (
            ["model.dense_arch_layer_sizes=[8, 4]"],
            r"\[model\].*last layer size must equal embedding_dim",
        ),
    ],
)
def test_config_errors_found_before_device_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        train.build(load_config(None, SMALL + overrides))


def test_cli_reports_config_error_and_exit_code(capsys):
    assert train.main(["--config", "configs/synthetic.toml", "--mesh", "data=5"]) == 2
    assert "needs 5 devices" in capsys.readouterr().err


def test_synthetic_run_learns_and_writes_metrics(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    code = train.main(
        [
            "--config",
            "configs/synthetic.toml",
            "--mesh",
            "data=2,model=4",
            "--steps",
            "32",
            *(f"--set={s}" for s in SMALL),
            f"--set=log.metrics_path='{metrics}'",
            "--set=sparse_optimizer.lr=0.1",
            "--set=dense_optimizer.lr=0.01",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "ShardingPlan" in out and "eval @ step 32: AUC" in out
    assert out.splitlines()[-2:] == [
        f"metrics: {metrics}",  # the run ends saying where its outputs are
        "checkpoints: none written (checkpoint.dir is empty; --set checkpoint.dir=... writes them)",
    ]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    trains = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert {"loss", "loss_window", "loss_lifetime", "samples_per_s"} <= set(trains[0])
    (final,) = [r for r in records if r["kind"] == "eval"]
    assert final["auc"] > 0.6 and final["count"] == 1024
    # the build's time, then each epoch's wall time (the last one cut short by --steps)
    (build,) = [r for r in records if r["kind"] == "build"]
    assert build["step"] == 0 and build["build_s"] > 0
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(1, len(epochs) + 1))
    assert sum(r["steps"] for r in epochs) == 32 and epochs[-1]["step"] == 32
    assert all(r["seconds"] > 0 and r["samples_per_s"] > 0 for r in epochs)
    assert f"epoch 1: {epochs[0]['steps']} steps in " in out


def test_a_second_run_refuses_to_replace_metrics_a_resume_appends_and_overwrite_replaces(
    tmp_path, capsys
):
    metrics, ckpt = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "ckpt"
    argv = [
        "--config",
        "configs/synthetic.toml",
        "--steps",
        "4",
        *(f"--set={s}" for s in SMALL),
        f"--set=log.metrics_path='{metrics}'",
        f"--set=checkpoint.dir='{ckpt}'",
        "--set=checkpoint.every=4",
    ]

    def train_steps():
        return [
            r["step"]
            for r in map(json.loads, metrics.read_text().splitlines())
            if r["kind"] == "train"
        ]

    assert train.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [f"metrics: {metrics}", f"checkpoints: {ckpt} (newest: step_00000004)"]
    first = metrics.read_text()

    assert train.main(argv) == 2  # the same command again: refused before any data is read
    err = capsys.readouterr().err  # 5 lines: build, train, epoch, eval, checkpoint
    assert f"log.metrics_path {metrics} already holds 5 metrics line(s) of an earlier run" in err
    for way_out in (
        "--overwrite",
        "--resume",
        "another run directory: --set log.metrics_path=",
        "checkpoint.dir",
    ):
        assert way_out in err, err
    assert metrics.read_text() == first

    assert train.main([*argv, "--steps", "8", "--resume"]) == 0  # its own metrics: appended
    assert train_steps() == [4, 8] and metrics.read_text().startswith(first)
    assert (
        capsys.readouterr().out.splitlines()[-1] == f"checkpoints: {ckpt} (newest: step_00000008)"
    )

    assert (
        train.main([*argv, "--overwrite"]) == 0
    )  # a fresh run: metrics replaced, checkpoints moved aside
    assert train_steps() == [4]
    assert "checkpoint.overwrite: moved the checkpoints" in capsys.readouterr().out


def _logistic_regression_auc(train_data, eval_data, epochs=5, lr=0.01):
    """A torch logistic regression on the same features: one weight per id, linear dense."""
    torch.manual_seed(0)
    bags = torch.nn.ModuleList(
        torch.nn.EmbeddingBag(n, 1, mode="sum") for n in train_data.num_embeddings
    )
    for b in bags:
        torch.nn.init.zeros_(b.weight)
    linear = torch.nn.Linear(train_data.num_dense, 1)
    opt = torch.optim.Adam([*bags.parameters(), *linear.parameters()], lr=lr)

    def logits(dense, sparse):
        keys, values, lengths = sparse
        per = lengths.reshape(len(keys), -1)
        out = linear(dense).reshape(-1)
        for bag, ids, lens in zip(bags, torch.split(values, per.sum(1).tolist()), per, strict=True):
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
            out = out + bag(ids, offsets).reshape(-1)
        return out

    loader = BatchLoader(train_data, 512, seed=0)
    for step in range(epochs * loader.steps_per_epoch):
        dense, sparse, labels = loader.batch(step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(dense, sparse), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        scores = torch.cat([logits(d, s)[:v] for (d, s, _), v in eval_batches(eval_data, 4096)])
    return eval_metrics(scores, torch.from_numpy(eval_data.labels))["auc"]


@pytest.mark.slow
def test_movielens_dlrm_beats_logistic_regression(tmp_path, capsys):
    config = load_config(
        "configs/movielens.toml",
        ["train.mesh='data=2,model=4'", f"log.metrics_path='{tmp_path / 'm.jsonl'}'"],
    )
    result = train.run(config)
    dlrm_auc = result["eval"]["auc"]
    lr_auc = _logistic_regression_auc(*load_movielens())
    print(f"MovieLens-100K eval AUC: DLRM {dlrm_auc:.4f}, logistic regression {lr_auc:.4f}")
    assert np.isfinite(result["eval"]["log_loss"])
    assert dlrm_auc > lr_auc


def test_criteo_config_trains_on_a_written_tsv(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(640):
        cats = [f"{rng.integers(0, 50):x}" for _ in range(26)]
        label = int(int(cats[0], 16) % 2 == 0) if rng.random() < 0.9 else int(rng.integers(0, 2))
        ints = [str(rng.integers(0, 100)) if rng.random() < 0.8 else "" for _ in range(13)]
        lines.append("\t".join([str(label), *ints, *cats]) + "\n")
    path = tmp_path / "day_0.tsv"
    path.write_text("".join(lines))
    metrics = tmp_path / "m.jsonl"
    code = train.main(
        [
            "--config",
            "configs/criteo.toml",
            "--steps",
            "24",
            f"--set=data.paths=['{path}']",
            "--set=data.num_embeddings=64",
            "--set=train.batch_size=64",
            "--set=train.eval_batch_size=64",
            "--set=train.eval_every=0",
            "--set=checkpoint.dir=''",
            f"--set=log.metrics_path='{metrics}'",
            "--set=sparse_optimizer.lr=0.2",
            "--set=dense_optimizer.lr=0.01",
        ]
    )
    assert code == 0
    assert "576 train / 64 eval samples" in capsys.readouterr().out
    final = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    assert final["kind"] == "eval" and final["auc"] > 0.7


def test_criteo_bad_row_reaches_the_cli_with_file_and_line(tmp_path):
    path = tmp_path / "broken.tsv"
    path.write_text("1\t2\n")
    config = load_config("configs/criteo.toml", [f"data.paths=['{path}']", "checkpoint.dir=''"])
    with pytest.raises(ValueError, match=r"broken\.tsv, line 1: 2 tab-separated fields"):
        train.build(config)


def test_table_precision_and_rounding_come_from_the_config():
    model, *_ = train.build(
        load_config(
            None,
            SMALL
            + ["model.data_type='BF16'", "sparse_optimizer.stochastic_rounding=false", "seed=5"],
        )
    )
    assert {str(v.dtype) for v in model.sparse_params.values()} == {"bfloat16"}
    rule = train._sparse_rule(
        load_config(None, SMALL + ["sparse_optimizer.stochastic_rounding=false", "seed=5"])
    )
    assert (rule.stochastic_rounding, rule.seed) == (False, 5)
    assert train._sparse_rule(load_config(None, SMALL)).stochastic_rounding is True
    with pytest.raises(
        ConfigError, match=r"model.data_type = 'INT8'; choose one of \['FP32', 'FP16', 'BF16'\]"
    ):
        load_config(None, ["model.data_type='INT8'"])


@pytest.fixture(scope="module")
def movielens_fp32(tmp_path_factory):
    """The default MovieLens job (fp32 vocabulary tables): (eval metrics, metrics-file lines)."""
    metrics = tmp_path_factory.mktemp("movielens") / "FP32.jsonl"
    result = train.run(load_config("configs/movielens.toml", [f"log.metrics_path='{metrics}'"]))
    return result["eval"], [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.slow
def test_movielens_fp16_and_bf16_tables_reach_the_fp32_auc(tmp_path, movielens_fp32):
    """Issue #14's bar: narrow tables (stochastic write-back, the default) end within 0.002
    eval AUC of fp32 tables on MovieLens-100K (same seed, same data order)."""
    auc = {"FP32": movielens_fp32[0]["auc"]}
    for data_type in ("FP16", "BF16"):
        config = load_config(
            "configs/movielens.toml",
            [f"model.data_type='{data_type}'", f"log.metrics_path='{tmp_path / data_type}.jsonl'"],
        )
        auc[data_type] = train.run(config)["eval"]["auc"]
    print(f"MovieLens-100K eval AUC by table precision: {auc}")
    assert abs(auc["FP16"] - auc["FP32"]) <= 0.002 and abs(auc["BF16"] - auc["FP32"]) <= 0.002, auc


def _raw_criteo_tsv(path, rows=640, seed=0):
    """Criteo lines whose categories are 16-digit hex (raw 64-bit ids); the label follows C1."""
    rng = np.random.default_rng(seed)
    pool = [
        f"{int(v) * 2 + 1:016x}" for v in rng.integers(0, 2**63 - 1, 60, dtype=np.int64)
    ]  # above 2**63 too
    lines = []
    for _ in range(rows):
        picks = rng.integers(0, 60, 26)
        label = int(picks[0] % 2 == 0) if rng.random() < 0.9 else int(rng.integers(0, 2))
        lines.append("\t".join([str(label), *["1"] * 13, *(pool[p] for p in picks)]) + "\n")
    path.write_text("".join(lines))
    return path


def test_criteo_raw_hex_ids_train_through_managed_tables_and_log_their_counters(tmp_path, capsys):
    path = _raw_criteo_tsv(tmp_path / "day_0.tsv")
    metrics = tmp_path / "m.jsonl"
    every = load_config(
        "configs/criteo.toml",
        [
            f"data.paths=['{path}']",
            "data.raw_ids=['*']",
            "managed_collision.tables={t_cat_0 = 48}",
            "train.batch_size=64",
        ],
    )
    with pytest.raises(
        ConfigError,
        match=r"data.raw_ids: tables \['t_cat_1', 't_cat_2', .*'t_cat_25'\] get raw "
        r"64-bit ids but have no managed-collision module",
    ):
        train.build(every)  # "*": all 26 features raw
    tables = "{" + ", ".join(f"t_cat_{i} = 48" for i in range(3)) + "}"  # 60 ids seen, 47 rows each
    code = train.main(
        [
            "--config",
            "configs/criteo.toml",
            "--steps",
            "24",
            f"--set=data.paths=['{path}']",
            "--set=data.raw_ids=['cat_0', 'cat_1', 'cat_2']",
            f"--set=managed_collision.tables={tables}",
            "--set=data.num_embeddings=64",
            "--set=train.batch_size=64",
            "--set=train.eval_batch_size=64",
            "--set=train.eval_every=0",
            "--set=checkpoint.dir=''",
            f"--set=log.metrics_path='{metrics}'",
            "--set=log.every=8",
            "--set=train.mesh=''",
            "--set=sparse_optimizer.lr=0.2",
            "--set=dense_optimizer.lr=0.01",
        ]
    )
    assert code == 0, capsys.readouterr()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    trains = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [8, 16, 24]
    counters = [r["managed_collision"]["t_cat_0"] for r in trains]
    assert [c["occupancy"] for c in counters] == [
        47,
        47,
        47,
    ]  # every row but the default one in use
    assert 0 < counters[0]["evictions"] < counters[-1]["evictions"] < counters[-1]["admissions"]
    assert set(trains[0]["managed_collision"]) == {"t_cat_0", "t_cat_1", "t_cat_2"}
    assert records[-1]["kind"] == "eval" and records[-1]["auc"] > 0.6


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.raw_ids=['user']"],
            r"data.raw_ids: tables \['t_user'\] get raw 64-bit ids but have no managed-collision "
            r"module; give each its rows in \[managed_collision\] tables \(e.g. t_user = 1024\)",
        ),
        (["data.raw_ids=['users']"], r"data.raw_ids names \['users'\], not MovieLens features"),
        (
            ["managed_collision.tables={t_nope=8}"],
            r"managed_collision.tables names \['t_nope'\], not tables of this "
            r"dataset",
        ),
        (
            ["managed_collision.tables={t_user=1}"],
            r"\[managed_collision\] table 't_user': MCHManagedCollisionModule: zch_size=1 "
            r"must be an int >= 2",
        ),
        (
            ["managed_collision.eviction_policy='fifo'"],
            r"managed_collision.eviction_policy = 'fifo'; choose one of "
            r"\['lru', 'lfu', 'distance_lfu', 'ttl'\]",
        ),
        (
            ["managed_collision.tables={t_user=64}", "managed_collision.decay_exponent=-1"],
            r"\[managed_collision\] table 't_user': MCHManagedCollisionModule: "
            r"decay_exponent=-1.0 must be a finite number >= 0",
        ),
        (
            ["managed_collision.tables={t_user=64}", "managed_collision.eviction_policy='ttl'"],
            r"\[managed_collision\] table 't_user': MCHManagedCollisionModule: single_ttl=0 "
            r"must be an int >= 1 with eviction_policy='ttl'",
        ),
        (
            ["managed_collision.tables={t_user=64}", "managed_collision.single_ttl=5"],
            r"\[managed_collision\] table 't_user': MCHManagedCollisionModule: single_ttl=5 "
            r"is for eviction_policy='ttl', not 'lru'; leave it out",
        ),
        (["managed_collision.single_ttl=-1"], r"managed_collision.single_ttl = -1 must be >= 0"),
    ],
)
def test_managed_collision_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        train.build(load_config("configs/movielens.toml", overrides))


def test_synthetic_data_has_no_raw_ids():
    with pytest.raises(ConfigError, match=r"data.raw_ids: the synthetic source has no raw ids"):
        train.build(load_config(None, [*SMALL, "data.raw_ids=['cat_0']"]))


@pytest.mark.slow
def test_movielens_raw_ids_in_smaller_managed_tables_come_near_the_vocabulary_auc(
    tmp_path, movielens_fp32
):
    """Issue #16's comparison: user, item and zip as raw 64-bit ids in managed tables of
    about half their vocabularies (LRU) against the same model on vocabulary rows."""
    auc = {"movielens": movielens_fp32[0]["auc"]}

    def last_train(records):
        return [r for r in records if r["kind"] == "train"][-1]

    stats = {"movielens": last_train(movielens_fp32[1]).get("managed_collision")}
    metrics = tmp_path / "raw.jsonl"
    config = load_config("configs/movielens_raw_ids.toml", [f"log.metrics_path='{metrics}'"])
    auc["movielens_raw_ids"] = train.run(config)["eval"]["auc"]
    stats["movielens_raw_ids"] = last_train(map(json.loads, metrics.read_text().splitlines())).get(
        "managed_collision"
    )
    print(
        f"MovieLens-100K eval AUC: vocabulary tables {auc['movielens']:.4f}, raw ids in managed tables "
        f"{auc['movielens_raw_ids']:.4f}; {stats['movielens_raw_ids']}"
    )
    assert stats["movielens"] is None and stats["movielens_raw_ids"]["t_user"]["evictions"] > 1000
    assert auc["movielens_raw_ids"] > auc["movielens"] - 0.03


def test_a_row_wise_managed_table_trains_on_a_mesh_from_the_training_script(tmp_path, capsys):
    path = _raw_criteo_tsv(tmp_path / "day_0.tsv")
    metrics = tmp_path / "m.jsonl"
    code = train.main(
        [
            "--config",
            "configs/criteo.toml",
            "--steps",
            "16",
            "--mesh",
            "data=2,model=4",
            f"--set=data.paths=['{path}']",
            "--set=data.raw_ids=['cat_0']",
            "--set=managed_collision.tables={t_cat_0 = 48}",
            "--set=train.sharding={t_cat_0 = 'row_wise'}",
            "--set=data.num_embeddings=64",
            "--set=train.batch_size=64",
            "--set=train.eval_batch_size=64",
            "--set=train.eval_every=0",
            "--set=checkpoint.dir=''",
            f"--set=log.metrics_path='{metrics}'",
            "--set=log.every=8",
            "--set=sparse_optimizer.lr=0.2",
            "--set=dense_optimizer.lr=0.01",
        ]
    )
    assert code == 0, capsys.readouterr()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    counters = [r["managed_collision"]["t_cat_0"] for r in records if r["kind"] == "train"]
    assert [c["occupancy"] for c in counters] == [
        44,
        44,
    ]  # 4 shards of 12 rows, one default row each
    assert counters[-1]["evictions"] > 0 and records[-1]["auc"] > 0.6


def _criteo_tsv(path, rows=320, seed=0):
    """Criteo lines with 8-digit hex categories; the label follows C1 (90% of the time)."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(rows):
        cats = [f"{v:08x}" for v in rng.integers(0, 50, 26)]
        label = int(int(cats[0], 16) % 2 == 0) if rng.random() < 0.9 else int(rng.integers(0, 2))
        ints = [str(rng.integers(0, 100)) if rng.random() < 0.8 else "" for _ in range(13)]
        lines.append("\t".join([str(label), *ints, *cats]) + "\n")
    path.write_text("".join(lines))
    return str(path)


def _criteo_stream_argv(paths, steps, metrics, ckpt="", every=0):
    return [
        "--config",
        "configs/criteo.toml",
        "--stream",
        "--steps",
        str(steps),
        f"--set=data.paths={paths}",
        "--set=data.num_embeddings=64",
        "--set=train.batch_size=64",
        "--set=train.eval_batch_size=64",
        "--set=train.eval_every=0",
        "--set=train.mesh=''",
        f"--set=checkpoint.dir='{ckpt}'",
        f"--set=checkpoint.every={every}",
        f"--set=log.metrics_path='{metrics}'",
        "--set=log.every=1",
        "--set=sparse_optimizer.lr=0.2",
        "--set=dense_optimizer.lr=0.01",
    ]


def test_criteo_stream_trains_and_resumes_where_the_stream_stood(tmp_path, capsys):
    """--stream: two day files streamed (10 batches an epoch, so 12 steps cross an epoch),
    the third held out; a run stopped at step 8 and resumed gives the uninterrupted losses."""
    from hybrid.data import CriteoStream

    paths = [_criteo_tsv(tmp_path / f"day_{i}.tsv", seed=i) for i in range(3)]
    assert train.main(_criteo_stream_argv(paths, 12, tmp_path / "ref.jsonl")) == 0
    out = capsys.readouterr().out
    assert "streaming 2 train file(s) / 320 eval samples" in out and "ETA" in out
    reference = [json.loads(line) for line in (tmp_path / "ref.jsonl").read_text().splitlines()]
    assert reference[-1]["kind"] == "eval" and reference[-1]["auc"] > 0.7
    progress = [r["data"] for r in reference if r["kind"] == "train"][-1]  # the reader's place
    assert (
        progress["epoch"] >= 1
        and progress["files"] == 2
        and progress["file"] in ("day_0.tsv", "day_1.tsv")
    )

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    assert train.main(_criteo_stream_argv(paths, 8, metrics, ckpt, every=3)) == 0
    # the step-6 checkpoint (written while batch 7 was already read ahead) holds the
    # position after 6 batches
    stream = CriteoStream(paths[:-1], 64, num_embeddings=64, shuffle_window=train.STREAM_WINDOW)
    for _ in range(6):
        next(stream)
    meta = json.loads((ckpt / "step_00000006" / "meta.json").read_text())
    assert meta["data_stream"] == stream.state()
    stream.close()
    # a resume without the stream is refused: the checkpoint's config says data.stream = true
    with pytest.raises(ConfigError, match=r"data\.stream: true -> false"):
        argv = [a for a in _criteo_stream_argv(paths, 12, metrics, ckpt) if a != "--stream"]
        train.run(
            load_config(
                "configs/criteo.toml",
                [a[6:] for a in argv if a.startswith("--set=")] + ["train.steps=12"],
            ),
            resume=True,
            echo=lambda *_: None,
        )
    # resumed through the config key instead of the flag: the same stream
    keyed = [
        "--set=data.stream=true" if a == "--stream" else a
        for a in _criteo_stream_argv(paths, 12, metrics, ckpt)
    ]
    assert train.main([*keyed, "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    resumed = {
        r["step"]: r["loss"]
        for r in map(json.loads, metrics.read_text().splitlines())
        if r["kind"] == "train"
    }
    expect = {r["step"]: r["loss"] for r in reference if r["kind"] == "train"}
    assert sorted(resumed) == list(range(1, 13))
    np.testing.assert_array_equal(
        [resumed[s] for s in range(1, 13)], [expect[s] for s in range(1, 13)]
    )


@pytest.mark.parametrize(
    ("paths", "steps", "message"),
    [
        (1, 8, r"--stream: data.paths needs at least two files"),
        (
            2,
            0,
            r"--stream: the stream's length is not known before it is read, so give train.steps",
        ),
    ],
)
def test_criteo_stream_config_errors(tmp_path, paths, steps, message):
    files = [_criteo_tsv(tmp_path / f"day_{i}.tsv", rows=8) for i in range(paths)]
    config = load_config(
        "configs/criteo.toml", [f"data.paths={files}", f"train.steps={steps}", "checkpoint.dir=''"]
    )
    with pytest.raises(ConfigError, match=message):
        train.build(config, stream=True)


def test_a_run_exports_for_serving_and_a_checkpoint_exports_without_training(tmp_path, capsys):
    """config -> checkpoint -> artifact in commands: the run writes export.dir at its end;
    `--resume --export-only` writes the newest checkpoint's artifact (the same predictions)
    and, with `--quantize int8`, its int8 artifact; nothing trains the second time."""
    import hybrid.serving as serving

    common = [
        "--config",
        "configs/synthetic.toml",
        *(f"--set={s}" for s in SMALL),
        f"--set=checkpoint.dir='{tmp_path / 'ck'}'",
        "--set=export.max_batch_size=8",
        "--set=log.metrics_path=''",
    ]
    first, again, int8 = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert train.main([*common, "--steps", "4", "--export", str(first)]) == 0
    out = capsys.readouterr().out
    assert f"export: {first}; serve it: python -m hybrid.serving serve --artifact {first}" in out
    assert train.main([*common, "--resume", "--export-only", "--export", str(again)]) == 0
    out = capsys.readouterr().out
    assert f"export: {again} (step 4)" in out and "eval @" not in out and "step 4/" not in out
    assert (
        train.main(
            [*common, "--resume", "--export-only", "--export", str(int8), "--quantize", "int8"]
        )
        == 0
    )
    a, b, c = serving.load(first), serving.load(again), serving.load(int8)
    assert a.manifest["model"] == b.manifest["model"] == "Model" and a.max_batch_size == 8
    assert {t["weight_type"] for t in c.manifest["tables"]} == {"int8"}
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((8, 3)).astype(np.float32)
    sparse = {f: [rng.integers(0, 200, 3).tolist() for _ in range(8)] for f in a.features}
    assert torch.equal(a(dense, sparse), b(dense, sparse))
    torch.testing.assert_close(c(dense, sparse), a(dense, sparse), atol=0.05, rtol=0.05)
    # refused before any work: an existing artifact, --export-only without --resume
    assert train.main([*common, "--resume", "--export-only", "--export", str(again)]) == 2
    assert f"export.dir {again} already exists; refusing to replace it" in capsys.readouterr().err
    assert train.main([*common, "--export-only", "--export", str(tmp_path / "d")]) == 2
    assert "--export-only exports the newest checkpoint" in capsys.readouterr().err
