"""Dynamic batching: concurrent requests gathered into one predictor call, results split back.

    batcher = Batcher(run, max_batch_size=64, max_wait_s=0.002)   # inside a running event loop
    batcher.start()
    result = await batcher.submit(model, payload, samples=3, ids=17)
    await batcher.close()                                          # finishes what is queued

A batch is the longest prefix of the queue whose requests share one model (the one each
request captured when it arrived: a reload never moves a queued request to another model)
and fit the limits together: at most `max_batch_size` samples (and the model's own
`max_batch_size`) and at most `model.max_ids` ids. It is run as soon as it is full (or the
next request needs another model), else when its oldest request has waited `max_wait_s`,
or at once while the batcher is flushing (shutdown). A request larger than `max_batch_size`
on its own (but within the model's limits) runs alone.

`run(model, payloads) -> results` (one result per payload) runs on one worker thread, so
the event loop keeps accepting requests while a batch is scored; an exception it raises is
given to every request of that batch. asyncio and the standard library only.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["BatchDone", "Batcher", "BatcherClosed"]


class BatcherClosed(RuntimeError):
    """The batcher is shutting down and takes no new request."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchDone:
    """What `on_batch` is told after each predictor call."""

    requests: int
    samples: int
    seconds: float  # the call itself (not the queueing)
    error: BaseException | None


@dataclasses.dataclass(eq=False, kw_only=True)
class _Pending:
    model: Any
    payload: Any
    samples: int
    ids: int
    future: asyncio.Future
    arrived: float  # loop.time()


class Batcher:
    """Gathers `submit`ted requests into batches (module docstring). Create, `start`,
    `submit` and `close` it inside one running event loop."""

    def __init__(
        self,
        run: Callable[[Any, Sequence[Any]], Sequence[Any]],
        *,
        max_batch_size: int,
        max_wait_s: float,
        on_batch: Callable[[BatchDone], None] | None = None,
    ):
        if max_batch_size < 1 or max_wait_s < 0:
            raise ValueError(
                f"max_batch_size {max_batch_size} must be >= 1 and max_wait_s {max_wait_s} >= 0"
            )
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self._run = run
        self._on_batch = on_batch
        self._queue: collections.deque[_Pending] = collections.deque()
        self._changed = asyncio.Event()
        self._flushing = False
        self._closed = False
        self._task: asyncio.Task | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="hybridrec-predict")

    @property
    def queued_samples(self) -> int:
        return sum(p.samples for p in self._queue)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="hybridrec-batcher")

    async def submit(self, model, payload, *, samples: int, ids: int):
        """The result of `payload` (`samples` samples, `ids` ids) scored by `model`, once its
        batch has run."""
        if self._closed:
            raise BatcherClosed("the server is shutting down")
        loop = asyncio.get_running_loop()
        pending = _Pending(
            model=model,
            payload=payload,
            samples=samples,
            ids=ids,
            future=loop.create_future(),
            arrived=loop.time(),
        )
        self._queue.append(pending)
        self._changed.set()
        return await pending.future

    def flush(self) -> None:
        """From now on run every batch without waiting for more requests (shutdown)."""
        self._flushing = True
        self._changed.set()

    async def close(self) -> None:
        """Take no new request, run every queued one, then stop the worker thread."""
        self._closed = True
        self.flush()
        if self._task is not None:
            await self._task
        self._worker.shutdown(wait=True)

    def _take(self, force: bool) -> list[_Pending] | None:
        """The batch at the head of the queue if it is ready (full, or `force`), else None."""
        model = self._queue[0].model
        max_samples = min(self.max_batch_size, model.max_batch_size)
        batch, samples, ids = [], 0, 0
        for p in self._queue:
            fits = (
                p.model is model
                and samples + p.samples <= max_samples
                and ids + p.ids <= model.max_ids
            )
            if batch and not fits:
                return batch  # full: the next request does not fit or needs another model
            batch.append(p)
            samples, ids = samples + p.samples, ids + p.ids
        return batch if force or samples >= max_samples else None

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                if self._closed:
                    return
                self._changed.clear()
                await self._changed.wait()
                continue
            deadline = self._queue[0].arrived + self.max_wait_s
            batch = self._take(force=self._flushing or loop.time() >= deadline)
            if batch is None:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), max(deadline - loop.time(), 0))
                except TimeoutError:
                    pass
                continue
            for _ in batch:
                self._queue.popleft()
            await self._execute(loop, batch)

    async def _execute(self, loop, batch: list[_Pending]) -> None:
        start = time.perf_counter()
        error = None
        try:
            results = await loop.run_in_executor(
                self._worker, self._run, batch[0].model, [p.payload for p in batch]
            )
        except Exception as e:  # given to every request of the batch; the loop goes on
            error = e
        seconds = time.perf_counter() - start
        for i, p in enumerate(batch):
            if p.future.done():  # its client went away
                continue
            if error is not None:
                p.future.set_exception(error)
            else:
                p.future.set_result(results[i])
        if self._on_batch is not None:
            self._on_batch(
                BatchDone(
                    requests=len(batch),
                    samples=sum(p.samples for p in batch),
                    seconds=seconds,
                    error=error,
                )
            )
