"""A non-finite batch never reaches the weights, decided on the device (no host read).

The sparse side: the fused update is built with `make_update(..., skip_nonfinite=True)`:
a non-finite pooled gradient, or a false "loss is finite" flag (`Model.guard_update`),
leaves the tables and their optimizer state untouched (`lax.cond` in the program).

The dense side, `DenseGuard.step(ok)`: the torch optimizer steps, then every parameter and
optimizer-state tensor is put back to its value before the step unless `ok` (a device
boolean) and every gradient is finite: `torch.where` on the device, so the flag is never
read on the host and the step stays asynchronous on a GPU. It costs one copy of the dense
parameters and their optimizer state per step (dense towers are small next to the tables).

Counters are device tensors; `TrainPipeline.nonfinite()` and `python -m hybrid.train` read
them only when they log.
"""

from __future__ import annotations

import torch

__all__ = ["DenseGuard", "NonFiniteError"]


class NonFiniteError(RuntimeError):
    """Training met non-finite values (nothing was applied to the weights; see the message)."""


class DenseGuard:
    """Steps `optimizer` only for batches whose loss flag and gradients are finite."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.skipped: torch.Tensor | None = None  # device int: steps skipped so far
        self.first: torch.Tensor | None = None  # device int: index of the first skipped step, -1

    def _params(self) -> list[torch.Tensor]:
        return [
            p
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]

    def step(self, ok: torch.Tensor, index: int) -> torch.Tensor:
        """`optimizer.step()` kept only if `ok` and all gradients are finite; returns the
        device boolean that decided it. `index`: the step's number (for `first`)."""
        params = self._params()
        for p in params:
            ok = ok & torch.isfinite(p.grad).all()
        saved_params = [p.detach().clone() for p in params]
        saved_state = {
            id(p): {
                k: v.detach().clone()
                for k, v in self.optimizer.state[p].items()
                if torch.is_tensor(v)
            }
            for p in params
        }
        self.optimizer.step()
        with torch.no_grad():
            for p, old in zip(params, saved_params, strict=True):
                p.copy_(torch.where(ok, p, old))
            for p in params:
                before = saved_state[id(p)]
                for k, v in self.optimizer.state[p].items():
                    if torch.is_tensor(v):
                        old = before.get(k, torch.zeros_like(v))  # created by this step
                        v.copy_(torch.where(ok.to(v.device), v, old))
        bad = (~ok).to(torch.int64)
        if self.skipped is None:
            self.skipped = torch.zeros((), dtype=torch.int64, device=bad.device)
            self.first = torch.full((), -1, dtype=torch.int64, device=bad.device)
        self.first = torch.where(
            (bad > 0) & (self.first < 0), torch.full_like(self.first, index), self.first
        )
        self.skipped = self.skipped + bad
        return ok
