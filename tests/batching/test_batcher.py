"""The micro-batcher groups concurrent work, bounds its backlog and skips expired work."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from limelight.batching import LengthPolicy, MicroBatcher
from limelight.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted


def make(process, **kw):  # type: ignore[no-untyped-def]
    options = dict(max_batch_size=8, max_wait_s=0.01, max_pending=100)
    options.update(kw)
    return MicroBatcher(process, executor=ThreadPoolExecutor(1), **options)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Yield to the loop until ``condition()`` holds; fail after ``timeout_s`` (a deadline for
    a hung batcher, not a timing assumption)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.001)


class Held:
    """A ``process`` that records what it is given and holds the inference thread until
    ``release`` is set: what is submitted meanwhile stays queued."""

    def __init__(self) -> None:
        self.computed: list[int] = []
        self.release = threading.Event()

    def __call__(self, items: list[int]) -> list[int]:
        self.computed.extend(items)
        self.release.wait(10)
        return items


@pytest.mark.asyncio
async def test_concurrent_items_share_batches_and_keep_order() -> None:
    seen: list[int] = []
    release = threading.Event()

    def process(items: list[int]) -> list[int]:
        seen.append(len(items))
        release.wait(10)  # hold the inference thread until every item is queued
        return [i * 10 for i in items]

    batcher = make(process)
    await batcher.start()
    tasks = [asyncio.ensure_future(batcher.submit(i)) for i in range(20)]
    await until(lambda: bool(seen) and sum(seen) + batcher.pending == 20)
    release.set()
    results = await asyncio.gather(*tasks)
    await batcher.stop()
    assert results == [i * 10 for i in range(20)]
    assert max(seen) > 1 and max(seen) <= 8 and sum(seen) == 20


@pytest.mark.asyncio
async def test_full_backlog_is_rejected() -> None:
    # The backlog stays full until every submit has been answered or queued.
    process = Held()
    batcher = make(process, max_pending=2, max_batch_size=1)
    await batcher.start()
    tasks = [asyncio.ensure_future(batcher.submit(i)) for i in range(6)]
    # Every submit is either rejected (done), waiting in the backlog, or being processed.
    await until(lambda: sum(t.done() for t in tasks) + batcher.pending + len(process.computed) == 6)
    process.release.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await batcher.stop()
    rejected = [r for r in results if isinstance(r, ResourceExhausted)]
    served = [(i, r) for i, r in enumerate(results) if not isinstance(r, BaseException)]
    assert rejected and all("backlog is full" in str(r) for r in rejected)
    assert served and all(i == r for i, r in served)
    assert len(rejected) + len(served) == 6


@pytest.mark.asyncio
async def test_admit_waits_for_room_until_its_deadline_or_the_drain() -> None:
    """``admit`` (a stream's pace) waits in a full backlog instead of being refused: it gets
    in when room comes, fails with DeadlineExceeded when its deadline passes first, and with
    Unavailable when the batcher drains meanwhile."""
    from limelight.errors import Unavailable

    process = Held()
    batcher = make(process, max_pending=1, max_batch_size=1, max_wait_s=0.0)
    await batcher.start()
    running = asyncio.ensure_future(batcher.submit(0))
    await until(lambda: process.computed == [0])
    queued = asyncio.ensure_future(batcher.submit(1))
    await until(lambda: batcher.pending == 1)
    with pytest.raises(ResourceExhausted):
        await batcher.submit(2)
    waiting = asyncio.ensure_future(batcher.submit(2, wait=True))
    with pytest.raises(DeadlineExceeded, match="waiting for room"):
        await batcher.submit(3, deadline=time.monotonic() + 0.05, wait=True)
    assert not waiting.done()
    process.release.set()
    assert await asyncio.gather(running, queued, waiting) == [0, 1, 2]
    assert process.computed == [0, 1, 2]

    process.release.clear()
    first = asyncio.ensure_future(batcher.submit(4))
    await until(lambda: process.computed[-1] == 4)
    second = asyncio.ensure_future(batcher.submit(5))
    await until(lambda: batcher.pending == 1)
    left_waiting = asyncio.ensure_future(batcher.submit(6, wait=True))
    await asyncio.sleep(0.01)
    draining = asyncio.ensure_future(batcher.drain(10))
    with pytest.raises(Unavailable):
        await left_waiting
    process.release.set()
    assert await asyncio.gather(first, second) == [4, 5] and await draining
    await batcher.stop()


@pytest.mark.asyncio
async def test_expired_work_is_skipped_not_computed() -> None:
    computed: list[int] = []

    def process(items: list[int]) -> list[int]:
        computed.extend(items)
        return items

    batcher = make(process)
    await batcher.start()
    with pytest.raises(DeadlineExceeded):
        await batcher.submit(1, deadline=time.monotonic() - 1)
    assert await batcher.submit(2) == 2
    await batcher.stop()
    assert computed == [2]


@pytest.mark.asyncio
async def test_a_failing_batch_fails_its_callers_and_the_batcher_survives() -> None:
    def process(items: list[int]) -> list[int]:
        if 13 in items:
            raise ValueError("boom")
        return items

    batcher = make(process, max_wait_s=0)
    await batcher.start()
    with pytest.raises(ValueError):
        await batcher.submit(13)
    assert await batcher.submit(7) == 7
    assert await batcher.drain(1.0)
    await batcher.stop()


@pytest.mark.asyncio
async def test_items_submitted_together_are_queued_all_or_none() -> None:
    """A long document's windows: admitted as a whole or refused as a whole, so a full backlog
    never leaves part of a document to be computed for an answer that is an error."""
    process = Held()
    computed = process.computed
    batcher = make(process, max_pending=4, max_batch_size=1, max_wait_s=0)
    await batcher.start()
    running = asyncio.ensure_future(batcher.submit(0))
    await until(lambda: computed == [0])
    first = batcher.submit_all([1, 2, 3])
    assert batcher.pending == 3
    with pytest.raises(ResourceExhausted, match="room for 1 of this input's 2 windows"):
        batcher.submit_all([4, 5])
    assert batcher.pending == 3  # nothing of the refused pair was queued
    last = batcher.submit_all([6])
    process.release.set()
    assert await asyncio.gather(running, *first, *last) == [0, 1, 2, 3, 6]
    await batcher.stop()
    assert computed == [0, 1, 2, 3, 6]


@pytest.mark.asyncio
async def test_more_items_than_the_backlog_can_ever_hold_are_refused_for_good() -> None:
    """A document of more windows than ``max_pending`` could never be admitted, not even by an
    idle server: it is refused as an invalid argument naming what would let it through, not
    as RESOURCE_EXHAUSTED "retry later" (a retry could never succeed)."""
    computed: list[int] = []

    def process(items: list[int]) -> list[int]:
        computed.extend(items)
        return items

    batcher = make(process, max_pending=4, max_batch_size=1, max_wait_s=0)
    await batcher.start()
    assert batcher.idle
    with pytest.raises(InvalidArgument) as refused:
        batcher.submit_all(list(range(10)))
    message = str(refused.value)
    assert "10 windows" in message and "max_pending 4" in message
    for setting in ("LIMELIGHT_MAX_PENDING", "LIMELIGHT_WINDOW_STRIDE", "truncate"):
        assert setting in message
    assert "retry" not in message
    assert batcher.pending == 0  # nothing of it was queued
    # As many windows as the backlog holds still fit on an idle server.
    assert await asyncio.gather(*batcher.submit_all([1, 2, 3, 4])) == [1, 2, 3, 4]
    await batcher.stop()
    assert computed == [1, 2, 3, 4]


@pytest.mark.asyncio
async def test_a_future_withdrawn_before_its_batch_is_not_computed() -> None:
    process = Held()
    computed = process.computed
    batcher = make(process, max_batch_size=1, max_wait_s=0)
    await batcher.start()
    running = asyncio.ensure_future(batcher.submit(0))
    await until(lambda: computed == [0])
    queued = batcher.submit_all([1, 2, 3])
    queued[1].cancel()
    process.release.set()
    assert await running == 0
    assert [await queued[0], await queued[2]] == [1, 3]
    await batcher.stop()
    assert computed == [0, 1, 3]


@pytest.mark.asyncio
async def test_the_pending_count_reaches_zero_when_only_withdrawn_items_were_left() -> None:
    """``on_pending`` (the pending-requests gauge) follows the queue to empty also when the
    last items in it were withdrawn (a cancelled call) and no batch ran after them."""
    process = Held()
    reported: list[int] = []
    batcher = make(process, max_batch_size=1, max_wait_s=0, on_pending=reported.append)
    await batcher.start()
    running = asyncio.ensure_future(batcher.submit(0))
    await until(lambda: process.computed == [0])
    queued = batcher.submit_all([1, 2])
    for future in queued:
        future.cancel()
    process.release.set()
    assert await running == 0
    await until(lambda: batcher.idle)
    await batcher.stop()
    assert process.computed == [0] and reported[-1] == 0


# --- idle dispatch ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_idle_request_is_dispatched_alone_and_queued_ones_batch() -> None:
    """With the inference thread idle a request runs at once, without waiting for company;
    requests that arrive while it runs form the next batch together."""
    started = threading.Event()
    release = threading.Event()
    batches: list[list[int]] = []

    def process(items: list[int]) -> list[int]:
        batches.append(list(items))
        started.set()
        release.wait(10)
        return items

    batcher = make(process, max_wait_s=0)
    await batcher.start()
    first = asyncio.ensure_future(batcher.submit(1))
    # The batcher runs [1] although nothing else is queued and no wait has elapsed.
    assert await asyncio.to_thread(started.wait, 10)
    assert batches == [[1]]
    later = [asyncio.ensure_future(batcher.submit(i)) for i in (2, 3, 4)]
    await until(lambda: batcher.pending == 3)  # queued behind [1], which is still running
    release.set()
    assert await first == 1
    assert await asyncio.gather(*later) == [2, 3, 4]
    await batcher.stop()
    assert batches == [[1], [2, 3, 4]]


# --- length policy ------------------------------------------------------------------------------


def test_length_policy_buckets_and_budget() -> None:
    policy = LengthPolicy(max_batch_size=8, max_batch_tokens=256, bucket_floor=32)
    assert [policy.bucket(n) for n in (1, 32, 33, 64, 65, 500)] == [32, 32, 64, 64, 128, 512]
    assert policy.fits(8, 32) and not policy.fits(9, 8)
    assert policy.fits(2, 128) and not policy.fits(3, 128)
    assert policy.fits(1, 10_000)  # one item larger than the budget still runs, alone
    with pytest.raises(ValueError):
        LengthPolicy(max_batch_size=0)


def _blocking_batcher(
    sizes: dict[int, int], batches: list[list[int]], **kw: object
) -> tuple[MicroBatcher[int, int], threading.Event, threading.Event]:
    """A batcher whose first batch blocks until released, so the test can queue up work."""
    started = threading.Event()
    release = threading.Event()

    def process(items: list[int]) -> list[int]:
        batches.append(list(items))
        started.set()
        release.wait(10)
        return items

    batcher = make(process, size=sizes.__getitem__, **kw)
    return batcher, started, release


async def _run_backlog(sizes: dict[int, int], **kw: object) -> tuple[list[int], list[list[int]]]:
    """Submit item 0, hold its batch, queue every other item of ``sizes`` behind it, then let
    the batcher drain: the results in submission order and the batches it formed."""
    batches: list[list[int]] = []
    batcher, started, release = _blocking_batcher(sizes, batches, **kw)
    await batcher.start()
    first = asyncio.ensure_future(batcher.submit(0))
    assert await asyncio.to_thread(started.wait, 10)
    rest = [asyncio.ensure_future(batcher.submit(i)) for i in range(1, len(sizes))]
    await until(lambda: batcher.pending == len(sizes) - 1)  # the backlog is queued behind [0]
    release.set()
    results = [await first, *await asyncio.gather(*rest)]
    await batcher.stop()
    return results, batches


@pytest.mark.asyncio
async def test_batches_never_mix_lengths_beyond_the_policy() -> None:
    rng = random.Random(7)
    sizes = {0: 5}
    sizes.update({i: rng.choice([3, 9, 20, 31, 40, 60, 100, 200, 400, 512]) for i in range(1, 300)})
    policy = LengthPolicy(max_batch_size=16, max_batch_tokens=1024, bucket_floor=32)

    results, batches = await _run_backlog(
        sizes, max_batch_size=16, max_batch_tokens=1024, max_pending=1000
    )
    assert results == list(range(300))
    assert sorted(i for b in batches for i in b) == list(range(300))
    for batch in batches[1:]:
        lengths = [sizes[i] for i in batch]
        assert len({policy.bucket(n) for n in lengths}) == 1, lengths
        assert max(lengths) <= 32 or max(lengths) <= 2 * min(lengths), lengths
        assert len(batch) <= 16
        assert len(batch) == 1 or len(batch) * max(lengths) <= 1024, lengths
        assert batch == sorted(batch)  # first come, first served within a bucket


async def _closed_loop(
    n_long: int, n_short: int = 16, **kw: object
) -> tuple[list[list[int]], dict[int, int], list[int]]:
    """``n_short`` closed-loop clients of 10-token requests, and a client that sends
    ``n_long`` 500-token requests one after another; returns the batches, the sizes and the
    long ids."""
    batches: list[list[int]] = []
    sizes: dict[int, int] = {}
    next_id = iter(range(10**6))
    longs: list[int] = []

    def process(items: list[int]) -> list[int]:
        batches.append(list(items))
        return items

    options: dict[str, object] = {"max_batch_size": 8, "max_batch_tokens": 512}
    options.update(kw)
    batcher = make(process, size=sizes.__getitem__, **options)
    await batcher.start()
    stop = asyncio.Event()

    async def short_client() -> None:
        while not stop.is_set():
            i = next(next_id)
            sizes[i] = 10
            await batcher.submit(i)

    shorts = [asyncio.ensure_future(short_client()) for _ in range(n_short)]
    await asyncio.sleep(0)  # one turn: every short client sends its first request first
    for _ in range(n_long):
        i = next(next_id)
        sizes[i] = 500
        longs.append(i)
        await batcher.submit(i)
    stop.set()
    await asyncio.gather(*shorts)
    await batcher.stop()
    return batches, sizes, longs


def _gaps(batches: list[list[int]], longs: list[int]) -> list[int]:
    """Batches run between one long request's turn and the next one's."""
    positions = [next(n for n, b in enumerate(batches) if i in b) for i in longs]
    return [b - a for a, b in zip([0, *positions], positions, strict=False)]


@pytest.mark.asyncio
async def test_long_requests_are_not_starved_by_a_stream_of_short_ones() -> None:
    """Short requests keep arriving (more than fill a batch); each long request queued behind
    them runs after a bounded number of short batches: the fair share of padded tokens."""
    for penalty in (0.0, 0.5):
        batches, sizes, longs = await _closed_loop(4, length_penalty=penalty, anticipate_s=10.0)
        policy = LengthPolicy(8, 512, 32, penalty)
        # A long batch is charged charge(512, 1, 500); a full short batch charge(32, 8, 10).
        bound = policy.charge(512, 1, 500) / policy.charge(32, 8, 10) + 2
        assert all(gap <= bound for gap in _gaps(batches, longs)), (penalty, _gaps(batches, longs))
        assert all(len(b) == 1 for b in batches if any(sizes[i] == 500 for i in b))
        assert sum(1 for b in batches if all(sizes[i] == 10 for i in b)) >= 3


@pytest.mark.asyncio
async def test_short_clients_keep_their_turns_while_long_work_waits() -> None:
    """Anticipation: 8 short clients fill exactly one batch, so right after it the short
    bucket is empty until they resubmit; with a long request waiting the batcher waits for
    them while they are owed the next turn, instead of starting the long batch every time."""
    penalty = 0.5
    policy = LengthPolicy(8, 512, 32, penalty)
    owed = policy.charge(512, 1, 500) / policy.charge(32, 8, 10)  # short batches per long
    kw = {"n_short": 8, "length_penalty": penalty}
    batches, _, longs = await _closed_loop(3, anticipate_s=10.0, **kw)  # type: ignore[arg-type]
    assert all(gap >= owed - 2 for gap in _gaps(batches, longs)[1:]), _gaps(batches, longs)
    # Without anticipation a waiting long request takes the thread whenever the short bucket
    # is momentarily empty, i.e. right after every short batch.
    batches, _, longs = await _closed_loop(3, anticipate_s=0.0, **kw)  # type: ignore[arg-type]
    assert all(gap <= 2 for gap in _gaps(batches, longs)[1:]), _gaps(batches, longs)


@pytest.mark.asyncio
async def test_the_metrics_callbacks_report_each_batch_and_each_anticipation() -> None:
    """``on_batch`` gets every batch's item sizes as run; ``on_anticipation`` every wait's
    outcome (the scenario of the test above, where the short clients come back in time)."""
    reported: list[list[int]] = []
    outcomes: list[bool] = []
    batches, sizes, _ = await _closed_loop(
        3,
        n_short=8,
        length_penalty=0.5,
        anticipate_s=10.0,
        on_batch=lambda s, _waits: reported.append(s),
        on_anticipation=outcomes.append,
    )
    assert reported == [[sizes[i] for i in b] for b in batches]
    assert True in outcomes  # the short clients' turns were waited for, and they came


@pytest.mark.asyncio
async def test_short_requests_are_not_held_behind_a_backlog_of_long_ones() -> None:
    """Many long requests queued first; short ones arriving later are interleaved with them
    instead of waiting for the whole long backlog."""
    sizes = {0: 500}
    sizes.update({i: 400 for i in range(1, 21)})
    sizes.update({i: 12 for i in range(21, 29)})

    results, batches = await _run_backlog(sizes, max_batch_size=8, max_batch_tokens=512)
    assert results == list(range(29))
    short_at = next(n for n, b in enumerate(batches) if sizes[b[0]] == 12)
    assert short_at <= 2, [len(b) for b in batches]
    assert batches[short_at] == list(range(21, 29))
