"""Synthetic Criteo-shaped click data with a planted signal (see `hybrid.data._planted`).

`synthetic_clicks(n, ...)` draws `n` samples as a `ClickData`: `num_sparse` Zipf-distributed
multi-id features (`cat_0`, ...), `num_dense` Gaussian dense features, labels from the
planted logits. `world_seed` fixes the signal (shared by a train and an eval set),
`seed` the samples.
"""

from __future__ import annotations

from hybrid.data._arrays import ClickData
from hybrid.data._planted import planted_signal_data

__all__ = ["synthetic_clicks"]


def synthetic_clicks(
    num_samples: int,
    *,
    num_sparse: int = 26,
    num_dense: int = 13,
    num_embeddings: int = 1000,
    max_bag: int = 3,
    seed: int = 0,
    world_seed: int = 1234,
) -> ClickData:
    raw = planted_signal_data(
        num_samples,
        num_sparse=num_sparse,
        num_dense=num_dense,
        num_embeddings=num_embeddings,
        max_bag=max_bag,
        seed=seed,
        world_seed=world_seed,
    )
    return ClickData(
        raw.keys,
        raw.dense,
        raw.bag_ids,
        raw.bag_lengths,
        raw.labels,
        (num_embeddings,) * num_sparse,
    )
