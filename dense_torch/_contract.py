"""Checks of the dense contract's `embeddings` argument, shared by the dense towers.

A tower is called as `tower(dense_features [B, n_dense], embeddings: KeyedTensor)` with
`embeddings.values()` `[B, sum of per-feature dims]`, key_dim 1. These helpers turn a
mismatch into a sentence naming the feature and what the tower expected.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._keyed_tensor import KeyedTensor

__all__ = ["check_embeddings", "check_feature_dims", "stack_features"]


def check_embeddings(owner: str, embeddings: object, batch_size: int | None) -> KeyedTensor:
    """`embeddings` is a KeyedTensor with 2-D values `[B, *]` keyed along dim 1."""
    if not isinstance(embeddings, KeyedTensor):
        raise TypeError(
            f"{owner} expects embeddings as a dense_torch.KeyedTensor, got "
            f"{type(embeddings).__name__}; wrap a [B, F * D] tensor with "
            "KeyedTensor(feature_names, [D] * F, values)."
        )
    values = embeddings.values()
    if values.dim() != 2 or embeddings.key_dim() not in (1, -1):
        raise ValueError(
            f"{owner} expects embeddings.values() of shape [B, sum of feature dims] keyed "
            f"along dim 1, got shape {tuple(values.shape)} with key_dim="
            f"{embeddings.key_dim()}."
        )
    if batch_size is not None and values.shape[0] != batch_size:
        raise ValueError(
            f"{owner}: embeddings have batch size {values.shape[0]} but dense_features have "
            f"{batch_size}; both must hold the same samples."
        )
    return embeddings


def check_feature_dims(
    owner: str, embeddings: KeyedTensor, features: Sequence[str], embedding_dim: int
) -> None:
    """Every name in `features` is a key of `embeddings`, of width `embedding_dim`."""
    for feature in features:
        if feature not in embeddings:
            raise KeyError(
                f"{owner} needs feature {feature!r}, which the embeddings do not have; "
                f"their features are {embeddings.keys()}."
            )
        dim = embeddings[feature].shape[1]
        if dim != embedding_dim:
            raise ValueError(
                f"{owner}: feature {feature!r} has embedding dim {dim}, but every feature "
                f"must have embedding_dim={embedding_dim}; give its table embedding_dim="
                f"{embedding_dim}."
            )


def stack_features(
    owner: str,
    embeddings: KeyedTensor,
    *,
    num_features: int,
    embedding_dim: int,
    feature_names: Sequence[str] | None,
    batch_size: int,
) -> torch.Tensor:
    """`embeddings` as `[B, F, D]`, one row per feature in key order, after checking it."""
    check_embeddings(owner, embeddings, batch_size)
    keys = embeddings.keys()
    if feature_names is not None and list(keys) != list(feature_names):
        raise ValueError(
            f"{owner} was built for features {list(feature_names)} (in this order), but the "
            f"embeddings have {keys}; pass the pooled output of the matching tables."
        )
    if len(keys) != num_features:
        raise ValueError(
            f"{owner} was built for num_sparse_features={num_features}, but the embeddings "
            f"have {len(keys)} features {keys}; build it with num_sparse_features="
            f"{len(keys)}."
        )
    check_feature_dims(owner, embeddings, keys, embedding_dim)
    return embeddings.values().reshape(batch_size, num_features, embedding_dim)
