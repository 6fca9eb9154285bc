"""Synthetic click data with a planted signal: a model that learns must beat chance clearly.

Each sample has `num_dense` Gaussian dense features and `num_sparse` bags of 1..max_bag ids.
Ids follow a Zipf law over the table's rows (ranks shuffled, so frequency says nothing
about the label). A random `signal_fraction` of each table's rows push the click
probability up and as many push it down; the label is

    y ~ Bernoulli(sigmoid(sum_f mean(effect[ids of bag f]) + dense_features @ w + bias))

`bayes_auc` is the AUC of the true logits: the best any model can reach on that data.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = ["SyntheticClicks", "planted_signal_data"]


@dataclasses.dataclass(frozen=True)
class SyntheticClicks:
    keys: tuple[str, ...]
    dense: np.ndarray  # [N, num_dense] float32
    bag_ids: tuple[np.ndarray, ...]  # per feature: all ids, sample-major
    bag_lengths: np.ndarray  # [num_sparse, N] int64
    labels: np.ndarray  # [N] float32
    logits: np.ndarray  # [N] float64, the true logits
    num_embeddings: int

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(self, start: int, stop: int):
        """`(dense [B, n], (keys, values, lengths), labels [B])` as torch tensors, key-major."""
        values, lengths = [], []
        for f in range(len(self.keys)):
            offsets = np.concatenate([[0], np.cumsum(self.bag_lengths[f])])
            values.append(self.bag_ids[f][offsets[start] : offsets[stop]])
            lengths.append(self.bag_lengths[f, start:stop])
        sparse = (
            list(self.keys),
            torch.from_numpy(np.concatenate(values)),
            torch.from_numpy(np.concatenate(lengths)),
        )
        return (
            torch.from_numpy(self.dense[start:stop]),
            sparse,
            torch.from_numpy(self.labels[start:stop]),
        )


def _zipf_ids(
    rng: np.random.Generator, n: int, num_embeddings: int, a: float, perm: np.ndarray
) -> np.ndarray:
    p = 1.0 / np.arange(1, num_embeddings + 1) ** a
    return perm[rng.choice(num_embeddings, size=n, p=p / p.sum())]


def planted_signal_data(
    num_samples: int,
    *,
    num_sparse: int = 4,
    num_dense: int = 4,
    num_embeddings: int = 1000,
    max_bag: int = 3,
    zipf_a: float = 1.1,
    signal_fraction: float = 0.1,
    effect: float = 2.0,
    seed: int = 0,
    world_seed: int = 1234,
) -> SyntheticClicks:
    """`num_samples` samples; `world_seed` fixes the planted signal (same for train and eval
    sets), `seed` the samples drawn from it."""
    world = np.random.default_rng(world_seed)
    perms = [world.permutation(num_embeddings) for _ in range(num_sparse)]
    effects = []
    for _ in range(num_sparse):
        e = np.zeros(num_embeddings)
        rows = world.permutation(num_embeddings)
        k = int(signal_fraction * num_embeddings)
        e[rows[:k]], e[rows[k : 2 * k]] = effect, -effect
        effects.append(e)
    w_dense = world.normal(0.0, 0.7, size=num_dense)

    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(num_samples, num_dense)).astype(np.float32)
    logits = dense.astype(np.float64) @ w_dense
    lengths = rng.integers(1, max_bag + 1, size=(num_sparse, num_samples))
    bag_ids = []
    for f in range(num_sparse):
        ids = _zipf_ids(rng, int(lengths[f].sum()), num_embeddings, zipf_a, perms[f])
        bag_of = np.repeat(np.arange(num_samples), lengths[f])
        logits += np.bincount(bag_of, weights=effects[f][ids], minlength=num_samples) / lengths[f]
        bag_ids.append(ids.astype(np.int64))
    labels = (rng.random(num_samples) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    keys = tuple(f"cat_{f}" for f in range(num_sparse))
    return SyntheticClicks(
        keys, dense, tuple(bag_ids), lengths.astype(np.int64), labels, logits, num_embeddings
    )
