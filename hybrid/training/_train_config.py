"""The training job's configuration: a TOML file, `--set key=value` overrides, checked.

Sections and keys (every key optional; defaults below). Unknown sections or keys, and
values of the wrong type, raise `ConfigError` naming the key and the file.

    seed = 0                                    # tables, dense init, data order
    [data]   source = "movielens" | "criteo" | "synthetic"; cache_dir; paths (criteo files);
             num_embeddings (criteo hash size / synthetic table size); max_rows;
             eval_fraction (criteo: last share of rows held out); num_samples,
             num_eval_samples, num_sparse, num_dense (synthetic); raw_ids (features read
             as raw 64-bit ids, no vocabulary: movielens "user", "item", "zip", ...; criteo
             "cat_0".."cat_25" or "*" for all; each needs a managed-collision table)
    [model]  arch = "DLRM" | "DLRM_DCN" | "two_tower"; embedding_dim; dense_arch_layer_sizes;
             over_arch_layer_sizes; dcn_num_layers; dcn_low_rank_dim; query_features,
             candidate_features, tower_layer_sizes (two_tower); data_type = "FP32" | "FP16"
             | "BF16" (the tables' storage; lookups and updates compute in fp32)
    [sparse_optimizer] name = "rowwise_adagrad" | "adagrad" | "adam" | "sgd"; lr; eps;
             stochastic_rounding (FP16/BF16 tables: stochastic write-back, seeded by `seed`,
             as FBGEMM's default; false rounds to nearest)
    [dense_optimizer]  name = "adam" | "sgd"; lr
    [train]  mesh ("data=2,model=4"; "" = one device); sharding ({table = "row_wise"}, else
             the planner's plan); batch_size (global, divisible by the device count);
             steps (0: epochs x batches per epoch); epochs; eval_every (steps, 0: at the
             end); eval_batch_size; capacity_ladder ([]: derived from the batch sizes);
             torch_threads; nonfinite ("stop": a batch with a non-finite loss or gradient
             is skipped, never applied, and training stops at the next log line naming
             it, exit code 3; "skip": such batches are skipped and counted, and training
             stops once more than max_nonfinite were skipped)
    [checkpoint] dir ("" = none); every (steps; 0 = only at the end); keep (newest intact
             checkpoints of this run kept); overwrite (a fresh run into a directory holding
             another run's checkpoints moves them aside into <dir>/.replaced-*/ instead of
             refusing); allow_config_change (--resume with a changed seed,
             train.batch_size or [data] instead of refusing: no longer exact); format
             ("auto": "orbax" under torchrun, "npz" for one process; "orbax": every
             process writes its own shards, asynchronously; "npz": one file, one writer)
    [managed_collision] tables ({t_user = 512}: these tables take their ids through a
             managed-collision module with that many rows: raw ids mapped to rows on the
             device, evicting by eviction_policy = "lru" | "lfu" | "distance_lfu" (TorchRec's
             DistanceLFU: count / (steps since seen + 1) ** decay_exponent) | "ttl" (only ids
             unseen for more than single_ttl steps give up their rows) every
             eviction_interval steps, admitting an id seen threshold times; history_capacity
             (ids a window holds; 0: per table, its ids in a device's part of a training batch
             rounded up to a power of two, x devices x eviction_interval))
    [export] dir ("" = none: a serving artifact written at the end of the run, or from the
             newest checkpoint with `--export-only --resume`); quantize ("" = the tables as
             trained; "int8" | "int4" | "int2" | "fp16": `hybrid.quantize` first);
             max_batch_size (most samples a request may hold; 0: train.batch_size);
             overwrite (replace an existing export.dir; `--overwrite` sets it)
    [log]    metrics_path (JSON lines; "" = none); every (steps); loss_window; overwrite (a
             fresh run (no --resume) whose metrics_path already holds metrics replaces them
             instead of refusing; `--overwrite` sets it and checkpoint.overwrite)

Tables come from the dataset: one `t_<feature>` per sparse feature with the feature's
`num_embeddings` and the model's `embedding_dim`.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from collections.abc import Mapping, Sequence

from hybrid._errors import ConfigError

__all__ = ["ConfigError", "TrainConfig", "load_config"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    source: str = "movielens"
    cache_dir: str = ""
    paths: list[str] = dataclasses.field(default_factory=list)
    num_embeddings: int = 100_000
    max_rows: int = 0
    eval_fraction: float = 0.2
    num_samples: int = 65_536
    num_eval_samples: int = 16_384
    num_sparse: int = 26
    num_dense: int = 13
    raw_ids: list[str] = dataclasses.field(default_factory=list)
    stream: bool = False  # criteo: stream the training files per process (as `--stream`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    arch: str = "DLRM"
    embedding_dim: int = 16
    data_type: str = "FP32"  # the tables' storage (EmbeddingBagConfig.data_type): FP32, FP16, BF16
    dense_arch_layer_sizes: list[int] = dataclasses.field(default_factory=lambda: [64, 16])
    over_arch_layer_sizes: list[int] = dataclasses.field(default_factory=lambda: [64, 1])
    dcn_num_layers: int = 2
    dcn_low_rank_dim: int = 8
    query_features: list[str] = dataclasses.field(default_factory=list)
    candidate_features: list[str] = dataclasses.field(default_factory=list)
    tower_layer_sizes: list[int] = dataclasses.field(default_factory=lambda: [64, 32])


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseOptimizerSection:
    name: str = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    stochastic_rounding: bool = True  # FP16 / BF16 tables: FBGEMM's default write-back


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseOptimizerSection:
    name: str = "adam"
    lr: float = 1e-3


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSection:
    mesh: str = ""
    sharding: dict[str, str] = dataclasses.field(default_factory=dict)
    batch_size: int = 512
    steps: int = 0
    epochs: int = 1
    eval_every: int = 0
    eval_batch_size: int = 4096
    capacity_ladder: list[int] = dataclasses.field(default_factory=list)
    torch_threads: int = 1
    nonfinite: str = "stop"
    max_nonfinite: int = 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    dir: str = ""
    every: int = 0
    keep: int = 2
    overwrite: bool = False
    allow_config_change: bool = False
    format: str = (
        "auto"  # "npz" (one process), "orbax" (every process writes), "auto": by process count
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManagedCollisionSection:
    tables: dict[str, int] = dataclasses.field(default_factory=dict)
    eviction_policy: str = "lru"
    eviction_interval: int = 1
    threshold: int = 1
    history_capacity: int = 0
    decay_exponent: float = 1.0
    single_ttl: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportSection:
    dir: str = ""
    quantize: str = ""
    max_batch_size: int = 0
    overwrite: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogSection:
    metrics_path: str = ""
    every: int = 50
    loss_window: int = 100
    overwrite: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    seed: int = 0
    data: DataSection = dataclasses.field(default_factory=DataSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    sparse_optimizer: SparseOptimizerSection = dataclasses.field(
        default_factory=SparseOptimizerSection
    )
    dense_optimizer: DenseOptimizerSection = dataclasses.field(
        default_factory=DenseOptimizerSection
    )
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    managed_collision: ManagedCollisionSection = dataclasses.field(
        default_factory=ManagedCollisionSection
    )
    export: ExportSection = dataclasses.field(default_factory=ExportSection)
    log: LogSection = dataclasses.field(default_factory=LogSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_CHOICES = {
    "data.source": ("movielens", "criteo", "synthetic"),
    "model.arch": ("DLRM", "DLRM_DCN", "two_tower"),
    "model.data_type": ("FP32", "FP16", "BF16"),
    "sparse_optimizer.name": ("rowwise_adagrad", "adagrad", "adam", "sgd"),
    "dense_optimizer.name": ("adam", "sgd"),
    "train.nonfinite": ("stop", "skip"),
    "managed_collision.eviction_policy": ("lru", "lfu", "distance_lfu", "ttl"),
    "checkpoint.format": ("auto", "npz", "orbax"),
    "export.quantize": ("", "int8", "int4", "int2", "fp16"),
}
_POSITIVE = {
    "model.embedding_dim",
    "train.batch_size",
    "train.epochs",
    "train.eval_batch_size",
    "train.torch_threads",
    "log.every",
    "log.loss_window",
    "checkpoint.keep",
    "data.num_embeddings",
    "data.num_samples",
    "data.num_eval_samples",
    "data.num_sparse",
    "data.num_dense",
    "model.dcn_num_layers",
    "model.dcn_low_rank_dim",
    "managed_collision.eviction_interval",
    "managed_collision.threshold",
}
_NON_NEGATIVE = {
    "seed",
    "train.steps",
    "train.eval_every",
    "train.max_nonfinite",
    "checkpoint.every",
    "data.max_rows",
    "managed_collision.history_capacity",
    "managed_collision.single_ttl",
    "export.max_batch_size",
}


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None else str(hint)


def _check_value(value, hint, key: str, where: str):
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {key} must be a list of {item.__name__}, got {value!r}")
        return [_check_value(v, item, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: {key} must be a table of {item.__name__}, got {value!r}")
        return {str(k): _check_value(v, item, f"{key}.{k}", where) for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (hint is bool) or not isinstance(value, hint):
        raise ConfigError(
            f"{where}: {key} must be {_type_name(hint)}, got {value!r} ({type(value).__name__})"
        )
    return value


def _section(cls, values: Mapping, prefix: str, where: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in hints:
            raise ConfigError(
                f"{where}: unknown key {key!r}; known keys here: {', '.join(prefix + n for n in names)}"
            )
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: {key} must be a [{key}] section, got {value!r}")
            kwargs[name] = _section(hint, value, f"{key}.", where)
            continue
        value = _check_value(value, hint, key, where)
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ConfigError(f"{where}: {key} = {value!r}; choose one of {list(_CHOICES[key])}")
        if key in _POSITIVE and value < 1:
            raise ConfigError(f"{where}: {key} = {value!r} must be >= 1")
        if key in _NON_NEGATIVE and value < 0:
            raise ConfigError(f"{where}: {key} = {value!r} must be >= 0")
        kwargs[name] = value
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], object]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {text!r}: write key=value, e.g. --set train.batch_size=256")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word: a string
    return key.split("."), value


def load_config(path: str | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config of TOML file `path` (None: defaults) with `section.key=value` overrides."""
    where = path or "<defaults>"
    raw: dict = {}
    if path:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(
                f"config file {path} not found; pass --config configs/<name>.toml"
            ) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for text in overrides:
        parts, value = _parse_override(text)
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {part!r} is not a section")
        node[parts[-1]] = value
    if overrides:
        where += " with --set " + " ".join(overrides)
    return _section(TrainConfig, raw, "", where)
