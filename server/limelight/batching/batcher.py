"""Dynamic micro-batching: concurrent requests share one forward pass.

The first request of a batch waits at most ``max_wait_s`` for company; whatever arrives while a
batch is running joins the next one, so under load batches fill up by themselves. The work runs
in an executor thread: torch never blocks the event loop. The queue is created in ``start()``,
inside the running loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, TypeVar

from limelight.errors import DeadlineExceeded, ResourceExhausted, Unavailable

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Pending(Generic[T, R]):
    item: T
    future: asyncio.Future[R]
    deadline: float | None
    enqueued: float


class MicroBatcher(Generic[T, R]):
    """Groups items submitted concurrently and processes each group with one call."""

    def __init__(
        self,
        process: Callable[[list[T]], Sequence[R]],
        *,
        executor: Executor,
        max_batch_size: int,
        max_wait_s: float,
        max_pending: int,
        on_batch: Callable[[int, list[float]], None] | None = None,
    ) -> None:
        """``process`` maps a list of items to one result per item (same order).
        ``on_batch(size, queue_waits)`` is called once per processed batch (metrics)."""
        self._process = process
        self._executor = executor
        self._max_batch = max_batch_size
        self._max_wait = max_wait_s
        self._max_pending = max_pending
        self._on_batch = on_batch
        self._queue: asyncio.Queue[_Pending[T, R]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._busy = False

    @property
    def pending(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    @property
    def idle(self) -> bool:
        return self.pending == 0 and not self._busy

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="micro-batcher")

    async def submit(self, item: T, deadline: float | None = None) -> R:
        if self._queue is None or self._closing:
            raise Unavailable("the server is not accepting inline requests")
        if self._queue.qsize() >= self._max_pending:
            raise ResourceExhausted(
                f"inline backlog is full ({self._max_pending} requests waiting); retry later"
            )
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(item, future, deadline, time.monotonic()))
        return await future

    async def drain(self, timeout: float) -> bool:
        """Stop accepting; wait until queued and running work is done. True if it all finished."""
        self._closing = True
        end = time.monotonic() + timeout
        while not self.idle and time.monotonic() < end:
            await asyncio.sleep(0.01)
        return self.idle

    async def stop(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._queue is not None:
            while not self._queue.empty():
                pending = self._queue.get_nowait()
                if not pending.future.done():
                    pending.future.set_exception(Unavailable("the server is shutting down"))

    async def _collect(self) -> list[_Pending[T, R]]:
        assert self._queue is not None
        batch = [await self._queue.get()]
        deadline = time.monotonic() + self._max_wait
        while len(batch) < self._max_batch:
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            remaining = deadline - time.monotonic()
            if len(batch) >= self._max_batch or remaining <= 0:
                break
            await asyncio.sleep(min(remaining, 0.0005))
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            now = time.monotonic()
            live: list[_Pending[T, R]] = []
            for p in batch:
                if p.future.done():  # the caller went away (cancelled RPC)
                    continue
                if p.deadline is not None and now >= p.deadline:
                    # Expired work is skipped, not computed.
                    p.future.set_exception(DeadlineExceeded("deadline passed while queued"))
                    continue
                live.append(p)
            if not live:
                continue
            self._busy = True
            try:
                results = await loop.run_in_executor(
                    self._executor, self._process, [p.item for p in live]
                )
            except Exception as exc:  # one failure fails the batch; callers map it
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            finally:
                self._busy = False
            if self._on_batch is not None:
                self._on_batch(len(live), [now - p.enqueued for p in live])
            for p, result in zip(live, results, strict=True):
                if not p.future.done():
                    p.future.set_result(result)
