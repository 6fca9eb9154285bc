"""The sparse step as a `torch.autograd.Function`: JAX lookup forward, fused JAX update backward.

    pooled = sparse_lookup(tables, prepared)        # torch [B, sum dims], requires_grad
    ... dense forward, loss ...
    loss.backward()                                 # runs the fused sparse update

forward: the JAX lookup (jit) gives the pooled embeddings, handed to torch through DLPack
  (zero-copy for a single-device array).
backward: the gradient of the pooled embeddings goes back to JAX through DLPack (laid out
  as the pooled array was), and `make_update`'s fused step runs on the SAME prepared batch
  the forward looked up (nothing is checked or split again): per touched row dedup,
  row rule, scatter into the donated tables and optimizer state, whose references
  `SparseTables` replaces. No gradient is returned for any table (there is no torch
  parameter for them): the sparse update happens inside backward, as TorchRec's fused
  optimizer does, and the user steps only the dense optimizer.

Each forward's update runs at most once. A second backward through the same graph
(`retain_graph=True`) raises instead of applying the update twice; to combine several
losses, add them and call backward once.
"""

from __future__ import annotations

import jax
import torch

from hybrid.model._bridge import jax_to_torch, torch_to_jax
from hybrid.model._sparse import SparseTables
from sparse_jax import PreparedBatch

__all__ = ["SparseStep", "sparse_lookup"]


class SparseStep:
    """One forward's sparse facts: the tables, the prepared batch, the pooled layout, and
    whether its update has run."""

    def __init__(self, tables: SparseTables, batch: PreparedBatch):
        self.tables, self.batch = tables, batch
        self.pooled_sharding: jax.sharding.Sharding | None = None
        self.applied = False
        self.ok: torch.Tensor | None = None  # set by `Model.guard_update` (e.g. the loss is finite)

    def forward(self, training: bool = False) -> torch.Tensor:
        # a managed-collision batch comes back as its slot ids: the update runs on those
        kt, self.batch = self.tables.lookup(self.batch, training=training)
        pooled = kt.values()
        self.pooled_sharding = pooled.sharding
        return jax_to_torch(pooled)

    def backward(self, grad: torch.Tensor) -> None:
        if self.applied:
            raise RuntimeError(
                "hybrid.Model: backward ran twice through the same forward; the sparse update "
                "of that batch was already applied (the tables were updated in the first backward). "
                "Sum the losses and call backward once, or run a new forward"
            )
        self.applied = True
        # back in the pooled array's layout (its device, or its batch sharding on a mesh)
        pooled_grad = torch_to_jax(grad.to(torch.float32), sharding=self.pooled_sharding)
        ok = None if self.ok is None else torch_to_jax(self.ok.reshape(()).to(torch.bool))
        self.tables.apply_gradient(self.batch, pooled_grad, ok=ok)


class _SparseLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, step: SparseStep) -> torch.Tensor:  # noqa: ARG004
        ctx.step = step
        return step.forward(training=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.step.backward(grad)
        return None, None


def sparse_lookup(tables: SparseTables, batch: PreparedBatch, *, train: bool) -> torch.Tensor:
    """Pooled embeddings `[B, sum of feature dims]` as a torch tensor.

    With `train` (and grad enabled) the tensor requires grad and its backward applies the
    fused sparse update once; otherwise it is a plain tensor and nothing updates the tables.
    """
    step = SparseStep(tables, batch)
    if not (train and torch.is_grad_enabled()):
        return step.forward()
    tables.pending = step  # the step whose backward is next (Model.guard_update)
    # the anchor is a leaf that requires grad, so autograd records the Function and calls its
    # backward; it receives no gradient (backward returns None for it)
    anchor = torch.empty(0, requires_grad=True)
    return _SparseLookup.apply(anchor, step)
