"""`BatchLoader`: fixed-size training batches from a `ClickData`, addressed by step.

Batch `step` is a pure function of `(seed, step)`: epoch `e = step // steps_per_epoch`
shuffles the samples with `np.random.default_rng([seed, e])` and the batch is the
`step % steps_per_epoch`-th slice of that order (the last incomplete slice of an epoch is
dropped, so every batch has exactly `batch_size` samples and one compiled program serves
the run). The data position of a checkpoint is therefore just its step.

`eval_batches` walks a held-out set in order with batches of `batch_size`; the last one
is padded with copies of sample 0 up to full size and `valid` says how many are real.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from hybrid.data._arrays import ClickData

__all__ = ["BatchLoader", "eval_batches"]


class BatchLoader:
    def __init__(self, data: ClickData, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if len(data) < batch_size:
            raise ValueError(
                f"the training set has {len(data)} samples, fewer than one batch of {batch_size}; "
                "lower the batch size or use more data"
            )
        self.data, self.batch_size, self.seed, self.shuffle = data, batch_size, seed, shuffle
        self.steps_per_epoch = len(data) // batch_size
        self._order: tuple[int, np.ndarray] | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            n = len(self.data)
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._order = (epoch, order)
        return self._order[1]

    def indices(self, step: int) -> np.ndarray:
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.batch_size
        return self._epoch_order(epoch)[start : start + self.batch_size]

    def batch(self, step: int, *, part: tuple[int, int] = (0, 1)):
        """`(dense, (keys, values, lengths), labels)` for training step `step` (0-based).
        `part=(rank, world)`: only this process's share of the batch (samples
        `rank * batch_size / world` on): each process reads only its own samples."""
        rank, world = part
        share = self.batch_size // world
        return self.data.rows(self.indices(step)[rank * share : (rank + 1) * share])


def eval_batches(
    data: ClickData, batch_size: int, *, part: tuple[int, int] = (0, 1)
) -> Iterator[tuple[tuple, int]]:
    """`(batch, valid)` over `data` in order; every batch has `batch_size` samples, `valid`
    of them real. `part=(rank, world)`: only this process's share of each batch (samples
    `rank * batch_size / world` on), so no process reads the whole batch."""
    rank, world = part
    share = batch_size // world
    for start in range(0, len(data), batch_size):
        rows = np.arange(start, min(start + batch_size, len(data)))
        valid = len(rows)
        if valid < batch_size:
            rows = np.concatenate([rows, np.zeros(batch_size - valid, np.int64)])
        yield data.rows(rows[rank * share : (rank + 1) * share]), valid
