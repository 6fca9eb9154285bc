"""DCN-v2 cross networks: TorchRec's `CrossNet` and `LowRankCrossNet`, same parameters.

Each layer crosses the running vector `x_l` with the input `x_0` (Wang et al. 2020,
https://arxiv.org/abs/2008.13535):

    x_{l+1} = x_0 * (K_l x_l + b_l) + x_l          CrossNet, K_l: [N, N]
    x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l    LowRankCrossNet, W_l: [N, r], V_l: [r, N]

Shapes are kept: `[B, N] -> [B, N]`. Kernels start xavier-normal and biases zero (as
TorchRec), so initialization is deterministic under `torch.manual_seed`. Parameter names
and shapes are TorchRec's, so its state_dict loads as it is.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CrossNet", "LowRankCrossNet"]


def _check(name: str, in_features: int, num_layers: int) -> None:
    if in_features < 1:
        raise ValueError(f"{name} in_features={in_features} must be a positive integer.")
    if num_layers < 0:
        raise ValueError(f"{name} num_layers={num_layers} must be >= 0.")


def _xavier(*shape: int) -> nn.Parameter:
    return nn.Parameter(nn.init.xavier_normal_(torch.empty(*shape)))


def _zeros(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape))


class CrossNet(nn.Module):
    """Full-rank cross network: `num_layers` crossings of an `[B, in_features]` input.

    Parameters: `kernels[l]` `[N, N]` and `bias[l]` `[N, 1]` (TorchRec's shapes).
    """

    def __init__(self, in_features: int, num_layers: int) -> None:
        super().__init__()
        _check("CrossNet", in_features, num_layers)
        self._num_layers = num_layers
        self.kernels = nn.ParameterList(
            [_xavier(in_features, in_features) for _ in range(num_layers)]
        )
        self.bias = nn.ParameterList([_zeros(in_features, 1) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x_0 = input.unsqueeze(2)  # [B, N, 1]
        x_l = x_0
        for kernel, bias in zip(self.kernels, self.bias, strict=True):
            x_l = x_0 * (torch.matmul(kernel, x_l) + bias) + x_l
        return x_l.squeeze(2)


class LowRankCrossNet(nn.Module):
    """Low-rank cross network: each `N x N` cross matrix is `W_l @ V_l` of rank `low_rank`.

    Parameters: `W_kernels[l]` `[N, r]`, `V_kernels[l]` `[r, N]`, `bias[l]` `[N]`.
    A rank near N/4 keeps most of the full-rank accuracy (TorchRec's advice).
    """

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1) -> None:
        super().__init__()
        _check("LowRankCrossNet", in_features, num_layers)
        if low_rank < 1:
            raise ValueError(
                f"LowRankCrossNet low_rank={low_rank} must be >= 1 (the rank of each cross "
                "matrix); TorchRec suggests about in_features / 4."
            )
        self._num_layers = num_layers
        self._low_rank = low_rank
        # Creation order (all W, then all V, then biases) is TorchRec's: same seed, same init.
        self.W_kernels = nn.ParameterList(
            [_xavier(in_features, low_rank) for _ in range(num_layers)]
        )
        self.V_kernels = nn.ParameterList(
            [_xavier(low_rank, in_features) for _ in range(num_layers)]
        )
        self.bias = nn.ParameterList([_zeros(in_features) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x_0 = input
        x_l = x_0
        for w, v, bias in zip(self.W_kernels, self.V_kernels, self.bias, strict=True):
            x_l = x_0 * (nn.functional.linear(nn.functional.linear(x_l, v), w) + bias) + x_l
        return x_l
