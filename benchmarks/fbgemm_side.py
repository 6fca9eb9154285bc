"""FBGEMM's side: `SplitTableBatchedEmbeddingBagsCodegen` with HOST placement on CPU.

One TBE per (workload, optimizer), weights copied in from the workload's tables. The fused
optimizer runs inside `out.backward(grad)`. Settings follow FBGEMM's benchmark: SUM pooling,
fp32 output, `BoundsCheckMode.NONE`; `stochastic_rounding=False` so fp16 weights round to
nearest, as ours do.

Which backward FBGEMM runs (PERF_NOTES): EXACT_ROWWISE_ADAGRAD with fp32 weights has a JIT
kernel; EXACT_SGD, other optimizers and fp16 weights take a slower generic loop. FBGEMM's
CPU TBE has no bf16 weights ("not implemented for 'BFloat16'").
"""

from __future__ import annotations

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from benchmarks.workloads import Batch, Workload

__all__ = ["OPTIMIZERS", "FbgemmSide", "supports", "version"]

OPTIMIZERS = {
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "sgd": EmbOptimType.EXACT_SGD,
}
_PRECISION = {"fp32": SparseType.FP32, "fp16": SparseType.FP16}


def supports(dtype: str) -> bool:
    return dtype in _PRECISION


def version() -> str:
    from importlib import metadata

    for dist in ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm_gpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def backward_path(optimizer: str, dtype: str) -> str:
    if optimizer == "rowwise_adagrad" and dtype == "fp32":
        return "JIT rowwise-adagrad kernel (the fast path per PERF_NOTES)"
    return "generic backward loop (the slow path per PERF_NOTES)"


class FbgemmSide:
    """Args: workload, batch, optimizer name, lr, eps; `dtype` the weights precision
    (defaults to the workload's), `lr_scale` multiplies FBGEMM's lr (a gate self-test)."""

    def __init__(
        self,
        w: Workload,
        batch: Batch,
        optimizer: str,
        *,
        lr: float,
        eps: float,
        dtype: str | None = None,
    ):
        self.w, self.optimizer = w, optimizer
        self.dtype = dtype or w.dtype
        if self.dtype not in _PRECISION:
            raise ValueError(f"FBGEMM's CPU TBE has no {self.dtype} weights")
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(w.E, w.D, EmbeddingLocation.HOST, ComputeDevice.CPU)] * w.T,
            optimizer=OPTIMIZERS[optimizer],
            learning_rate=lr,
            eps=eps,
            weights_precision=_PRECISION[self.dtype],
            output_dtype=SparseType.FP32,
            pooling_mode=PoolingMode.SUM,
            stochastic_rounding=False,
            bounds_check_mode=BoundsCheckMode.NONE,
        )
        with torch.no_grad():
            for t, view in enumerate(self.tbe.split_embedding_weights()):
                view.copy_(torch.from_numpy(batch.tables[t]))
        self.indices = torch.from_numpy(batch.ids.copy())
        self.offsets = torch.from_numpy(batch.offsets.copy())
        psw = batch.per_sample_weights
        self.psw = None if psw is None else torch.from_numpy(psw.copy())
        self.grad = torch.from_numpy(batch.pooled_grad.copy())
        self.path = backward_path(optimizer, self.dtype)

    def table_bytes(self) -> int:
        return int(self.tbe.weights_host.numel() * self.tbe.weights_host.element_size())

    # -- compute ---------------------------------------------------------------------------
    def forward(self) -> torch.Tensor:
        return self.tbe(self.indices, self.offsets, self.psw)

    def pooled(self) -> np.ndarray:
        with torch.no_grad():
            return self.forward().numpy().copy()

    def step(self) -> None:
        self.forward().backward(self.grad)

    # -- timing cases (`timing.clocked`; FBGEMM on CPU returns computed tensors) -------------------
    def time_forward(self, clock):
        clock.mark("fwd", self.forward())

    def time_step(self, clock):
        out = self.forward()
        clock.mark("fwd", out)
        out.backward(self.grad)
        clock.mark("bwd")

    # -- state ---------------------------------------------------------------------------------
    def tables(self) -> np.ndarray:
        """[T, E, D] float32 copy of the current weights."""
        return np.stack(
            [v.detach().float().numpy().copy() for v in self.tbe.split_embedding_weights()]
        )

    def row_state(self) -> np.ndarray | None:
        """The Adagrad state: row-wise [T, E] (per-row sum of mean squared grads) or
        elementwise [T, E, D]; None for SGD."""
        if self.optimizer == "sgd":
            return None
        shape = (self.w.E,) if self.optimizer == "rowwise_adagrad" else (self.w.E, self.w.D)
        return np.stack(
            [
                s[0].detach().float().numpy().copy().reshape(shape)
                for s in self.tbe.split_optimizer_states()
            ]
        )
