"""`python -m hybrid.train`: train a recommender on a device mesh from a TOML config.

    python -m hybrid.train --config configs/movielens.toml --mesh data=2,model=4
    python -m hybrid.train --config configs/synthetic.toml --set train.batch_size=256 --steps 200
    python -m hybrid.train --config configs/movielens.toml --set checkpoint.dir=data_cache/runs/movielens --set checkpoint.every=100
    python -m hybrid.train --config configs/movielens.toml --set checkpoint.dir=data_cache/runs/movielens --resume
    python -m hybrid.train --config configs/criteo.toml --stream --steps 20000 --set 'data.paths=["day_0.gz", "day_1.gz", "day_23.gz"]'
    python -m hybrid.train --config configs/synthetic.toml --export artifacts/synthetic --quantize int8
    python -m hybrid.train --config configs/movielens.toml --set checkpoint.dir=data_cache/runs/movielens --resume --export-only --export artifacts/movielens

`--config` is required (configs/*.toml; `--set` changes single keys). The last two lines
write checkpoints and then continue from the newest one (`--resume` reads checkpoint.dir,
which must be the same). Builds the dataset's tables (one per sparse feature), the dense
tower (DLRM, DLRM_DCN or two_tower) and `hybrid.Model` on the mesh, prints the sharding
plan, trains with a progress line (loss, samples/s), evaluates (AUC, log loss, NE,
accuracy) every `train.eval_every` steps and at the end, writes metrics as JSON lines
(log.metrics_path) and checkpoints (checkpoint.dir), and ends by printing where they went.
A fresh run never replaces an earlier run's metrics or checkpoints: it refuses, unless
`--overwrite` (earlier checkpoints are moved aside, not deleted); `--resume` appends.
`--stream` or `data.stream = true` (Criteo): the training files are streamed, each process reading only its
share, shuffled within a window of 65,536 samples, read ahead on a thread, in memory that
stays flat however large the files (`hybrid.data.CriteoStream`); the last of data.paths
is the held-out eval file, read whole (data.max_rows rows at most; data.eval_fraction is
not used); train.steps must be given (the stream repeats its files as often as the steps
need); checkpoints carry the stream's exact position (their meta's "data_stream") and
`--resume --stream` continues from it. data.paths may be binary shards
(`python -m hybrid.data.preprocess`, the fast path; their own table sizes). Without `--stream` the files are read into memory
(data.max_rows rows) and the last data.eval_fraction of them is held out.
`--export DIR` (export.dir) writes a serving artifact at the end of the run (`--quantize
int8|int4|int2|fp16`: its tables quantized first), which `python -m hybrid.serving serve
--artifact DIR --port N` serves; `--export-only` with `--resume` writes it from the newest
checkpoint without training (`hybrid/training/_export_run.py`).
Config keys: see `hybrid/training/_train_config.py`. On CPU, a `--mesh` needing more devices than
the host has sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` itself (when JAX
has not started yet).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

import numpy as np

from hybrid.data._criteo import CriteoFormatError
from hybrid.training import ConfigError, load_config

__all__ = ["build", "evaluate", "main", "run"]


def _config_files() -> list[str]:
    """The example configs shipped in the repository's configs/ (as paths from its root)."""
    root = pathlib.Path(__file__).resolve().parent.parent / "configs"
    names = sorted(p.name for p in root.glob("*.toml")) or [
        "criteo.toml",
        "movielens.toml",
        "movielens_raw_ids.toml",
        "synthetic.toml",
    ]
    return [f"configs/{n}" for n in names]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        if "--config" in message and "required" in message:
            message = (
                f"{message}: name a TOML config, one of {', '.join(_config_files())} (e.g. "
                "--config configs/synthetic.toml for a quick run; --set key=value changes single keys)"
            )
        super().error(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m hybrid.train",
        description=__doc__,
        epilog="Config keys and defaults: hybrid/training/_train_config.py. Example configs: configs/*.toml.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        required=True,
        help="TOML file (required): " + ", ".join(_config_files()),
    )
    p.add_argument("--mesh", help="device mesh, e.g. data=2,model=4 (overrides train.mesh)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, TOML value syntax: --set train.batch_size=256 "
        "--set model.arch='\"DLRM_DCN\"' (bare words are strings); repeatable",
    )
    p.add_argument("--steps", type=int, help="total training steps (overrides train.steps)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in checkpoint.dir (its metrics file is appended to)",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="criteo: stream the training files per process (flat memory, exact resume) instead of "
        "reading them whole; the last of data.paths is the eval file; needs train.steps",
    )
    p.add_argument(
        "--export",
        metavar="DIR",
        help="write a serving artifact to DIR at the end (overrides export.dir); serve it with "
        "python -m hybrid.serving serve --artifact DIR --port N",
    )
    p.add_argument(
        "--quantize",
        choices=["int8", "int4", "int2", "fp16"],
        help="quantize the exported tables (overrides export.quantize)",
    )
    p.add_argument(
        "--export-only",
        action="store_true",
        help="with --resume: export the newest checkpoint to export.dir (--export DIR) without training",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over where an earlier run wrote: replace log.metrics_path and export.dir, and "
        "move checkpoint.dir's checkpoints aside (sets log.overwrite, checkpoint.overwrite and "
        "export.overwrite)",
    )
    return p


