"""`TwoTower`: a retrieval tower pair behind the dense contract.

TorchRec's two-tower example (`examples/retrieval/modules/two_tower.py`) without its
embedding collection: the features of each group are taken from the `KeyedTensor`,
concatenated in the order given, and projected by the group's MLP; the logit is the dot
product of the two projections.

    query:     cat(embeddings[f] for f in query_features)     --query_proj-->     [B, E]
    candidate: cat(embeddings[f] for f in candidate_features) --candidate_proj--> [B, E]
    logit = sum(query * candidate, dim=1)                                          [B]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ._contract import check_embeddings, check_feature_dims
from ._keyed_tensor import KeyedTensor
from ._mlp import MLP

__all__ = ["TwoTower"]


def _group(name: str, features: Sequence[str]) -> list[str]:
    features = list(features)
    if not features:
        raise ValueError(f"TwoTower {name} is empty; give at least one feature name.")
    seen: set[str] = set()
    for feature in features:
        if feature in seen:
            raise ValueError(
                f"TwoTower {name} names feature {feature!r} twice; list each feature once."
            )
        seen.add(feature)
    return features


class TwoTower(nn.Module):
    """Query and candidate towers whose dot product scores a (query, candidate) pair.

    Args:
        query_features: features of the query tower, in concatenation order.
        candidate_features: features of the candidate tower, in concatenation order.
        embedding_dim: D, the pooled width of every feature of both groups.
        layer_sizes: each tower's MLP layer sizes; `layer_sizes[-1]` is the width E of the
            shared space. The MLPs take `D * len(group)` inputs.
        activation_on_last: apply ReLU after the last layer too. `True` is TorchRec's
            default, which makes both projections non-negative and so every logit >= 0;
            pass `False` to let the logits take either sign.
        device, dtype: of the parameters.

    `embeddings` may hold more features than the two groups name; the rest are ignored.
    Submodules are named `query_proj` / `candidate_proj`, as in TorchRec's example.
    """

    def __init__(
        self,
        query_features: Sequence[str],
        candidate_features: Sequence[str],
        embedding_dim: int,
        layer_sizes: Sequence[int],
        *,
        activation_on_last: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.query_features = _group("query_features", query_features)
        self.candidate_features = _group("candidate_features", candidate_features)
        layer_sizes = list(layer_sizes)
        if not layer_sizes:
            raise ValueError(
                "TwoTower layer_sizes is empty; give at least the output width, e.g. [64]."
            )
        self.embedding_dim = embedding_dim

        def tower(num_features: int) -> MLP:
            return MLP(
                embedding_dim * num_features,
                layer_sizes,
                activation_on_last=activation_on_last,
                device=device,
                dtype=dtype,
            )

        self.query_proj = tower(len(self.query_features))
        self.candidate_proj = tower(len(self.candidate_features))

    def _pooled(
        self, embeddings: KeyedTensor, features: list[str], batch_size: int | None
    ) -> torch.Tensor:
        check_embeddings("TwoTower", embeddings, batch_size)
        check_feature_dims("TwoTower", embeddings, features, self.embedding_dim)
        (group,) = KeyedTensor.regroup([embeddings], [features])
        return group

    def query_embedding(self, embeddings: KeyedTensor) -> torch.Tensor:
        """The query tower's output `[B, layer_sizes[-1]]`."""
        return self.query_proj(self._pooled(embeddings, self.query_features, None))

    def candidate_embedding(self, embeddings: KeyedTensor) -> torch.Tensor:
        """The candidate tower's output `[B, layer_sizes[-1]]`."""
        return self.candidate_proj(self._pooled(embeddings, self.candidate_features, None))

    def forward(self, dense_features: torch.Tensor | None, embeddings: KeyedTensor) -> torch.Tensor:
        """The logit `[B]` (one per row, not `[B, 1]`): query . candidate.

        `dense_features` is part of the dense contract but unused; it may be None. When
        given, its batch size must match the embeddings'.
        """
        batch_size = None if dense_features is None else dense_features.shape[0]
        query = self.query_proj(self._pooled(embeddings, self.query_features, batch_size))
        candidate = self.candidate_proj(
            self._pooled(embeddings, self.candidate_features, batch_size)
        )
        return (query * candidate).sum(dim=1)
