"""Dynamic, length-aware micro-batching: concurrent requests share one forward pass.

Dispatch: a request that finds the inference thread idle is dispatched at once (after at most
``max_wait_s`` of lingering for company, 0 by default); requests that arrive while a batch runs
queue up and form the next batch. Batches therefore fill by themselves under load and cost
nothing extra when the server is idle.

Length policy (``LengthPolicy``): every item has a size (its token count). Items are grouped in
length buckets (``bucket_floor`` tokens and below, then powers of two above it), and a batch
only ever holds items of one bucket, so the longest item of a batch is at most twice the
shortest (or every item is at most ``bucket_floor`` tokens): a short request is never padded
to a long one. A batch also holds at most ``max_batch_size`` items and at most
``max_batch_tokens`` padded tokens (items x longest item); a single item larger than the budget
still runs, alone.

Scheduling between buckets is weighted start-time fair queuing: a batch of bucket ``B`` is
charged its padded tokens x ``(B / bucket_floor) ** length_penalty`` and the bucket with waiting
work and the least charge goes next. With the default penalty 0.25 a 512-token request is
charged twice its tokens, so short requests get most of the thread while long ones still get a
guaranteed share: neither starves (0 shares padded tokens equally). Within a bucket the order is
first come, first served. A bucket that becomes active starts at the current virtual time, so it
neither jumps ahead with credit saved while idle nor waits behind old debt.

Anticipation: closed-loop clients resubmit a moment after their answer, so right after a batch
its bucket is often empty although it is owed the next turn; a work-conserving scheduler would
then start a long batch and every short request would wait for one. When the bucket that just
ran is still owed the next turn and only other buckets have work, the batcher waits up to
``anticipate_s`` for it before dispatching another bucket.

The work runs in an executor thread: torch never blocks the event loop. All asyncio objects
are created in ``start()``, inside the running loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, TypeVar

from limelight.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    ends_the_caller,
)

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class LengthPolicy:
    """Which items may share a batch."""

    max_batch_size: int
    """Most items in one batch."""
    max_batch_tokens: int = 0
    """Most padded tokens (items x longest item) in one batch; 0: no token budget."""
    bucket_floor: int = 32
    """Items of at most this many tokens share the first bucket; above it buckets double."""
    length_penalty: float = 0.25
    """A batch of bucket B is charged padded tokens x (B / bucket_floor) ** length_penalty."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.max_batch_tokens < 0:
            raise ValueError("max_batch_tokens must be >= 0")
        if self.bucket_floor < 1:
            raise ValueError("bucket_floor must be >= 1")
        if self.length_penalty < 0:
            raise ValueError("length_penalty must be >= 0")

    def bucket(self, size: int) -> int:
        """The upper size bound of ``size``'s bucket: floor, 2 floor, 4 floor, ..."""
        bound = self.bucket_floor
        while bound < size:
            bound *= 2
        return bound

    def charge(self, bucket: int, count: int, longest: int) -> float:
        """What a batch costs its bucket in the fair share."""
        return count * longest * (bucket / self.bucket_floor) ** self.length_penalty

    def fits(self, count: int, longest: int) -> bool:
        """May a batch of ``count`` items whose longest has ``longest`` tokens run? (count >= 1)"""
        if count > self.max_batch_size:
            return False
        return count == 1 or not self.max_batch_tokens or count * longest <= self.max_batch_tokens


@dataclass
class _Pending(Generic[T, R]):
    item: T
    size: int
    future: asyncio.Future[R]
    deadline: float | None
    enqueued: float


@dataclass
class _Bucket(Generic[T, R]):
    key: int
    items: deque[_Pending[T, R]]
    start: float = 0.0
    """Virtual start time of the bucket's next batch (padded tokens)."""
    hit_rate: float = 1.0
    """Moving average: how often anticipation for this bucket got a request in time."""
    gap: float = 0.0
    """Moving average of how long the hits took (seconds)."""


