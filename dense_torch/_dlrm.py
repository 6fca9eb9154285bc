"""DLRM dense towers: `DLRM` (dot interaction) and `DLRM_DCN` (DCN-v2 interaction).

TorchRec's `torchrec.models.dlrm` without its `sparse_arch`: the pooled embeddings arrive
as a `KeyedTensor` (the dense contract), so a tower is

    dense_features [B, n_dense] --dense_arch (MLP)--> [B, D]
    embeddings (KeyedTensor)    --stack----------->   [B, F, D]
        --inter_arch--> [B, I] --over_arch (MLP, last layer linear)--> logits [B, O]

Submodule and parameter names (`dense_arch.model._mlp.0._linear.weight`, `over_arch.model.1.bias`,
`inter_arch.crossnet.W_kernels.0`, ...) are TorchRec's, so the dense part of a TorchRec DLRM's
state_dict (every key not under `sparse_arch.`) loads into these towers as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._contract import stack_features
from ._crossnet import LowRankCrossNet
from ._interaction import InteractionArch, InteractionDCNArch, interaction_output_size
from ._keyed_tensor import KeyedTensor
from ._mlp import MLP

__all__ = ["DLRM", "DLRM_DCN", "DenseArch", "OverArch"]


class DenseArch(nn.Module):
    """The dense features' MLP (ReLU after every layer): `[B, in_features] -> [B, sizes[-1]]`."""

    def __init__(
        self, in_features: int, layer_sizes: Sequence[int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.model = MLP(in_features, layer_sizes, bias=True, activation="relu", device=device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class OverArch(nn.Module):
    """The top MLP: ReLU layers, then a linear last layer: `[B, in_features] -> [B, sizes[-1]]`.

    TorchRec insists on two or more layers; one layer is accepted here (a single linear map).
    """

    def __init__(
        self, in_features: int, layer_sizes: Sequence[int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        layer_sizes = list(layer_sizes)
        if not layer_sizes:
            raise ValueError(
                "OverArch layer_sizes is empty; give at least the output size, e.g. [1]."
            )
        hidden = layer_sizes[:-1]
        self.model = nn.Sequential(
            MLP(in_features, hidden, bias=True, activation="relu", device=device),
            nn.Linear(hidden[-1] if hidden else in_features, layer_sizes[-1], device=device),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class DLRM(nn.Module):
    """DLRM's dense tower (https://arxiv.org/abs/1906.00091) behind the dense contract.

    Args:
        embedding_dim: D, the width of every sparse feature's pooled embedding.
        num_sparse_features: F, the number of features in `embeddings`.
        dense_in_features: n_dense, the width of `dense_features`.
        dense_arch_layer_sizes: the dense MLP's layer sizes; the last must equal D.
        over_arch_layer_sizes: the over arch's layer sizes; the last is the number of logits.
        feature_names: optional; when given, `embeddings.keys()` must equal it (same order).
        device: of the parameters.

    forward(dense_features [B, n_dense], embeddings: KeyedTensor) -> logits
    [B, over_arch_layer_sizes[-1]]. `embeddings` holds F features of width D each, taken in
    key order (an EmbeddingBagCollection's output order); a feature of another width is an
    error naming it.
    """

    def __init__(
        self,
        embedding_dim: int,
        num_sparse_features: int,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        *,
        feature_names: Sequence[str] | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        dense_arch_layer_sizes = list(dense_arch_layer_sizes)
        if not dense_arch_layer_sizes or dense_arch_layer_sizes[-1] != embedding_dim:
            raise ValueError(
                f"{name}: the dense arch's last layer size must equal embedding_dim="
                f"{embedding_dim} (its output is dotted with the embeddings), got "
                f"dense_arch_layer_sizes={dense_arch_layer_sizes}."
            )
        if num_sparse_features < 1:
            raise ValueError(f"{name} num_sparse_features={num_sparse_features} must be >= 1.")
        if feature_names is not None:
            feature_names = list(feature_names)
            if len(feature_names) != num_sparse_features:
                raise ValueError(
                    f"{name} got {len(feature_names)} feature_names {feature_names} but "
                    f"num_sparse_features={num_sparse_features}; they must agree."
                )
        self.embedding_dim = embedding_dim
        self.num_sparse_features = num_sparse_features
        self.feature_names = feature_names
        self.dense_in_features = dense_in_features
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes, device=device)
        self.inter_arch, over_in_features = self._interaction(device)
        self.over_arch = OverArch(over_in_features, over_arch_layer_sizes, device=device)

    def _interaction(self, device: torch.device | None) -> tuple[nn.Module, int]:
        """The interaction module and its output width (overridden by DLRM_DCN)."""
        f, d = self.num_sparse_features, self.embedding_dim
        return InteractionArch(num_sparse_features=f), interaction_output_size(f, d)

    @classmethod
    def from_feature_dims(
        cls,
        feature_dims: Mapping[str, int],
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        **kwargs: Any,
    ) -> DLRM:
        """Build from `{feature_name: embedding_dim}` in the embeddings' key order.

        Checks that every feature has the same dim (naming the first that does not) and
        fixes `feature_names`, so `forward` also checks the keys. Extra keyword arguments go
        to the constructor (e.g. `dcn_num_layers` for `DLRM_DCN`).
        """
        items = list(feature_dims.items())
        if not items:
            raise ValueError(f"{cls.__name__}.from_feature_dims got no features.")
        first, dim = items[0]
        for feature, other in items[1:]:
            if other != dim:
                raise ValueError(
                    f"{cls.__name__} needs every feature to share one embedding_dim: feature "
                    f"{feature!r} has {other} but {first!r} has {dim}; give their tables the "
                    "same embedding_dim."
                )
        return cls(
            dim,
            len(items),
            dense_in_features,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            feature_names=[feature for feature, _ in items],
            **kwargs,
        )

    def forward(self, dense_features: torch.Tensor, embeddings: KeyedTensor) -> torch.Tensor:
        if dense_features.dim() != 2 or dense_features.shape[1] != self.dense_in_features:
            raise ValueError(
                f"{type(self).__name__}: dense_features must be [B, {self.dense_in_features}] "
                f"(dense_in_features={self.dense_in_features}), got shape "
                f"{tuple(dense_features.shape)}; give each sample {self.dense_in_features} dense "
                "values, or build the tower with dense_in_features equal to their number."
            )
        sparse = stack_features(
            type(self).__name__,
            embeddings,
            num_features=self.num_sparse_features,
            embedding_dim=self.embedding_dim,
            feature_names=self.feature_names,
            batch_size=dense_features.shape[0],
        )
        embedded_dense = self.dense_arch(dense_features)
        return self.over_arch(self.inter_arch(embedded_dense, sparse))


class DLRM_DCN(DLRM):
    """DLRM with a low-rank DCN-v2 cross network as its interaction (TorchRec's DLRM_DCN).

    Args: those of `DLRM`, plus
        dcn_num_layers: cross layers.
        dcn_low_rank_dim: rank of each layer's cross matrix.

    The cross network maps `[B, (F + 1) * D]` to itself, and the over arch reads that.
    """

    def __init__(
        self,
        embedding_dim: int,
        num_sparse_features: int,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        *,
        feature_names: Sequence[str] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self._dcn_num_layers = dcn_num_layers
        self._dcn_low_rank_dim = dcn_low_rank_dim
        super().__init__(
            embedding_dim,
            num_sparse_features,
            dense_in_features,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            feature_names=feature_names,
            device=device,
        )

    def _interaction(self, device: torch.device | None) -> tuple[nn.Module, int]:
        width = (self.num_sparse_features + 1) * self.embedding_dim
        crossnet = LowRankCrossNet(
            in_features=width, num_layers=self._dcn_num_layers, low_rank=self._dcn_low_rank_dim
        )
        if device is not None:
            crossnet.to(device)
        return InteractionDCNArch(self.num_sparse_features, crossnet), width
