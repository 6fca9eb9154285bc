"""Table configs with TorchRec's names: `EmbeddingBagConfig`, `EmbeddingConfig`.

A table has rows (`num_embeddings`) of width `embedding_dim`; one or more features look
it up (`feature_names`), so a table can be shared. Configs are frozen, keyword-only and
validated once, at construction.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

__all__ = [
    "DataType",
    "EmbeddingBagConfig",
    "EmbeddingConfig",
    "PoolingType",
    "check_table_configs",
    "embedding_names_by_table",
]


class PoolingType(enum.Enum):
    """How the rows of one bag are combined (TorchRec's `PoolingType`)."""

    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


class DataType(enum.Enum):
    """Storage dtype of a table (TorchRec's `DataType`, the float subset)."""

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"

    @property
    def numpy_dtype(self) -> np.dtype:
        import ml_dtypes  # shipped with jax

        return {
            DataType.FP32: np.dtype(np.float32),
            DataType.FP16: np.dtype(np.float16),
            DataType.BF16: np.dtype(ml_dtypes.bfloat16),
        }[self]

    @property
    def itemsize(self) -> int:
        return 4 if self is DataType.FP32 else 2


def _as_enum(enum_cls, value, field: str, table: str):
    """`enum_cls` from itself, its name in any case, or an enum of another library with the
    same name (TorchRec's `PoolingType.MEAN`, `DataType.FP16`)."""
    if isinstance(value, enum_cls):
        return value
    name = value.name if isinstance(value, enum.Enum) else value
    if isinstance(name, str):
        try:
            return enum_cls[name.upper()]
        except KeyError:
            pass
    choices = ", ".join(m.name for m in enum_cls)
    hint = ""
    if field == "data_type" and isinstance(name, str) and name.upper() in _QUANTIZED:
        hint = (
            f"; {name.upper()} tables are for inference: train in FP32/FP16/BF16, then "
            "hybrid.quantize(model, ...) or sparse_jax.QuantEmbeddingBagCollection"
        )
    raise ValueError(f"table {table!r}: {field}={value!r} is not one of {choices}{hint}")


_QUANTIZED = frozenset({"INT8", "INT4", "INT2", "UINT8"})


# TorchRec config fields that configure features hybridrec does not have: accepted at their
# default (so TorchRec code that spells them out runs), refused otherwise, with the reason.
_UNSUPPORTED_FIELDS = {
    "num_embeddings_post_pruning": (None, "row pruning for inference is not supported"),
    "need_pos": (False, "position-weighted features (TorchRec's FP modules) are not supported"),
    "input_dim": (None, "virtual (key-value) tables are not supported; see issue #16 for raw ids"),
    "total_num_buckets": (
        None,
        "virtual (key-value) tables are not supported; see issue #16 for raw ids",
    ),
    "use_virtual_table": (
        False,
        "virtual (key-value) tables are not supported; see issue #16 for raw ids",
    ),
    "virtual_table_eviction_policy": (None, "virtual (key-value) tables are not supported"),
    "enable_embedding_update": (
        False,
        "write-back embedding updates (TorchRec inference) are not supported",
    ),
    "stash_weights": (False, "weight stashing is not supported"),
}


@dataclasses.dataclass(frozen=True)
class BaseEmbeddingConfig:
    """Fields shared by bag and sequence tables (TorchRec's `BaseEmbeddingConfig`, same
    field order, so positional `EmbeddingBagConfig(rows, dim, name)` works too).

    `weight_init_min` / `weight_init_max` default to TorchRec's +-sqrt(1/num_embeddings).
    `init_fn(key, shape, dtype) -> array` (a `jax.nn.initializers` initializer, e.g.
    `jax.nn.initializers.normal(0.01)`) replaces the uniform init; TorchRec's `init_fn`
    fills a torch tensor in place, which has no JAX meaning.
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: tuple[str, ...] = ()
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    num_embeddings_post_pruning: int | None = None
    init_fn: Callable | None = None
    need_pos: bool = False
    input_dim: int | None = None
    total_num_buckets: int | None = None
    use_virtual_table: bool = False
    virtual_table_eviction_policy: object = None
    enable_embedding_update: bool = False
    stash_weights: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a table needs a non-empty string name, got {self.name!r}")
        table = self.name
        for field in ("num_embeddings", "embedding_dim"):
            value = getattr(self, field)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
                raise ValueError(f"table {table!r}: {field} must be an integer >= 1, got {value!r}")
            object.__setattr__(self, field, int(value))
        for field, (default, why) in _UNSUPPORTED_FIELDS.items():
            if getattr(self, field) != default:
                raise ValueError(
                    f"table {table!r}: {field}={getattr(self, field)!r}: {why}; leave it at {default!r}"
                )
        if self.init_fn is not None and not callable(self.init_fn):
            raise ValueError(
                f"table {table!r}: init_fn must be callable as init_fn(key, shape, dtype), got "
                f"{self.init_fn!r}"
            )
        names = self.feature_names
        if isinstance(names, str):
            raise ValueError(
                f"table {table!r}: feature_names must be a list of names, got the string "
                f"{names!r}; write feature_names=[{names!r}]"
            )
        names = tuple(names) if names else (table,)
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"table {table!r}: feature names must be non-empty strings, got {name!r}"
                )
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"table {table!r}: feature name(s) {dup} listed twice")
        object.__setattr__(self, "feature_names", names)
        object.__setattr__(
            self, "data_type", _as_enum(DataType, self.data_type, "data_type", table)
        )
        bound = math.sqrt(1.0 / self.num_embeddings)
        lo = -bound if self.weight_init_min is None else float(self.weight_init_min)
        hi = bound if self.weight_init_max is None else float(self.weight_init_max)
        if not lo <= hi:
            raise ValueError(f"table {table!r}: weight_init_min={lo} is above weight_init_max={hi}")
        object.__setattr__(self, "weight_init_min", lo)
        object.__setattr__(self, "weight_init_max", hi)

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    def get_weight_init_max(self) -> float:
        return self.weight_init_max

    def get_weight_init_min(self) -> float:
        return self.weight_init_min

    def initial_weights(self, key, rows: int | None = None) -> np.ndarray | object:
        """`[rows, embedding_dim]` fp32 starting rows (`rows` defaults to the whole table):
        `init_fn(key, shape, float32)`, else uniform in [weight_init_min, weight_init_max].
        A managed-collision table draws fresh rows for its evicted slots with `rows=k`."""
        import jax.numpy as jnp

        shape = (self.num_embeddings if rows is None else rows, self.embedding_dim)
        if self.init_fn is None:
            from sparse_jax._uniform_init import uniform_rows  # imports jax

            return uniform_rows(key, *shape, self.weight_init_min, self.weight_init_max)
        w = jnp.asarray(self.init_fn(key, shape, jnp.float32))
        if w.shape != shape:
            raise ValueError(
                f"table {self.name!r}: init_fn returned shape {tuple(w.shape)}; expected {shape}"
            )
        return w.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """A pooled table: every bag of ids becomes one `embedding_dim` vector (SUM or MEAN)."""

    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self) -> None:
        super().__post_init__()
        pooling = _as_enum(PoolingType, self.pooling, "pooling", self.name)
        if pooling is PoolingType.NONE:
            raise ValueError(
                f"table {self.name!r}: pooling=NONE is a sequence table; use EmbeddingConfig "
                "with EmbeddingCollection"
            )
        object.__setattr__(self, "pooling", pooling)


@dataclasses.dataclass(frozen=True)
class EmbeddingConfig(BaseEmbeddingConfig):
    """An unpooled (sequence) table: every id gets its own row back."""


def as_table_configs(tables) -> tuple:
    """`tables` as a tuple of this package's configs. Also taken: TorchRec's
    `EmbeddingBagConfig` / `EmbeddingConfig` (the same fields, copied; its enums by name), and
    a collection, TorchRec's or ours (`embedding_bag_configs()` / `embedding_configs()`), as
    TorchRec's planner takes the module it plans."""
    for method in ("embedding_bag_configs", "embedding_configs"):
        if callable(getattr(tables, method, None)):
            tables = getattr(tables, method)()
            break
    if isinstance(tables, BaseEmbeddingConfig | str | bytes) or not isinstance(tables, Iterable):
        raise TypeError(
            f"tables must be a list of EmbeddingBagConfig/EmbeddingConfig or a collection, got a "
            f"{type(tables).__name__}"
        )
    return tuple(_as_config(t) for t in tables)


def _as_config(t):
    if isinstance(t, BaseEmbeddingConfig):
        return t
    ours = {"EmbeddingBagConfig": EmbeddingBagConfig, "EmbeddingConfig": EmbeddingConfig}.get(
        type(t).__name__
    )
    if ours is None or not dataclasses.is_dataclass(t):
        return t  # refused by the caller, naming it
    fields = {f.name for f in dataclasses.fields(ours)}
    values = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name in fields}
    if _torchrec_default_init(t):
        values["init_fn"] = None  # the same uniform init, drawn here
    if values.get("init_fn") is not None:
        raise ValueError(
            f"table {getattr(t, 'name', '?')!r}: a {type(t).__module__}.{type(t).__name__} with "
            "init_fn (a torch initializer) cannot initialize a JAX table; give sparse_jax's "
            "config an init_fn(key, shape, dtype), e.g. jax.nn.initializers.normal(0.01)"
        )
    return ours(**values)


