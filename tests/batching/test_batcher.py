"""The micro-batcher groups concurrent work, bounds its backlog and skips expired work."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from limelight.batching import MicroBatcher
from limelight.errors import DeadlineExceeded, ResourceExhausted


def make(process, **kw):  # type: ignore[no-untyped-def]
    options = dict(max_batch_size=8, max_wait_s=0.01, max_pending=100)
    options.update(kw)
    return MicroBatcher(process, executor=ThreadPoolExecutor(1), **options)


def test_concurrent_items_share_batches_and_keep_order() -> None:
    seen: list[int] = []

    def process(items: list[int]) -> list[int]:
        seen.append(len(items))
        time.sleep(0.01)
        return [i * 10 for i in items]

    async def go() -> list[int]:
        batcher = make(process)
        await batcher.start()
        results = await asyncio.gather(*(batcher.submit(i) for i in range(20)))
        await batcher.stop()
        return list(results)

    assert asyncio.run(go()) == [i * 10 for i in range(20)]
    assert max(seen) > 1 and max(seen) <= 8 and sum(seen) == 20


def test_full_backlog_is_rejected() -> None:
    def process(items: list[int]) -> list[int]:
        time.sleep(0.01)
        return items

    async def go() -> list[object]:
        batcher = make(process, max_pending=2, max_batch_size=1)
        await batcher.start()
        results = await asyncio.gather(
            *(batcher.submit(i) for i in range(6)), return_exceptions=True
        )
        await batcher.stop()
        return list(results)

    results = asyncio.run(go())
    rejected = [r for r in results if isinstance(r, ResourceExhausted)]
    served = [(i, r) for i, r in enumerate(results) if not isinstance(r, BaseException)]
    assert rejected and all("backlog is full" in str(r) for r in rejected)
    assert served and all(i == r for i, r in served)
    assert len(rejected) + len(served) == 6


def test_expired_work_is_skipped_not_computed() -> None:
    computed: list[int] = []

    def process(items: list[int]) -> list[int]:
        computed.extend(items)
        return items

    async def go() -> None:
        batcher = make(process)
        await batcher.start()
        with pytest.raises(DeadlineExceeded):
            await batcher.submit(1, deadline=time.monotonic() - 1)
        assert await batcher.submit(2) == 2
        await batcher.stop()

    asyncio.run(go())
    assert computed == [2]


def test_a_failing_batch_fails_its_callers_and_the_batcher_survives() -> None:
    def process(items: list[int]) -> list[int]:
        if 13 in items:
            raise ValueError("boom")
        return items

    async def go() -> None:
        batcher = make(process, max_wait_s=0)
        await batcher.start()
        with pytest.raises(ValueError):
            await batcher.submit(13)
        assert await batcher.submit(7) == 7
        assert await batcher.drain(1.0)
        await batcher.stop()

    asyncio.run(go())
