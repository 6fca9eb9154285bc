"""DLRM interaction arches: TorchRec's `InteractionArch` and `InteractionDCNArch`.

Both take the dense arch's output `dense_features [B, D]` and the sparse embeddings stacked
as `sparse_features [B, F, D]` (one row per feature, all of width D).

- `InteractionArch`: the dot products of every pair among the F + 1 vectors
  (dense first, then the features; upper triangle, row-major, no diagonal), concatenated
  after `dense_features`: `[B, D + F + F * (F - 1) / 2]`.
- `InteractionDCNArch`: a cross network over the flat concatenation `[dense, f_1, ..., f_F]`:
  `[B, (F + 1) * D] -> [B, (F + 1) * D]`.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["InteractionArch", "InteractionDCNArch", "interaction_output_size"]


def interaction_output_size(num_sparse_features: int, embedding_dim: int) -> int:
    """Width of `InteractionArch`'s output: `D + F + F choose 2` (`D` when F is 0)."""
    f = num_sparse_features
    return embedding_dim + (f + f * (f - 1) // 2 if f > 0 else 0)


def _check_inputs(name: str, f: int, dense: torch.Tensor, sparse: torch.Tensor) -> None:
    if dense.dim() != 2:
        raise ValueError(f"{name}: dense_features must be [B, D], got shape {tuple(dense.shape)}.")
    b, d = dense.shape
    if tuple(sparse.shape) != (b, f, d):
        raise ValueError(
            f"{name}: sparse_features must be [B, F, D] = [{b}, {f}, {d}] to match "
            f"dense_features {tuple(dense.shape)} and num_sparse_features={f}, got shape "
            f"{tuple(sparse.shape)}."
        )


class InteractionArch(nn.Module):
    """Pairwise dot products of `[dense] + sparse features`, after `dense_features`.

    Args:
        num_sparse_features: F.

    forward(dense_features [B, D], sparse_features [B, F, D]) -> [B, D + F + F choose 2].
    With F = 0 it returns `dense_features` unchanged.
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        if num_sparse_features < 0:
            raise ValueError(
                f"InteractionArch num_sparse_features={num_sparse_features} must be >= 0."
            )
        self.F = num_sparse_features
        rows, cols = torch.triu_indices(self.F + 1, self.F + 1, offset=1)
        self.register_buffer("triu_rows", rows, persistent=False)
        self.register_buffer("triu_cols", cols, persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        _check_inputs("InteractionArch", self.F, dense_features, sparse_features)
        if self.F == 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        gram = torch.bmm(combined, combined.transpose(1, 2))  # [B, F + 1, F + 1]
        return torch.cat((dense_features, gram[:, self.triu_rows, self.triu_cols]), dim=1)


class InteractionDCNArch(nn.Module):
    """A cross network over the flattened `[dense, f_1, ..., f_F]`.

    Args:
        num_sparse_features: F.
        crossnet: any `[B, (F + 1) * D] -> [B, M]` module, usually a `LowRankCrossNet`
            with `in_features=(F + 1) * D`.

    forward(dense_features [B, D], sparse_features [B, F, D]) -> crossnet's output.
    With F = 0 it returns `dense_features` unchanged (TorchRec's rule).
    """

    def __init__(self, num_sparse_features: int, crossnet: nn.Module) -> None:
        super().__init__()
        if num_sparse_features < 0:
            raise ValueError(
                f"InteractionDCNArch num_sparse_features={num_sparse_features} must be >= 0."
            )
        self.F = num_sparse_features
        self.crossnet = crossnet

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        _check_inputs("InteractionDCNArch", self.F, dense_features, sparse_features)
        if self.F == 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        return self.crossnet(combined.reshape(dense_features.shape[0], -1))