def _torchrec_default_init(t) -> bool:
    """Whether `t.init_fn` is the one TorchRec's config sets when none is given:
    `partial(torch.nn.init.uniform_, a=min, b=max)` over the config's own bounds."""
    fn = getattr(t, "init_fn", None)
    if not isinstance(fn, functools.partial) or fn.args:
        return False
    func = fn.func
    if (
        getattr(func, "__name__", "") != "uniform_"
        or getattr(func, "__module__", "") != "torch.nn.init"
    ):
        return False
    bounds = (
        (t.get_weight_init_min(), t.get_weight_init_max())
        if hasattr(t, "get_weight_init_min")
        else None
    )
    return bounds is not None and fn.keywords == {"a": bounds[0], "b": bounds[1]}


def check_table_configs(tables: Sequence[BaseEmbeddingConfig]) -> tuple[BaseEmbeddingConfig, ...]:
    """Validate a collection's tables together: unique table names. A feature listed by
    several tables looks up each (its outputs are named `feature@table`, as TorchRec)."""
    tables = as_table_configs(tables)
    if not tables:
        raise ValueError("an embedding collection needs at least one table config")
    seen_tables: set[str] = set()
    for t in tables:
        if not isinstance(t, BaseEmbeddingConfig):
            raise ValueError(f"expected EmbeddingBagConfig/EmbeddingConfig, got {type(t).__name__}")
        if t.name in seen_tables:
            raise ValueError(
                f"table name {t.name!r} is used by two tables; table names must be unique"
            )
        seen_tables.add(t.name)
    return tables


def embedding_names_by_table(tables: Sequence[BaseEmbeddingConfig]) -> list[list[str]]:
    """Per table, the output name of each of its features: the feature's name, or
    `feature@table` when several tables list the feature (TorchRec's rule)."""
    count: dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            count[f] = count.get(f, 0) + 1
    return [[f if count[f] == 1 else f"{f}@{t.name}" for f in t.feature_names] for t in tables]
