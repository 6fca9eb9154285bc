"""The dense half of `hybrid.export`: the dense tower as a `torch.export` program.

The program takes `(dense_features [batch, n_dense], pooled [batch, sum of dims])`: a thin
wrapper builds the `dense_torch.KeyedTensor` the tower's contract expects inside the traced
code. (`torch.export` also sees through a `KeyedTensor` argument, which is a registered
torch pytree, but then loading the program needs `dense_torch` imported to rebuild its
input spec; with plain tensors it needs torch alone.) The batch dimension is dynamic, from
1 to `max_batch_size`.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Sequence

import torch
from torch import nn

import dense_torch

__all__ = ["dense_program"]


class _DenseOnPooled(nn.Module):
    """The dense tower taking the pooled tensor: builds the KeyedTensor the tower expects."""

    def __init__(self, dense: nn.Module, keys: Sequence[str], dims: Sequence[int]):
        super().__init__()
        self.dense = dense
        self.keys, self.dims = list(keys), list(dims)

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.dense(dense_features, dense_torch.KeyedTensor(self.keys, self.dims, pooled))


def _own_storage(module: nn.Module) -> nn.Module:
    """Give every buffer and parameter its own storage: `torch.export.save` cannot store
    tensors that are views of a shared one (e.g. DLRM's two triu index buffers)."""
    for m in module.modules():
        for name, t in [*m.named_buffers(recurse=False), *m.named_parameters(recurse=False)]:
            if t.untyped_storage().nbytes() == t.numel() * t.element_size():
                continue
            # assigning to an existing name keeps its kind (buffer, persistence; parameter)
            setattr(
                m,
                name,
                nn.Parameter(t.detach().clone(), t.requires_grad)
                if isinstance(t, nn.Parameter)
                else t.clone(),
            )
    return module


def dense_program(
    dense: nn.Module,
    keys: Sequence[str],
    dims: Sequence[int],
    dense_x: torch.Tensor,
    pooled: torch.Tensor,
    max_batch_size: int,
) -> tuple[bytes, int]:
    """(the `torch.export.save`d program, its output width): a CPU copy of `dense` in eval
    mode, traced on the example `(dense_x, pooled)`; `dense` itself is not changed."""
    tower = _own_storage(copy.deepcopy(dense).cpu().eval().requires_grad_(False))
    wrapper = _DenseOnPooled(tower, keys, dims)
    dynamic = None
    if max_batch_size > 1:
        if dense_x.shape[0] == 1:  # a size-1 example would pin the batch dimension to 1
            dense_x, pooled = dense_x.repeat(2, 1), pooled.repeat(2, 1)
        batch = torch.export.Dim("batch", min=1, max=max_batch_size)
        dynamic = {"dense_features": {0: batch}, "pooled": {0: batch}}
    try:
        program = torch.export.export(wrapper, (dense_x, pooled), dynamic_shapes=dynamic)
    except Exception as e:  # torch.export raises many types (UserError, Unsupported, ...)
        raise ValueError(
            f"hybrid.export: torch.export could not export the dense tower "
            f"{type(dense).__name__} called as dense(dense_features {list(dense_x.shape)}, "
            f"KeyedTensor): {type(e).__name__}: {e}"
        ) from e
    with torch.no_grad():
        out = program.module()(dense_x, pooled)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue(), int(out.shape[1])
