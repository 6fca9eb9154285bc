"""Table configs with TorchRec's names: `EmbeddingBagConfig`, `EmbeddingConfig`.

A table has rows (`num_embeddings`) of width `embedding_dim`; one or more features look
it up (`feature_names`), so a table can be shared. Configs are frozen, keyword-only and
validated once, at construction.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "DataType",
    "EmbeddingBagConfig",
    "EmbeddingConfig",
    "PoolingType",
    "check_table_configs",
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
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        try:
            return enum_cls[value.upper()]
        except KeyError:
            pass
    choices = ", ".join(m.name for m in enum_cls)
    raise ValueError(f"table {table!r}: {field}={value!r} is not one of {choices}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaseEmbeddingConfig:
    """Fields shared by bag and sequence tables (TorchRec's `BaseEmbeddingConfig`).

    `weight_init_min` / `weight_init_max` default to TorchRec's +-sqrt(1/num_embeddings).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] = ()
    data_type: DataType = DataType.FP32
    weight_init_min: float | None = None
    weight_init_max: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a table needs a non-empty string name, got {self.name!r}")
        table = self.name
        for field in ("num_embeddings", "embedding_dim"):
            value = getattr(self, field)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
                raise ValueError(f"table {table!r}: {field} must be an integer >= 1, got {value!r}")
            object.__setattr__(self, field, int(value))
        names = self.feature_names
        if isinstance(names, str):
            raise ValueError(
                f"table {table!r}: feature_names must be a list of names, got the string "
                f"{names!r}; write feature_names=[{names!r}]"
            )
        names = tuple(names) if names else (table,)
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"table {table!r}: feature names must be non-empty strings, got {name!r}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"table {table!r}: feature name(s) {dup} listed twice")
        object.__setattr__(self, "feature_names", names)
        object.__setattr__(self, "data_type", _as_enum(DataType, self.data_type, "data_type", table))
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


@dataclasses.dataclass(frozen=True, kw_only=True)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingConfig(BaseEmbeddingConfig):
    """An unpooled (sequence) table: every id gets its own row back."""


def check_table_configs(tables: Sequence[BaseEmbeddingConfig]) -> tuple[BaseEmbeddingConfig, ...]:
    """Validate a collection's tables together: unique table names, each feature in one table."""
    tables = tuple(tables)
    if not tables:
        raise ValueError("an embedding collection needs at least one table config")
    seen_tables: set[str] = set()
    owner: dict[str, str] = {}
    for t in tables:
        if not isinstance(t, BaseEmbeddingConfig):
            raise ValueError(f"expected EmbeddingBagConfig/EmbeddingConfig, got {type(t).__name__}")
        if t.name in seen_tables:
            raise ValueError(f"table name {t.name!r} is used by two tables; table names must be unique")
        seen_tables.add(t.name)
        for f in t.feature_names:
            if f in owner:
                raise ValueError(
                    f"feature {f!r} is listed by tables {owner[f]!r} and {t.name!r}; a feature looks up "
                    "exactly one table (to share a table, list several features on one table)"
                )
            owner[f] = t.name
    return tables