class MicroBatcher(Generic[T, R]):
    """Groups items submitted concurrently and processes each group with one call."""

    def __init__(
        self,
        process: Callable[[list[T]], Sequence[R]],
        *,
        executor: Executor,
        max_batch_size: int,
        max_pending: int,
        max_wait_s: float = 0.0,
        max_batch_tokens: int = 0,
        bucket_floor: int = 32,
        length_penalty: float = 0.25,
        anticipate_s: float = 0.0,
        size: Callable[[T], int] | None = None,
        on_batch: Callable[[list[int], list[float]], None] | None = None,
        on_anticipation: Callable[[bool], None] | None = None,
        on_pending: Callable[[int], None] | None = None,
    ) -> None:
        """``process`` maps a list of items to one result per item (same order); ``size``
        gives an item's token count (default 1 for every item). ``on_batch(sizes,
        queue_waits)`` is called once per processed batch with each item's size and time in the
        queue, ``on_anticipation(hit)`` once per anticipation wait, ``on_pending(count)`` with
        the items left waiting each time a batch is taken from the queue or the queue turns
        out to hold only withdrawn and expired items (metrics)."""
        self._process = process
        self._executor = executor
        self.policy = LengthPolicy(max_batch_size, max_batch_tokens, bucket_floor, length_penalty)
        self._max_wait = max_wait_s
        self._anticipate = anticipate_s
        self._max_pending = max_pending
        self._size = size
        self._on_batch = on_batch
        self._on_anticipation = on_anticipation
        self._on_pending = on_pending
        self._buckets: dict[int, _Bucket[T, R]] = {}
        self._count = 0
        self._vtime = 0.0
        self._wakeup: asyncio.Event | None = None
        self._room: asyncio.Event | None = None
        """Set when items leave the backlog: ``admit`` waits on it for room."""
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._busy = False
        #: How often anticipation got the owed bucket's next request in time, and how often not.
        self.anticipation_hits = 0
        self.anticipation_misses = 0

    @property
    def pending(self) -> int:
        """Items waiting for a batch (not counting the batch that is running)."""
        return self._count

    @property
    def idle(self) -> bool:
        return self._count == 0 and not self._busy

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._room = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="micro-batcher")

    async def submit(self, item: T, deadline: float | None = None, wait: bool = False) -> R:
        """``submit_all`` of one item; ``wait``: as ``admit``."""
        if wait:
            return await (await self.admit([item], deadline))[0]
        return await self.submit_all([item], deadline)[0]

    async def admit(
        self, items: Sequence[T], deadline: float | None = None
    ) -> list[asyncio.Future[R]]:
        """``submit_all``, waiting for room in a full backlog rather than refusing: the pace
        of a stream, whose inputs are read ahead (a refusal ended the whole stream, and
        seventeen streams read far enough ahead to fill the default backlog). Raises
        ``DeadlineExceeded`` when the deadline passes first."""
        while True:
            self.check_room(len(items))  # never admissible, closing: raised at once
            if self._count + len(items) <= self._max_pending:
                return self.submit_all(items, deadline)
            assert self._room is not None
            self._room.clear()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DeadlineExceeded("deadline passed while waiting for room in the backlog")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), left)

    def check_room(self, count: int = 1, full: bool = False) -> None:
        """Raise what ``submit_all`` would for ``count`` items: Unavailable when closing,
        InvalidArgument when never admissible, and (``full``) ResourceExhausted when the
        backlog has no room now — before a request is tokenized for nothing."""
        if self._wakeup is None or self._closing:
            raise Unavailable("the server is not accepting inline requests")
        if count > self._max_pending:
            # Not a busy server: even an empty backlog is too small, so "retry later" would
            # send the client back for ever.
            raise InvalidArgument(
                f"this input needs {count} windows, more than the {self._max_pending} the "
                f"inline backlog can ever hold (max_pending {self._max_pending}), so it can "
                f"never be admitted: raise LIMELIGHT_MAX_PENDING to at least {count}, or "
                "make fewer windows (a larger LIMELIGHT_MAX_TOKENS or a smaller "
                "LIMELIGHT_WINDOW_STRIDE), or LIMELIGHT_TRUNCATION=truncate; or shorten the text "
                "or submit it as a job"
            )
        if full and self._count + count > self._max_pending:
            if count == 1:
                detail = f"{self._max_pending} requests waiting"
            else:
                room = max(0, self._max_pending - self._count)
                detail = f"room for {room} of this input's {count} windows"
            raise ResourceExhausted(f"inline backlog is full ({detail}); retry later")

    def submit_all(
        self, items: Sequence[T], deadline: float | None = None
    ) -> list[asyncio.Future[R]]:
        """Queue ``items`` together, all or none: ResourceExhausted when the backlog has no
        room for every one of them now (a long document's windows are admitted as a whole, so
        an overloaded server never computes part of a document it then refuses), InvalidArgument
        when it never could (more items than ``max_pending``). One future per item; a future
        cancelled before its batch runs is skipped."""
        self.check_room(len(items), full=True)
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        futures: list[asyncio.Future[R]] = []
        for item in items:
            size = max(1, int(self._size(item))) if self._size is not None else 1
            future: asyncio.Future[R] = loop.create_future()
            key = self.policy.bucket(size)
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = _Bucket(key, deque())
            if not bucket.items:
                # (Re)activated: start at the current virtual time, no saved credit, no old debt.
                bucket.start = max(bucket.start, self._vtime)
            bucket.items.append(_Pending(item, size, future, deadline, now))
            self._count += 1
            futures.append(future)
        assert self._wakeup is not None  # check_room: started
        self._wakeup.set()
        return futures

    async def drain(self, timeout: float) -> bool:
        """Stop accepting; wait until queued and running work is done. True if it all finished."""
        self._closing = True
        self._freed()  # inputs waiting for room learn that none will come
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
        for bucket in self._buckets.values():
            while bucket.items:
                pending = bucket.items.popleft()
                if not pending.future.done():
                    pending.future.set_exception(Unavailable("the server is shutting down"))
        self._count = 0
        self._freed()

    def _freed(self) -> None:
        """Items left the backlog (or it closes): wake whoever waits for room."""
        if self._room is not None:
            self._room.set()

    # --- scheduling ----------------------------------------------------------------------------

    def _next_bucket(self) -> _Bucket[T, R] | None:
        """The active bucket with the earliest virtual start (shorter bucket on ties)."""
        best: tuple[float, int] | None = None
        chosen = None
        for key, bucket in self._buckets.items():
            if bucket.items and (best is None or (bucket.start, key) < best):
                best, chosen = (bucket.start, key), bucket
        return chosen

    def _take(self, now: float) -> list[_Pending[T, R]]:
        """Pop the next batch: one bucket, first come first served, within the policy.
        Cancelled and expired items are dropped on the way (expired ones fail)."""
        while self._count:
            bucket = self._next_bucket()
            assert bucket is not None
            batch: list[_Pending[T, R]] = []
            longest = 0
            while bucket.items:
                head = bucket.items[0]
                if head.future.done():  # the caller went away (cancelled RPC)
                    bucket.items.popleft()
                    self._count -= 1
                    continue
                if head.deadline is not None and now >= head.deadline:
                    bucket.items.popleft()
                    self._count -= 1
                    # Expired work is skipped, not computed.
                    head.future.set_exception(DeadlineExceeded("deadline passed while queued"))
                    continue
                if batch and not self.policy.fits(len(batch) + 1, max(longest, head.size)):
                    break
                bucket.items.popleft()
                self._count -= 1
                batch.append(head)
                longest = max(longest, head.size)
            if batch:
                self._vtime = bucket.start
                bucket.start += self.policy.charge(bucket.key, len(batch), longest)
                return batch
        return []

    def _owed(self, bucket: _Bucket[T, R]) -> bool:
        """Would ``bucket`` go next if it had work, while only other buckets have some?"""
        if bucket.items or not self._count:
            return False
        waiting = [b.start for b in self._buckets.values() if b.items]
        return bucket.start <= min(waiting)

    async def _anticipate_for(self, bucket: _Bucket[T, R]) -> None:
        """Give an owed bucket a moment to get work before another bucket runs.

        The wait adapts: at most ``anticipate_s``, at most three times the bucket's usual
        return gap once it has one, and skipped while the bucket's clients mostly do not
        come back in time (open-loop traffic), with an occasional retry."""
        assert self._wakeup is not None
        if not self._owed(bucket):
            return
        if bucket.hit_rate < 0.25:
            bucket.hit_rate += 0.02  # retry now and then: the traffic may have changed
            return
        window = self._anticipate
        if bucket.gap > 0:
            window = min(window, max(0.0005, 3 * bucket.gap))
        began = time.monotonic()
        end = began + window
        while self._owed(bucket):
            remaining = end - time.monotonic()
            if remaining <= 0:
                self.anticipation_misses += 1
                if self._on_anticipation is not None:
                    self._on_anticipation(False)
                bucket.hit_rate *= 0.9
                bucket.gap = 0.9 * bucket.gap + 0.1 * window if bucket.gap else 0.0
                return
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)
        self.anticipation_hits += 1
        if self._on_anticipation is not None:
            self._on_anticipation(True)
        took = time.monotonic() - began
        bucket.hit_rate = 0.9 * bucket.hit_rate + 0.1
        bucket.gap = 0.9 * bucket.gap + 0.1 * took if bucket.gap else took

    async def _linger(self) -> None:
        """With the thread idle and a batch not yet full, wait up to ``max_wait_s`` for company."""
        if self._max_wait <= 0:
            return
        end = time.monotonic() + self._max_wait
        while self._count < self.policy.max_batch_size:
            remaining = end - time.monotonic()
            if remaining <= 0:
                return
            await asyncio.sleep(min(remaining, 0.0005))

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        last: _Bucket[T, R] | None = None
        while True:
            if not self._count:
                self._wakeup.clear()
                await self._wakeup.wait()
                await self._linger()
            elif last is not None and self._anticipate > 0:
                await self._anticipate_for(last)
            now = time.monotonic()
            live = self._take(now)
            self._freed()
            if self._on_pending is not None:
                self._on_pending(self._count)
            if not live:
                last = None
                continue
            last = self._buckets[self.policy.bucket(max(p.size for p in live))]
            self._busy = True
            try:
                results = await loop.run_in_executor(
                    self._executor, self._process, [p.item for p in live]
                )
            except BaseException as exc:  # one failure fails the batch; callers map it
                if ends_the_caller(exc):
                    raise
                failure = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(failure)
                continue
            finally:
                self._busy = False
            if self._on_batch is not None:
                self._on_batch([p.size for p in live], [now - p.enqueued for p in live])
            for p, result in zip(live, results, strict=True):
                if not p.future.done():
                    p.future.set_result(result)
