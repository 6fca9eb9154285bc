"""Random embedding workloads shared by the tests: tables, a KJT, and the same bags as lists."""

from __future__ import annotations

import dataclasses

import numpy as np

from sparse_jax import EmbeddingBagConfig, KeyedJaggedTensor


@dataclasses.dataclass
class Case:
    tables: list
    kjt: KeyedJaggedTensor
    bag_ids: dict  # feature -> [[ids]]
    bag_weights: dict | None
    features: list  # (feature, table, pooling) in output order
    stride: int


def random_case(
    rng,
    *,
    dims=(4, 8),
    batch=6,
    max_len=5,
    pooling=("SUM", "MEAN"),
    weighted=False,
    shared=True,
    rows=(7, 40),
    data_type="FP32",
    hot_rows=None,
    shuffle_keys=True,
) -> Case:
    """Tables of the given dims (the first table shared by two features when `shared`),
    bags with duplicate ids (few rows) and empty bags; KJT keys in a shuffled order."""
    tables = []
    for i, d in enumerate(dims):
        feats = [f"t{i}_f0", f"t{i}_f1"] if shared and i == 0 else [f"t{i}_f0"]
        tables.append(
            EmbeddingBagConfig(
                name=f"t{i}",
                num_embeddings=int(rng.integers(*rows)),
                embedding_dim=int(d),
                feature_names=feats,
                pooling=pooling[i % len(pooling)],
                data_type=data_type,
            )
        )
    features = [(f, t.name, t.pooling.value) for t in tables for f in t.feature_names]
    num_rows = {t.name: t.num_embeddings for t in tables}
    keys = [f for f, _, _ in features]
    order = rng.permutation(len(keys)) if shuffle_keys else range(len(keys))
    keys = [keys[i] for i in order]
    table_of = {f: t for f, t, _ in features}
    bag_ids, bag_weights = {}, {}
    values, weights, lengths = [], [], []
    for k in keys:
        bag_ids[k], bag_weights[k] = [], []
        for _ in range(batch):
            n = int(rng.integers(0, max_len + 1))
            high = (
                num_rows[table_of[k]] if hot_rows is None else min(hot_rows, num_rows[table_of[k]])
            )
            ids = rng.integers(0, high, size=n).tolist()
            w = rng.uniform(0.5, 1.5, size=n).astype(np.float32).tolist()
            bag_ids[k].append(ids)
            bag_weights[k].append(w)
            values += ids
            weights += w
            lengths.append(n)
    kjt = KeyedJaggedTensor(
        keys,
        np.array(values, np.int64),
        weights=np.array(weights, np.float32) if weighted else None,
        lengths=np.array(lengths),
    )
    return Case(tables, kjt, bag_ids, bag_weights if weighted else None, features, batch)
