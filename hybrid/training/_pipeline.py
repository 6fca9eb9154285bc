"""`hybrid.TrainPipeline`: TorchRec's `TrainPipelineSparseDist` for `hybrid.Model`.

    pipeline = hybrid.TrainPipeline(model, dense_optimizer, loss_fn)
    batches = iter(loader)                     # items: (dense_features, sparse, labels)
    while True:
        try:
            loss = pipeline.progress(batches)  # a 0-dim tensor; not read on the host
        except StopIteration:
            break

While step i computes (sparse lookup, dense forward and backward, the fused sparse update
dispatched asynchronously), batch i+1 is taken from the iterator, collated, validated,
padded, split and placed (`Model.prepare`), and its dense features and labels moved to the
dense tower's device, on one background thread. Each batch is in one explicit stage:

    queued  (the background thread is preparing it: a Future)
    ready   (prepared and placed: a `_Ready`)
    done    (its step ran; its loss was returned)

A batch whose loss, pooled gradient or dense gradients are not finite updates nothing: the
sparse update and the dense optimizer step are skipped on the device (no host read; see
`_nonfinite.py`) and counted (`pipeline.nonfinite()`, read when you log).

The pipelined loop computes exactly what the plain loop computes (same preparation, same
step, same order), so losses and tables are bitwise equal to

    for dense, sparse, labels in loader:
        loss = loss_fn(model(dense, sparse), labels)
        dense_optimizer.zero_grad(); loss.backward(); dense_optimizer.step()

A batch whose preparation fails raises `BatchPreparationError` (naming the batch's index,
the original exception chained) from the `progress` call that would have run it; the
step before it has completed. `progress` raises `StopIteration` once the iterator is
exhausted and every batch in flight has run. A last, smaller batch works (a new shape
compiles once).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hybrid.model import torch_device
from hybrid.training._nonfinite import DenseGuard
from sparse_jax import PreparedBatch

__all__ = ["BatchPreparationError", "PipelineStats", "TrainPipeline"]


class BatchPreparationError(RuntimeError):
    """Preparing batch `batch_index` (0-based, in iterator order) failed; `__cause__` is why."""

    def __init__(self, batch_index: int, cause: BaseException):
        super().__init__(
            f"TrainPipeline: preparing batch {batch_index} failed: {type(cause).__name__}: {cause}"
        )
        self.batch_index = batch_index


@dataclasses.dataclass
class PipelineStats:
    """Counters of a pipeline (host seconds, from `time.perf_counter`).

    `prepare_s`: time spent preparing batches (on the background thread, off the critical
    path); `wait_s`: time `progress` waited for the next batch to be ready (host
    preparation ON the critical path: the device waits for the host that long);
    `step_s`: time spent in steps (dispatch, dense forward/backward, optimizer)."""

    steps: int = 0
    prepared: int = 0
    prepare_s: float = 0.0
    wait_s: float = 0.0
    step_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Ready:
    index: int
    dense: torch.Tensor
    sparse: PreparedBatch
    labels: torch.Tensor


class _Exhausted:
    """The iterator had no batch at this index."""


class TrainPipeline:
    """Train `model` one batch per `progress` call, preparing the next batch meanwhile.

    Args:
      model: a `hybrid.Model`.
      dense_optimizer: a torch optimizer over `model.dense_parameters()`.
      loss_fn: `loss_fn(logits, labels) -> scalar tensor`.
      device: the torch device for dense features and labels (default: the device of the
        dense tower's first parameter, else `hybrid.torch_device()`).
      dense_grad_hook: called as `dense_grad_hook(model)` between backward and the
        optimizer step (e.g. to all-reduce dense gradients across processes). Before it
        runs, torch's work is ordered after the sparse update (`Model.order_after_sparse_update`:
        a device-side dependency on a GPU, no host wait), so a torch collective never runs
        while the JAX update's collectives may still use the same devices.
    """

    def __init__(
        self,
        model,
        dense_optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        device: torch.device | str | None = None,
        dense_grad_hook: Callable | None = None,
    ):
        self.model, self.optimizer, self.loss_fn = model, dense_optimizer, loss_fn
        self.device = torch.device(device) if device is not None else _dense_device(model)
        self.dense_grad_hook = dense_grad_hook
        self.stats = PipelineStats()
        self._guard = DenseGuard(dense_optimizer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-prepare")
        self._queued: Future | None = None  # the next batch, being prepared
        self._next_index = 0  # index of the next batch taken from the iterator
        self._lock = threading.Lock()  # the iterator is only advanced under it

    # -- the background stage ---------------------------------------------------------------
    def _prepare(self, batch_iter: Iterator, index: int) -> _Ready | _Exhausted:
        t0 = time.perf_counter()
        with self._lock:
            try:
                item = next(batch_iter)
            except StopIteration:
                return _Exhausted()
        try:
            dense, sparse, labels = item
        except (TypeError, ValueError):
            raise TypeError(
                f"each batch must be (dense_features, sparse, labels), got {type(item).__name__}"
            ) from None
        ready = _Ready(
            index,
            torch.as_tensor(dense).to(self.device, non_blocking=True),
            self.model.prepare(sparse),
            torch.as_tensor(labels).to(self.device, non_blocking=True),
        )
        self.stats.prepared += 1
        self.stats.prepare_s += time.perf_counter() - t0
        return ready

    def _submit(self, batch_iter: Iterator) -> None:
        index, self._next_index = self._next_index, self._next_index + 1
        future = self._executor.submit(self._prepare, batch_iter, index)
        future.batch_index = index
        self._queued = future

    def _take(self, batch_iter: Iterator) -> _Ready:
        if self._queued is None:
            self._submit(batch_iter)
        future, self._queued = self._queued, None
        t0 = time.perf_counter()
        try:
            ready = future.result()
        except Exception as e:
            raise BatchPreparationError(future.batch_index, e) from e
        finally:
            self.stats.wait_s += time.perf_counter() - t0
        if isinstance(ready, _Exhausted):
            self._next_index -= 1  # a later progress() may read a refilled iterator
            raise StopIteration
        return ready

    # -- one step ---------------------------------------------------------------------------
    def progress(self, batch_iter: Iterator) -> torch.Tensor:
        """Run one training step on the next batch; returns its loss (0-dim, not read)."""
        ready = self._take(batch_iter)
        self._submit(batch_iter)  # batch i+1 is prepared while step i runs
        t0 = time.perf_counter()
        self.model.train()
        logits = self.model(ready.dense, ready.sparse)
        loss = self.loss_fn(logits, ready.labels)
        finite = torch.isfinite(loss.detach()).all()  # a device boolean, never read here
        self.model.guard_update(finite)  # a non-finite loss leaves the tables untouched
        self.optimizer.zero_grad()
        loss.backward()  # dense grads; dispatches the fused sparse update (asynchronous)
        if self.dense_grad_hook is not None:
            self.model.order_after_sparse_update()
            self.dense_grad_hook(self.model)
        self._guard.step(finite, ready.index)  # skipped on the device unless all finite
        self.stats.steps += 1
        self.stats.step_s += time.perf_counter() - t0
        return loss.detach()

    def nonfinite(self) -> dict[str, int]:
        """Batches skipped because a loss, gradient or weight was not finite, read on the
        host (call it when you log): `{"sparse": n, "dense": n, "first_batch": i or -1}`."""
        sparse, first_sparse = (int(x) for x in self.model.sparse_nonfinite())
        dense = 0 if self._guard.skipped is None else int(self._guard.skipped)
        first_dense = -1 if self._guard.first is None else int(self._guard.first)
        firsts = [f for f in (first_sparse, first_dense) if f >= 0]
        return {"sparse": sparse, "dense": dense, "first_batch": min(firsts) if firsts else -1}

    def wait_prepared(self) -> None:
        """Wait until the batch being prepared is ready (kept for the next `progress`), so
        that other work on the model (eval, a checkpoint) never runs beside a preparation."""
        if self._queued is not None:
            try:
                self._queued.result()
            except Exception:  # noqa: S110 - raised by the progress() that needs the batch
                pass

    def close(self) -> None:
        """Stop the background thread (a batch being prepared is finished and dropped)."""
        self._queued = None
        self._executor.shutdown(wait=True)

    def __del__(self):
        self._executor.shutdown(wait=False)


def _dense_device(model) -> torch.device:
    for p in model.dense_parameters():
        return p.device
    return torch_device()
