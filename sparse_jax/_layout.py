"""Table layout: which tables are stacked into which buffer, and where each feature reads.

Tables of the same dim and dtype share one stacked buffer (TBE-style), so a batch looks
them up together. A feature maps to (group, row offset of its table in the group, rows,
pooling). Pure Python: static facts the jitted code closes over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sparse_jax._configs import (
    BaseEmbeddingConfig,
    DataType,
    PoolingType,
    check_table_configs,
    embedding_names_by_table,
)

__all__ = ["FeatureSlot", "TableLayout", "group_name"]


def group_name(dim: int, data_type: DataType) -> str:
    return f"{data_type.value.lower()}_d{dim}"


@dataclasses.dataclass(frozen=True)
class FeatureSlot:
    feature: str  # the KJT key it reads
    table: str
    group: str
    row_offset: int  # first row of the table inside the group buffer
    num_rows: int
    dim: int
    pooling: PoolingType | None
    out_offset: int  # first column of this feature in the pooled output
    name: str = ""  # its output name: `feature`, or `feature@table` when several tables read it

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.feature)


@dataclasses.dataclass(frozen=True)
class TableLayout:
    tables: tuple[BaseEmbeddingConfig, ...]
    groups: dict[str, tuple[int, int]]  # group -> (total rows, dim)
    group_dtype: dict[str, DataType]
    table_group: dict[str, tuple[str, int]]  # table -> (group, row offset)
    features: tuple[FeatureSlot, ...]  # in output order: tables in order, features within a table

    @classmethod
    def build(cls, tables: Sequence[BaseEmbeddingConfig]) -> TableLayout:
        tables = check_table_configs(tables)
        groups: dict[str, tuple[int, int]] = {}
        group_dtype: dict[str, DataType] = {}
        table_group: dict[str, tuple[str, int]] = {}
        for t in tables:
            g = group_name(t.embedding_dim, t.data_type)
            rows, _ = groups.get(g, (0, t.embedding_dim))
            table_group[t.name] = (g, rows)
            groups[g] = (rows + t.num_embeddings, t.embedding_dim)
            group_dtype[g] = t.data_type
        features, col = [], 0
        for t, names in zip(tables, embedding_names_by_table(tables), strict=True):
            g, off = table_group[t.name]
            for f, name in zip(t.feature_names, names, strict=True):
                features.append(
                    FeatureSlot(
                        f,
                        t.name,
                        g,
                        off,
                        t.num_embeddings,
                        t.embedding_dim,
                        getattr(t, "pooling", None),
                        col,
                        name,
                    )
                )
                col += t.embedding_dim
        return cls(tables, groups, group_dtype, table_group, tuple(features))

    @property
    def feature_names(self) -> list[str]:
        """Output names in order (`feature@table` for a feature several tables read)."""
        return [s.name for s in self.features]

    def embedding_names_by_table(self) -> list[list[str]]:
        return [[s.name for s in self.features if s.table == t.name] for t in self.tables]

    @property
    def output_dims(self) -> list[int]:
        return [s.dim for s in self.features]

    def slots_of_group(self, group: str) -> list[FeatureSlot]:
        return [s for s in self.features if s.group == group]

    def key_indices(self, kjt_keys: Sequence[str]) -> list[int]:
        """Index in the KJT of each feature, in output order; a missing feature is an error."""
        keys = list(kjt_keys)
        missing = sorted({s.feature for s in self.features if s.feature not in keys})
        if missing:
            raise ValueError(
                f"feature(s) {missing} of tables {sorted({s.table for s in self.features if s.feature in missing})} "
                f"are not in the KeyedJaggedTensor (its keys: {keys}); add them (an empty bag is fine)"
            )
        return [keys.index(s.feature) for s in self.features]