def _ensure_cpu_devices(mesh_spec: str, processes: int) -> None:
    """Ask XLA for enough host devices for the mesh (this process's share of it), if JAX
    has not started its backends. Only the host (CPU) platform reads this flag."""
    from jax._src import xla_bridge

    from hybrid.training._mesh import parse_mesh

    if not mesh_spec or xla_bridge.backends_are_initialized():
        return
    try:
        total = math.prod(parse_mesh(mesh_spec).values())
    except ValueError as e:
        raise ConfigError(f"train.mesh / --mesh: {e}") from None
    if total % processes:
        raise ConfigError(
            f"train.mesh / --mesh {mesh_spec!r} has {total} devices, not a multiple of the "
            f"{processes} processes; give every process the same number of devices"
        )
    need = total // processes
    flags = os.environ.get("XLA_FLAGS", "")
    if need > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={need}".strip()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = list(args.set)
    if args.mesh is not None:
        overrides.append(f"train.mesh={json.dumps(args.mesh)}")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.stream:  # the flag is the config key: one recorded setting, whichever was used
        overrides.append("data.stream=true")
    if args.overwrite:
        overrides += ["log.overwrite=true", "checkpoint.overwrite=true", "export.overwrite=true"]
    if args.export is not None:
        overrides.append(f"export.dir={json.dumps(args.export)}")
    if args.quantize is not None:
        overrides.append(f"export.quantize={json.dumps(args.quantize)}")
    try:
        config = load_config(args.config, overrides)
        if args.export_only and not (args.resume and config.export.dir):
            raise ConfigError(
                "--export-only exports the newest checkpoint without training: give --resume "
                "(with checkpoint.dir) and --export DIR (or export.dir)"
            )
        from hybrid.training._distributed import read_torchrun_env

        env = read_torchrun_env()
        from jax._src import xla_bridge

        from hybrid.training._gpu_env import configure_gpu_env

        if not xla_bridge.backends_are_initialized():  # (in-process callers started it already)
            configure_gpu_env()  # before JAX starts: torch and JAX share each GPU
        _ensure_cpu_devices(config.train.mesh, 1 if env is None else env.world_size)
        if env is not None:
            import hybrid

            hybrid.init_distributed()
            from hybrid.training._watchdog import start_watchdog

            watchdog = start_watchdog(env)  # a dead peer makes this process exit in seconds
        run(config, resume=args.resume, stream=config.data.stream, export_only=args.export_only)
        if env is not None and watchdog is not None:
            watchdog.finish()  # every rank finished: exiting peers are not failures
    except (ConfigError, CriteoFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from hybrid.training._nonfinite import NonFiniteError

        if not isinstance(e, NonFiniteError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


def _load_data(config, stream: bool = False):
    from hybrid import data

    d = config.data
    if stream and d.source != "criteo":
        raise ConfigError(f'--stream reads Criteo files (data.source = "criteo"), not {d.source!r}')
    if d.source == "movielens":
        unknown = sorted(set(d.raw_ids) - set(data.MOVIELENS_FEATURES))
        if unknown:
            raise ConfigError(
                f"data.raw_ids names {unknown}, not MovieLens features {list(data.MOVIELENS_FEATURES)}"
            )
        return data.load_movielens(d.cache_dir or None, raw_ids=d.raw_ids)
    if d.raw_ids and d.source == "synthetic":
        raise ConfigError(
            "data.raw_ids: the synthetic source has no raw ids; use movielens or criteo"
        )
    if d.source == "synthetic":
        kwargs = dict(
            num_sparse=d.num_sparse, num_dense=d.num_dense, num_embeddings=d.num_embeddings
        )
        return (
            data.synthetic_clicks(d.num_samples, seed=config.seed, **kwargs),
            data.synthetic_clicks(d.num_eval_samples, seed=config.seed + 1, **kwargs),
        )
    if not d.paths:
        raise ConfigError("data.paths is empty; list the Criteo TSV files (plain or .gz) to read")
    for path in d.paths:
        if not os.path.exists(path):
            raise ConfigError(f"data.paths: {path} does not exist")
    from hybrid.data._criteo import CRITEO_KEYS as keys

    raw = set(keys) if "*" in d.raw_ids else set(d.raw_ids)
    unknown = sorted(raw - set(keys))
    if unknown:
        raise ConfigError(
            f'data.raw_ids names {unknown}, not Criteo features (cat_0..cat_25, or "*" for all)'
        )
    sizes = [0 if key in raw else d.num_embeddings for key in keys]
    from hybrid.data._binary import is_shard

    if any(is_shard(p) for p in d.paths):  # binary shards: their ids were hashed when written
        if not stream:
            raise ConfigError(
                "data.paths are binary shards (<name>.criteo): read them with --stream"
            )
        if raw:
            raise ConfigError(
                "data.raw_ids: binary shards keep the sizes they were converted with; convert with 0 "
                "(raw ids) for those features instead (python -m hybrid.data.preprocess --num-embeddings)"
            )
        sizes = None  # the shards' own (data.num_embeddings is not used)
    if stream:
        return _criteo_stream(config, sizes)
    whole = data.read_criteo_tsv(d.paths, num_embeddings=sizes, max_rows=d.max_rows or None)
    n_eval = int(round(d.eval_fraction * len(whole)))
    if not 0 < n_eval < len(whole):
        raise ConfigError(
            f"data.eval_fraction = {d.eval_fraction} leaves no train or no eval rows of {len(whole)}"
        )
    cut = len(whole) - n_eval
    return whole.take(range(cut)), whole.take(range(cut, len(whole)))


# -- --stream: Criteo streamed per process (hybrid.data.CriteoStream) ----------------------
STREAM_WINDOW = 65_536  # samples shuffled together


def _criteo_stream(config, sizes):
    """(this process's training stream, the eval file's samples) for `--stream`."""
    from hybrid import data

    d, t = config.data, config.train
    if len(d.paths) < 2:
        raise ConfigError(
            "--stream: data.paths needs at least two files: the training files and, last, the held-out "
            f"eval file (got {list(d.paths)})"
        )
    if not t.steps:
        raise ConfigError(
            "--stream: the stream's length is not known before it is read, so give train.steps (--steps N); "
            "the stream repeats its files for as many epochs as the steps need"
        )
    procs = _Processes()
    train = data.CriteoStream(
        d.paths[:-1],
        t.batch_size // procs.world,
        process_index=procs.rank,
        process_count=procs.world,
        num_embeddings=sizes,
        shuffle_window=STREAM_WINDOW,
        seed=config.seed,
    )
    if sizes is None:
        evaluation = data.read_criteo_shards(d.paths[-1], max_rows=d.max_rows or None)
    else:
        evaluation = data.read_criteo_tsv(
            d.paths[-1], num_embeddings=sizes, max_rows=d.max_rows or None
        )
    return train, evaluation


def _is_stream(train) -> bool:
    from hybrid.data import ClickData

    return not isinstance(train, ClickData)


def _restore_stream(train, meta: dict, where) -> None:
    """Put the stream where checkpoint `where` left it (its meta's "data_stream"; a run of
    several processes saved each one's as "data_streams")."""
    state = meta.get("data_stream")
    if "data_streams" in meta:
        procs = _Processes()
        streams = meta["data_streams"]
        if len(streams) != procs.world:
            raise ConfigError(
                f"--resume --stream: {where} was written by {len(streams)} processes, each reading its "
                f"own share of the files; this run has {procs.world}. A stream position is exact only "
                f"for the share it was read from: resume on {len(streams)} processes"
            )
        state = streams[procs.rank]
    if _is_stream(train) != (state is not None):
        raise ConfigError(
            f"--resume: {where} was written by a run {'with' if state is not None else 'without'} --stream; "
            f"resume it {'with' if state is not None else 'without'} --stream"
        )
    if state is not None:
        try:
            train.restore(state)
        except ValueError as e:
            raise ConfigError(f"--resume: {where}: {e}") from None


def _dense_tower(config, keys, num_dense: int):
    import dense_torch

    m = config.model
    try:
        if m.arch == "two_tower":
            return dense_torch.TwoTower(
                m.query_features,
                m.candidate_features,
                m.embedding_dim,
                m.tower_layer_sizes,
                activation_on_last=False,
            )
        common = dict(
            embedding_dim=m.embedding_dim,
            num_sparse_features=len(keys),
            dense_in_features=num_dense,
            dense_arch_layer_sizes=m.dense_arch_layer_sizes,
            over_arch_layer_sizes=m.over_arch_layer_sizes,
            feature_names=list(keys),
        )
        if m.arch == "DLRM_DCN":
            return dense_torch.DLRM_DCN(
                dcn_num_layers=m.dcn_num_layers, dcn_low_rank_dim=m.dcn_low_rank_dim, **common
            )
        return dense_torch.DLRM(**common)
    except ValueError as e:
        raise ConfigError(f"[model] (arch {m.arch!r}) with features {list(keys)}: {e}") from None


def _sparse_rule(config):
    from sparse_jax import optim

    o = config.sparse_optimizer
    if o.name == "sgd":
        return optim.sgd(lr=o.lr, stochastic_rounding=o.stochastic_rounding, seed=config.seed)
    return getattr(optim, o.name)(
        lr=o.lr, eps=o.eps, stochastic_rounding=o.stochastic_rounding, seed=config.seed
    )


def _mesh(config):
    import jax

    import hybrid

    spec = config.train.mesh
    devices = jax.devices()
    if not spec and jax.process_count() > 1:
        # several processes need one global mesh (the tables are one model, not one per
        # process): data parallel over every device unless a mesh is given
        spec = f"data={len(devices)}"
    if not spec:
        return None, 1
    try:
        axes = hybrid.parse_mesh(spec)
    except ValueError as e:
        raise ConfigError(f"train.mesh / --mesh: {e}") from None
    if math.prod(axes.values()) != len(devices):
        raise ConfigError(
            f"train.mesh / --mesh {spec!r} needs {math.prod(axes.values())} devices but JAX has "
            f"{len(devices)} ({devices[0].platform}); choose sizes whose product is {len(devices)}"
        )
    return hybrid.make_mesh(axes), len(devices)


def _ladder(config, train, evaluation) -> list[int]:
    if config.train.capacity_ladder:
        return sorted(config.train.capacity_ladder)
    per_sample = sum(
        max(a, b) for a, b in zip(train.max_lengths(), evaluation.max_lengths(), strict=True)
    )
    return sorted({config.train.batch_size * per_sample, config.train.eval_batch_size * per_sample})


def _managed_collision(config, train, evaluation, num_devices: int = 1) -> dict:
    """{table: MCHManagedCollisionModule} of [managed_collision]; every raw-id feature's
    table must be one."""
    from sparse_jax import MCHManagedCollisionModule, managed_id_capacity

    mc = config.managed_collision
    names = {f"t_{key}" for key in train.keys}
    unknown = sorted(set(mc.tables) - names)
    if unknown:
        raise ConfigError(
            f"managed_collision.tables names {unknown}, not tables of this dataset ({sorted(names)})"
        )
    unmanaged = [f"t_{key}" for key in train.raw_keys if f"t_{key}" not in mc.tables]
    if unmanaged:
        raise ConfigError(
            f"data.raw_ids: tables {unmanaged} get raw 64-bit ids but have no managed-collision module; give "
            f"each its rows in [managed_collision] tables (e.g. {unmanaged[0]} = 1024)"
        )
    longest = dict(
        zip(
            train.keys,
            (max(a, b) for a, b in zip(train.max_lengths(), evaluation.max_lengths(), strict=True)),
            strict=True,
        )
    )

    def history(
        name: str,
    ) -> int:  # a window holds eviction_interval batches of the table's id capacity
        if mc.history_capacity:
            return mc.history_capacity
        ids = (
            config.train.batch_size // num_devices * longest[name[2:]]
        )  # per device, each padded alike
        return managed_id_capacity(ids) * num_devices * mc.eviction_interval

    modules = {}
    for name, rows in sorted(mc.tables.items()):
        try:
            modules[name] = MCHManagedCollisionModule(
                rows,
                history_capacity=history(name),
                eviction_policy=mc.eviction_policy,
                eviction_interval=mc.eviction_interval,
                threshold=mc.threshold,
                decay_exponent=mc.decay_exponent,
                # 0: not given (TOML has no None); "ttl" refuses it, the others need it unset
                single_ttl=mc.single_ttl or (0 if mc.eviction_policy == "ttl" else None),
            )
        except ValueError as e:
            raise ConfigError(f"[managed_collision] table {name!r}: {e}") from None
    return modules


def build(config, *, stream: bool = False):
    """(model, dense optimizer, train data, eval data, devices) for `config` (no training).
    `stream`: the train data is a `CriteoStream` (see `--stream`)."""
    import torch

    import hybrid
    from sparse_jax import EmbeddingBagConfig

    t = config.train
    mesh, num_devices = _mesh(config)
    for key, size in (
        ("train.batch_size", t.batch_size),
        ("train.eval_batch_size", t.eval_batch_size),
    ):
        if size % num_devices:
            raise ConfigError(
                f"{key} = {size} must divide by the {num_devices} devices of the mesh (the batch is "
                f"split over every device); e.g. {key} = {max(1, size // num_devices) * num_devices}"
            )
    train, evaluation = _load_data(config, stream)
    if not stream and t.batch_size > len(train):
        raise ConfigError(
            f"train.batch_size = {t.batch_size} exceeds the {len(train)} training samples"
        )
    managed = _managed_collision(config, train, evaluation, num_devices)
    tables = [
        EmbeddingBagConfig(
            name=f"t_{key}",
            num_embeddings=managed[f"t_{key}"].zch_size if f"t_{key}" in managed else n,
            embedding_dim=config.model.embedding_dim,
            feature_names=[key],
            data_type=config.model.data_type,
        )
        for key, n in zip(train.keys, train.num_embeddings, strict=True)
    ]
    if t.sharding and mesh is None:
        raise ConfigError(
            "train.sharding is set but train.mesh is empty; give a mesh (--mesh data=2,model=4)"
        )
    unknown = sorted(set(t.sharding) - {tb.name for tb in tables})
    if unknown:
        raise ConfigError(
            f"train.sharding names tables {unknown} that do not exist; tables: {[tb.name for tb in tables]}"
        )
    torch.manual_seed(config.seed)
    dense = _dense_tower(config, train.keys, train.num_dense)
    try:
        model = hybrid.Model(
            tables,
            dense,
            mesh=mesh,
            plan=dict(t.sharding) or None,
            sparse_optimizer=_sparse_rule(config),
            seed=config.seed,
            capacity_ladder=_ladder(config, train, evaluation),
            managed_collision_modules=managed or None,
        )
    except ValueError as e:
        raise ConfigError(f"train.sharding / train.mesh: {e}") from None
    o = config.dense_optimizer
    params = list(model.dense_parameters())
    dense_opt = (
        torch.optim.Adam(params, lr=o.lr) if o.name == "adam" else torch.optim.SGD(params, lr=o.lr)
    )
    return model, dense_opt, train, evaluation, num_devices


class _Processes:
    """This process's place under torchrun (rank 0 of 1 otherwise).

    Each process reads, prepares and places only its share of every global batch (samples
    `rank * B / world` on: the rows its devices hold in the mesh); the pooled embeddings
    come back as the same block of rows. Dense gradients are summed over processes (the
    loss is each share's sum over the global batch size), which gives exactly the
    single-process gradient.
    """

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.rank = self.dist.get_rank() if self.dist else 0
        self.world = self.dist.get_world_size() if self.dist else 1

    def all_sum(self, t):
        if self.dist:
            self.dist.all_reduce(t)
        return t

    def sum_grads(self, params) -> None:
        if self.dist:
            for p in params:
                if p.grad is not None:
                    self.dist.all_reduce(p.grad)

    def gather_objects(self, value) -> list:
        """`[value of process 0, value of process 1, ...]` (picklable values)."""
        if not self.dist:
            return [value]
        out = [None] * self.world
        self.dist.all_gather_object(out, value)
        return out

    def broadcast_object(self, value):
        """Process 0's `value` on every process."""
        if not self.dist:
            return value
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_rows(self, t):
        if not self.dist:
            return t
        import torch

        parts = [torch.empty_like(t) for _ in range(self.world)]
        self.dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)


def evaluate(model, data, batch_size: int) -> dict[str, float]:
    """Exact metrics over `data` (eval mode, no grad: the tables are not touched)."""
    import torch

    from hybrid.data import eval_batches
    from hybrid.training._metrics import eval_metrics

    procs = _Processes()
    device = next(model.dense_parameters()).device
    was_training = model.training
    model.eval()
    logits = []
    with torch.no_grad():
        for (dense, sparse, _), valid in eval_batches(
            data, batch_size, part=(procs.rank, procs.world)
        ):
            local = model(dense.to(device), sparse).reshape(-1)
            logits.append(procs.gather_rows(local).cpu()[:valid])
    model.train(was_training)
    return eval_metrics(torch.cat(logits), torch.from_numpy(data.labels))


def _refuse_to_replace_metrics(config, resume: bool) -> None:
    """A fresh run never replaces an earlier run's metrics unless log.overwrite (--overwrite)."""
    path = config.log.metrics_path
    if (
        resume
        or config.log.overwrite
        or not path
        or not os.path.isfile(path)
        or not os.path.getsize(path)
    ):
        return
    with open(path) as f:
        lines = sum(1 for line in f if line.strip())
    run_dir = os.path.dirname(os.path.normpath(path))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    fresh = os.path.join(
        f"{run_dir}-{stamp}" if run_dir else f"run-{stamp}", os.path.basename(path)
    )
    resume_hint = (
        ", resume that run with --resume (it appends to them)" if config.checkpoint.dir else ""
    )
    raise ConfigError(
        f"log.metrics_path {path} already holds {lines} metrics line(s) of an earlier run; refusing to "
        f"overwrite them. Pass --overwrite (or --set log.overwrite=true) to replace them{resume_hint}, or "
        f"write this run to another run directory: --set log.metrics_path={fresh}"
        + (" (and another checkpoint.dir)" if config.checkpoint.dir else "")
    )


def _where_outputs_went(config, newest_checkpoint) -> list[str]:
    """The closing lines: where this run's metrics and checkpoints are."""
    path, ckpt_dir = config.log.metrics_path, config.checkpoint.dir
    return [
        f"metrics: {path}" if path else "metrics: none written (log.metrics_path is empty)",
        f"checkpoints: {ckpt_dir} (newest: {newest_checkpoint.name})"
        if ckpt_dir and newest_checkpoint is not None
        else "checkpoints: none written (checkpoint.dir is empty; --set checkpoint.dir=... writes them)",
    ]


class _JsonLines:
    """Metrics as JSON lines; on resume, records past the checkpoint's step are dropped."""

    def __init__(self, path: str, resume_step: int | None):
        self.path = path
        if not path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if resume_step is None:
            open(path, "w").close()
            return
        kept = []
        if os.path.exists(path):
            with open(path) as f:
                kept = [
                    line
                    for line in f
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step
                ]
        with open(path, "w") as f:
            f.writelines(kept)

    def write(self, record: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _describe_plan(model, num_devices: int) -> str:
    plan = model.sparse_module.plan
    if plan is not None:
        return plan.stats_table()
    tables = ", ".join(
        f"{t.name} [{t.num_embeddings} x {t.embedding_dim}]" for t in model.sparse_module.tables
    )
    return f"one device, no sharding; tables: {tables}"


def run(
    config, *, resume: bool = False, stream: bool = False, export_only: bool = False, echo=print
) -> dict:
    """Train with a `TrainConfig` in this process. Returns the final eval metrics, the
    per-step training losses of this run, and the step reached. `stream`: see `--stream`.
    `export_only` (with `resume`): write export.dir from the newest checkpoint, no training
    (returns the step and "export")."""
    import torch
    from tqdm import tqdm

    import hybrid
    from hybrid.checkpoint import AsyncCheckpointer, load_checkpoint, save_checkpoint
    from hybrid.data import BatchLoader
    from hybrid.training._export_run import export_run, refuse_to_replace_export
    from hybrid.training._metrics import LossTracker

    procs = _Processes()
    if procs.rank != 0:  # one voice: rank 0 prints and writes metrics
        echo = _silent
        config = dataclasses.replace(config, log=dataclasses.replace(config.log, metrics_path=""))
    threads = torch.get_num_threads()
    saver = None  # the asynchronous checkpointer of the "orbax" format
    torch.set_num_threads(config.train.torch_threads)
    try:
        if not export_only:
            _refuse_to_replace_metrics(config, resume)  # before any data is read
        refuse_to_replace_export(config, processes=procs.world)
        t_build = time.perf_counter()
        model, dense_opt, train, evaluation, num_devices = build(config, stream=stream)
        build_s = time.perf_counter() - t_build  # data, model, the tables' initial draw
        # preflight before any step: writable, room, checkpointable, run identity
        ckpt_run = (
            _prepare_checkpoints(config, model, resume, echo) if config.checkpoint.dir else None
        )
        if config.checkpoint.dir and config.checkpoint.format == "npz" and procs.world > 1:
            raise ConfigError(
                f'checkpoint.format = "npz" is written by one process, but this run has {procs.world}; '
                'use "orbax" (every process writes its own shards) or "auto" under torchrun'
            )
        orbax = config.checkpoint.format == "orbax" or (
            config.checkpoint.format == "auto" and procs.world > 1
        )
        saver = AsyncCheckpointer() if config.checkpoint.dir and orbax else None
        device = hybrid.torch_device()  # the torch device of this process's JAX device
        model.dense.to(device)
        loader = None if stream else BatchLoader(train, config.train.batch_size, seed=config.seed)
        total = config.train.steps or config.train.epochs * loader.steps_per_epoch
        tracker = LossTracker(config.log.loss_window)
        start = 0
        ckpt_dir = config.checkpoint.dir
        restore_s = None
        if resume:
            if not ckpt_dir:
                raise ConfigError("--resume needs checkpoint.dir (--set checkpoint.dir=runs/x)")
            for bad, why in ckpt_run.skipped:  # damaged newer checkpoints: reported, kept
                echo(f"--resume: skipped {bad.name}: {why}")
            latest = ckpt_run.resume_from  # the newest intact checkpoint
            if latest is None and export_only:
                raise ConfigError(
                    f"--export-only: no checkpoint in {ckpt_dir} to export; train first (the run "
                    "writes export.dir itself at its end)"
                )
            if latest is None:
                echo(f"--resume: no checkpoint in {ckpt_dir} yet; starting at step 0")
            else:
                try:
                    t_restore = time.perf_counter()
                    meta = load_checkpoint(latest, model=model, dense_optimizer=dense_opt)
                    restore_s = time.perf_counter() - t_restore
                except ConfigError:
                    raise
                except ValueError as e:  # the checkpoint does not fit this config's model
                    raise ConfigError(
                        f"--resume: {e}. Resume with the config that wrote it, or train this config as a "
                        "fresh run in another checkpoint.dir"
                    ) from None
                start = int(meta["step"])
                tracker.load_state_dict(meta["loss_tracker"])
                _restore_stream(train, meta, latest)
                echo(f"resumed from {latest} at step {start}")
        if export_only:
            path = export_run(model, evaluation, config)
            echo(
                f"export: {path} (step {start}); serve it: python -m hybrid.serving serve --artifact {path} --port 8000"
            )
            return {"export": str(path), "step": start}
        log = _JsonLines(config.log.metrics_path, start if resume else None)
        log.write({"kind": "build", "step": start, "build_s": build_s})
        if restore_s is not None:
            log.write({"kind": "restore", "step": start, "restore_s": restore_s})
        echo(_describe_plan(model, num_devices))
        if stream:
            echo(
                f"streaming {len(config.data.paths) - 1} train file(s) / {len(evaluation)} eval samples, batch "
                f"{config.train.batch_size} over {num_devices} device(s), {total} steps (process {procs.rank} "
                f"of {procs.world} reads its share, shuffled in windows of {STREAM_WINDOW})"
            )
        else:
            echo(
                f"{len(train)} train / {len(evaluation)} eval samples, batch {config.train.batch_size} "
                f"over {num_devices} device(s), {total} steps ({loader.steps_per_epoch} per epoch)"
            )
        losses: dict[int, float] = {}
        metrics: dict = {}

        def checkpoint(step: int):
            if not ckpt_dir:
                return None
            t_save = time.perf_counter()
            try:
                return _save(step)
            finally:  # the step's wait (an asynchronous save commits in the background)
                log.write(
                    {"kind": "checkpoint", "step": step, "save_s": time.perf_counter() - t_save}
                )

        def _save(step: int):
            meta = {"loss_tracker": tracker.state_dict(), "config": config.to_dict()}
            if stream and procs.world > 1:  # each process's own position in its share
                meta["data_streams"] = procs.gather_objects(stream_position(step))
            elif stream:
                meta["data_stream"] = stream_position(step)
            # orbax: every process writes its shards, committed in the background
            save = saver.save if saver is not None else save_checkpoint
            return save(
                ckpt_dir,
                step=step,
                model=model,
                dense_optimizer=dense_opt,
                keep=config.checkpoint.keep,
                meta=meta,
                run_id=ckpt_run.run_id,
            )

        def run_eval(step: int) -> dict:
            result = evaluate(model, evaluation, config.train.eval_batch_size)
            log.write({"kind": "eval", "step": step, **result})
            echo(
                f"eval @ step {step}: AUC {result['auc']:.4f}  log loss {result['log_loss']:.4f}  "
                f"NE {result['ne']:.4f}  accuracy {result['accuracy']:.4f}  ({result['count']} samples)"
            )
            return result

        bar = tqdm(
            range(start, total),
            initial=start,
            total=total,
            desc="train",
            file=sys.stderr,
            mininterval=1.0,
            disable=True if procs.rank else None,
        )
        t_last, n_last = time.perf_counter(), 0
        t_start = t_last
        epoch_start = (t_last, start)  # (time, step) the current epoch's timing began at
        batch_size = config.train.batch_size

        positions: dict[int, dict] = {}  # --stream: the stream's position before batch `step`

        def stream_position(step: int) -> dict:  # after `step` batches (the pipeline reads ahead)
            return positions[step] if step in positions else train.state()

        def batches():  # this process's share of each global batch, read alone, in step order
            for step in range(start, total):
                if stream:
                    positions[step] = train.state()
                    positions.pop(step - 4, None)
                    yield next(train)
                else:
                    yield loader.batch(step, part=(procs.rank, procs.world))

        def loss_fn(logits, labels):  # this process's share of the global batch's mean loss
            return (
                torch.nn.functional.binary_cross_entropy_with_logits(
                    logits.reshape(-1), labels, reduction="sum"
                )
                / batch_size
            )

        pipeline = hybrid.TrainPipeline(
            model,
            dense_opt,
            loss_fn,
            device=device,
            dense_grad_hook=(lambda m: procs.sum_grads(m.dense_parameters()))
            if procs.dist
            else None,
        )
        items = batches()
        pending: list[torch.Tensor] = []  # losses not read yet: read every log.every steps

        def read_losses(first_step: int) -> float:
            values = procs.all_sum(torch.stack(pending).detach()).cpu().tolist()
            pending.clear()
            for i, value in enumerate(values):
                if math.isfinite(value):  # a skipped batch's loss stays out of the averages
                    tracker.add(value)
                losses[first_step + i] = value
            check_nonfinite()
            return values[-1]

        def check_nonfinite() -> None:  # read with the losses, not every step
            bad = pipeline.nonfinite()
            skipped = max(bad["sparse"], bad["dense"])
            t = config.train
            if skipped and (t.nonfinite == "stop" or skipped > t.max_nonfinite):
                raise hybrid.NonFiniteError(
                    f"step {start + bad['first_batch'] + 1} had a non-finite loss or gradient "
                    f"({skipped} batch(es) so far: {bad['sparse']} sparse and {bad['dense']} dense "
                    "updates skipped, so no weight or checkpoint holds a NaN); lower the learning "
                    'rates, check the input features, or set train.nonfinite = "skip" '
                    f"(train.max_nonfinite = {t.max_nonfinite}) to skip such batches"
                )

        for step in bar:
            pending.append(pipeline.progress(items))  # batch step+1 is prepared meanwhile
            n_last += batch_size
            done = step + 1
            if done % config.log.every == 0 or done == total:
                value = read_losses(done - len(pending) + 1)
                now = time.perf_counter()
                rate = n_last / max(now - t_last, 1e-9)
                t_last, n_last = now, 0
                record = {
                    "kind": "train",
                    "step": done,
                    "loss": value,
                    "loss_window": tracker.windowed,
                    "loss_lifetime": tracker.lifetime,
                    "samples_per_s": rate,
                    "eta_s": (time.perf_counter() - t_start) / (done - start) * (total - done),
                }
                if stream:
                    record["data"] = train.progress()  # epoch, samples of it read, file
                managed = model.managed_collision_stats()  # device counters, read at log time only
                if managed:
                    record["managed_collision"] = {
                        table: dict(
                            zip(
                                ("occupancy", "admissions", "evictions"),
                                np.asarray(c).tolist(),
                                strict=True,
                            )
                        )
                        for table, c in managed.items()
                    }
                log.write(record)
                bar.set_postfix(loss=f"{tracker.windowed:.4f}", samples_per_s=f"{rate:.0f}")
                if bar.disable:
                    echo(
                        f"step {done}/{total}  loss {tracker.windowed:.4f} (window)  {rate:.0f} samples/s  "
                        f"ETA {_duration(record['eta_s'])}"
                    )
            if loader is not None and (done % loader.steps_per_epoch == 0 or done == total):
                if pending:  # the epoch's steps computed (their losses read) before the clock
                    read_losses(done - len(pending) + 1)
                now = time.perf_counter()
                seconds, steps = now - epoch_start[0], done - epoch_start[1]
                epoch = -(-done // loader.steps_per_epoch)
                epoch_rate = steps * batch_size / max(seconds, 1e-9)
                log.write(
                    {
                        "kind": "epoch",
                        "step": done,
                        "epoch": epoch,
                        "steps": steps,
                        "seconds": seconds,
                        "samples_per_s": epoch_rate,
                    }
                )
                echo(
                    f"epoch {epoch}: {steps} steps in {seconds:.2f} s ({epoch_rate:.0f} samples/s"
                    + (
                        f"; compiles included, build {build_s:.2f} s before it)"
                        if epoch_start[1] == start
                        else ")"
                    )
                )
                epoch_start = (time.perf_counter(), done)
            evaluating = config.train.eval_every and done % config.train.eval_every == 0
            saving = config.checkpoint.every and done % config.checkpoint.every == 0
            if (evaluating or saving) and done != total:
                if pending:  # the checkpoint's loss tracker includes every step
                    read_losses(done - len(pending) + 1)
                pipeline.wait_prepared()  # no preparation runs beside eval / the checkpoint
                if evaluating:
                    metrics = run_eval(done)
                if saving:
                    checkpoint(done)
        pipeline.close()
        if stream:
            train.close()
        bar.close()
        metrics = run_eval(total)
        newest = checkpoint(total)
        if saver is not None:
            saver.close()  # the last save committed
            saver = None
        if config.export.dir:
            path = export_run(model, evaluation, config)
            echo(
                f"export: {path}; serve it: python -m hybrid.serving serve --artifact {path} --port 8000"
            )
        for line in _where_outputs_went(config, newest):
            echo(line)
        return {"eval": metrics, "losses": losses, "step": total}
    finally:
        if saver is not None:
            saver.close()
        torch.set_num_threads(threads)


def _prepare_checkpoints(config, model, resume: bool, echo):
    """The checkpoint preflight (`hybrid.checkpoint.prepare_run`), run by process 0 alone (it
    may move files aside); every process gets its decision, or its ConfigError."""
    from hybrid.checkpoint import prepare_run

    procs = _Processes()
    result = None
    if procs.rank == 0:
        try:
            result = prepare_run(
                config.checkpoint.dir,
                config=config.to_dict(),
                model=model,
                resume=resume,
                overwrite=config.checkpoint.overwrite,
                allow_config_change=config.checkpoint.allow_config_change,
                echo=echo,
            )
        except ConfigError as e:
            result = e
    result = procs.broadcast_object(result)
    if isinstance(result, ConfigError):
        raise result
    return result


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _silent(*_args) -> None:
    pass


if __name__ == "__main__":
    from hybrid._cpu_env import reexec_with_hugepages

    # XLA:CPU's fresh buffers in huge pages. Under `python -m hybrid.train`, `hybrid/__init__`
    # has already restarted the process (before jax and torch loaded), so this returns at
    # once; it restarts a run started any other way (the file as a script)
    reexec_with_hugepages()
    sys.exit(main())
