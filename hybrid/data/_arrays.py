"""`ClickData`: a labelled click table in memory, jagged sparse features stored flat.

Every loader in `hybrid.data` produces one: dense features `[N, n_dense]` float32, labels
`[N]` float32 (0/1), and per sparse feature its ids (sample-major, all samples' bags one
after another) and bag lengths. `rows(indices)` gathers any samples into a batch in the
form `hybrid.Model` accepts: `(dense, (keys, values, lengths), labels)`, key-major values
as TorchRec lays them out. `num_embeddings[f]` is the table size feature f needs; 0 marks
a feature of raw 64-bit ids (any int64 but `2**63 - 1`, unbounded: its table needs a
managed-collision module, see `hybrid.Model(managed_collision_modules=...)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["ClickData", "concat_rows"]


@dataclasses.dataclass(frozen=True, eq=False)
class ClickData:
    keys: tuple[str, ...]
    dense: np.ndarray  # [N, n_dense] float32
    values: tuple[np.ndarray, ...]  # per feature: int64 ids, sample-major
    lengths: np.ndarray  # [num_features, N] int64
    labels: np.ndarray  # [N] float32
    num_embeddings: tuple[int, ...]  # per feature: ids lie in [0, num_embeddings)

    def __post_init__(self):
        n = self.labels.shape[0]
        k = len(self.keys)
        if self.dense.ndim != 2 or self.dense.shape[0] != n:
            raise ValueError(f"ClickData: dense is {self.dense.shape}, expected [{n}, n_dense]")
        if self.lengths.shape != (k, n) or len(self.values) != k or len(self.num_embeddings) != k:
            raise ValueError(
                f"ClickData: {k} keys need lengths [{k}, {n}] and {k} value arrays and table sizes"
            )
        for f, key in enumerate(self.keys):
            if int(self.lengths[f].sum()) != self.values[f].shape[0]:
                raise ValueError(f"ClickData: feature {key!r} lengths do not sum to its id count")
            if self.num_embeddings[f] == 0:  # raw ids
                if self.values[f].size and self.values[f].max() == np.iinfo(np.int64).max:
                    raise ValueError(
                        f"ClickData: feature {key!r} holds the raw id 2**63 - 1, which is reserved"
                    )
            elif self.values[f].size and (
                self.values[f].min() < 0 or self.values[f].max() >= self.num_embeddings[f]
            ):
                raise ValueError(
                    f"ClickData: feature {key!r} has ids outside [0, {self.num_embeddings[f]})"
                )
        object.__setattr__(
            self,
            "_offsets",
            tuple(np.concatenate([[0], np.cumsum(self.lengths[f])]) for f in range(k)),
        )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def raw_keys(self) -> tuple[str, ...]:
        """The features of raw 64-bit ids (`num_embeddings` 0)."""
        return tuple(k for k, n in zip(self.keys, self.num_embeddings, strict=True) if n == 0)

    @property
    def num_dense(self) -> int:
        return int(self.dense.shape[1])

    def max_lengths(self) -> tuple[int, ...]:
        """The longest bag of each feature (at least 1)."""
        return tuple(max(1, int(row.max(initial=0))) for row in self.lengths)

    def _feature_ids(self, f: int, rows: np.ndarray) -> np.ndarray:
        lengths = self.lengths[f, rows]
        starts = self._offsets[f][rows]
        total = int(lengths.sum())
        # position j of the output belongs to row r: starts[r] + (j - first output index of r)
        first = np.cumsum(lengths) - lengths
        index = np.repeat(starts - first, lengths) + np.arange(total)
        return self.values[f][index]

    def take(self, rows: np.ndarray) -> ClickData:
        """A new ClickData holding `rows` (in that order)."""
        rows = np.asarray(rows, np.int64)
        return ClickData(
            self.keys,
            self.dense[rows],
            tuple(self._feature_ids(f, rows) for f in range(len(self.keys))),
            self.lengths[:, rows],
            self.labels[rows],
            self.num_embeddings,
        )

    def rows(self, rows: np.ndarray):
        """`(dense [B, n], (keys, values, lengths), labels [B])` torch tensors for `rows`."""
        rows = np.asarray(rows, np.int64)
        values = np.concatenate([self._feature_ids(f, rows) for f in range(len(self.keys))])
        lengths = self.lengths[:, rows].reshape(-1)
        return (
            torch.from_numpy(np.ascontiguousarray(self.dense[rows])),
            (list(self.keys), torch.from_numpy(values), torch.from_numpy(lengths)),
            torch.from_numpy(np.ascontiguousarray(self.labels[rows])),
        )

    # -- npz round trip ---------------------------------------------------------------------
    def to_arrays(self, prefix: str = "") -> dict[str, np.ndarray]:
        out = {
            f"{prefix}keys": np.array(self.keys),
            f"{prefix}dense": self.dense,
            f"{prefix}lengths": self.lengths,
            f"{prefix}labels": self.labels,
            f"{prefix}num_embeddings": np.array(self.num_embeddings, np.int64),
        }
        for f, v in enumerate(self.values):
            out[f"{prefix}values_{f}"] = v
        return out

    @classmethod
    def from_arrays(cls, arrays, prefix: str = "") -> ClickData:
        keys = tuple(str(k) for k in arrays[f"{prefix}keys"])
        return cls(
            keys,
            arrays[f"{prefix}dense"],
            tuple(arrays[f"{prefix}values_{f}"] for f in range(len(keys))),
            arrays[f"{prefix}lengths"],
            arrays[f"{prefix}labels"],
            tuple(int(n) for n in arrays[f"{prefix}num_embeddings"]),
        )


def concat_rows(parts: Sequence[ClickData]) -> ClickData:
    """Samples of several ClickData with the same features, one after another."""
    first = parts[0]
    return ClickData(
        first.keys,
        np.concatenate([p.dense for p in parts]),
        tuple(np.concatenate([p.values[f] for p in parts]) for f in range(len(first.keys))),
        np.concatenate([p.lengths for p in parts], axis=1),
        np.concatenate([p.labels for p in parts]),
        tuple(max(p.num_embeddings[f] for p in parts) for f in range(len(first.keys))),
    )
