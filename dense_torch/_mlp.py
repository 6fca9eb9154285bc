"""`Perceptron` and `MLP`: TorchRec's `torchrec.modules.mlp`, same arguments, same state_dict.

A Perceptron is `activation(linear(x))`; an MLP is a stack of them. Parameter names
(`_mlp.{i}._linear.weight`) are TorchRec's, so weights load from a TorchRec model as they are.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["MLP", "Perceptron", "Activation"]

# What `activation` may be: "relu" / "sigmoid"; a module (shared by every layer); a module
# class or zero-argument factory (called once per layer); or a function of a tensor.
Activation = str | nn.Module | Callable[[], nn.Module] | Callable[[torch.Tensor], torch.Tensor]

_NAMED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
}


def _is_factory(fn: Callable) -> bool:
    """True when `fn` can be called with no arguments (a module class or factory)."""
    if isinstance(fn, type):
        return issubclass(fn, nn.Module)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins such as torch.relu have no signature
        return False
    return all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in signature.parameters.values()
    )


def _resolve_activation(
    activation: Activation,
) -> nn.Module | Callable[[torch.Tensor], torch.Tensor]:
    """One layer's activation: a factory is called (fresh module), anything else is kept."""
    if isinstance(activation, str):
        if activation not in _NAMED_ACTIVATIONS:
            raise ValueError(
                f"activation {activation!r} is not a known name; use one of "
                f"{sorted(_NAMED_ACTIVATIONS)} or pass a callable or an nn.Module."
            )
        return _NAMED_ACTIVATIONS[activation]
    if isinstance(activation, nn.Module):
        return activation
    if not callable(activation):
        raise TypeError(
            f"activation must be a name, an nn.Module or a callable, got "
            f"{type(activation).__name__}."
        )
    if _is_factory(activation):
        module = activation()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"activation {activation!r} takes no arguments, so it was called as a module "
                f"factory, but it returned {type(module).__name__}, not an nn.Module."
            )
        return module
    return activation


def _check_sizes(in_size: int, layer_sizes: Sequence[int]) -> None:
    for name, size in [("in_size", in_size)] + [
        (f"layer_sizes[{i}]", s) for i, s in enumerate(layer_sizes)
    ]:
        if int(size) != size or size < 1:
            raise ValueError(f"MLP {name}={size!r} must be a positive integer.")


class Perceptron(nn.Module):
    """`activation(x @ W.T + b)`: `[*, in_size] -> [*, out_size]`.

    `nn.Linear`'s default initialization, so it is deterministic under `torch.manual_seed`.
    """

    def __init__(
        self,
        in_size: int,
        out_size: int,
        bias: bool = True,
        activation: Activation = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        _check_sizes(in_size, [out_size])
        self._in_size = in_size
        self._out_size = out_size
        self._linear = nn.Linear(in_size, out_size, bias=bias, device=device, dtype=dtype)
        self._activation_fn = _resolve_activation(activation)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._activation_fn(self._linear(input))


class MLP(nn.Module):
    """A stack of `Perceptron`s: `[*, in_size] -> [*, layer_sizes[-1]]`.

    Args:
        in_size: input features.
        layer_sizes: output size of each layer, in order.
        bias: whether the linear layers learn a bias.
        activation: applied after every layer (see `Activation`); a module instance is
            shared by all layers, a module class or zero-argument factory makes one per layer.
        activation_on_last: `False` leaves the last layer linear (TorchRec's flag).
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        in_size: int,
        layer_sizes: Sequence[int],
        bias: bool = True,
        activation: Activation = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        activation_on_last: bool = True,
    ) -> None:
        super().__init__()
        layer_sizes = list(layer_sizes)
        _check_sizes(in_size, layer_sizes)
        self._mlp = nn.Sequential(
            *[
                Perceptron(
                    layer_sizes[i - 1] if i > 0 else in_size,
                    size,
                    bias=bias,
                    activation=(
                        nn.Identity()
                        if not activation_on_last and i == len(layer_sizes) - 1
                        else activation
                    ),
                    device=device,
                    dtype=dtype,
                )
                for i, size in enumerate(layer_sizes)
            ]
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._mlp(input)
