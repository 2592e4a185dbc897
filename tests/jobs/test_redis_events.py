"""Watches share one pub/sub subscription per process (``limelight.jobs.redis_events``), on a
real redis-server: more watchers than the client's connection pool holds all hear their job's
changes, the job API stays usable meanwhile, and a subscription killed by Redis comes back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis
from helpers import await_until

from limelight.core.jobs import JobRecord, JobSpec, JobState
from limelight.jobs.redis_backend import RedisJobBackend
from limelight.jobs.redis_events import cancel_until_done
from limelight.settings import Settings
from tests.conftest import RedisAcl

WATCHERS = 150
"""More than the asyncio Redis client's pool (100 connections by default)."""


def subscribers(url: str) -> int:
    """Connections of this database's clients that hold a (pattern) subscription."""
    clients = redis.Redis.from_url(url).client_list()
    return sum(1 for c in clients if int(c.get("sub", 0)) or int(c.get("psub", 0)))


async def follow(backend: RedisJobBackend, job_id: str, seen: list[JobRecord]) -> None:
    async for record in backend.watch(job_id):
        seen.append(record)


@pytest.mark.asyncio
async def test_more_watchers_than_the_pool_holds_share_one_subscription(
    redis_clean: str, tmp_path: Path
) -> None:
    backend = RedisJobBackend(Settings(cache_dir=tmp_path, jobs=redis_clean))  # no workers
    await backend.start()
    try:
        job = await backend.submit(JobSpec(method="steps", text="a witty film"))
        seen: list[list[JobRecord]] = [[] for _ in range(WATCHERS)]
        watches = [asyncio.ensure_future(follow(backend, job.id, s)) for s in seen]
        await await_until(lambda: all(seen) and subscribers(redis_clean) == 1)
        # The job API still has connections to work with, also while every watcher reads its
        # job at once (the subscription killed: it comes back and wakes them all). That burst
        # made concurrent calls fail "Too many connections" (UNAVAILABLE) before.
        redis.Redis.from_url(redis_clean).client_kill_filter(_type="pubsub")
        others = await asyncio.gather(
            *(backend.submit(JobSpec(method="steps", text=f"another {i}")) for i in range(50))
        )
        records = await asyncio.gather(*(backend.get(o.id) for o in others))
        assert {r.state for r in records} == {JobState.QUEUED}
        await backend.cancel(job.id)
        await asyncio.wait_for(asyncio.gather(*watches), 60)  # a hang guard
        assert all(s[-1].state == JobState.CANCELLED for s in seen)
    finally:
        await backend.stop(1)


@pytest.mark.asyncio
async def test_a_killed_subscription_comes_back_and_watchers_hear_on(
    redis_clean: str, tmp_path: Path
) -> None:
    backend = RedisJobBackend(Settings(cache_dir=tmp_path, jobs=redis_clean))
    await backend.start()
    try:
        job = await backend.submit(JobSpec(method="steps", text="a witty film"))
        seen: list[JobRecord] = []
        watch = asyncio.ensure_future(follow(backend, job.id, seen))
        await await_until(lambda: seen and subscribers(redis_clean) == 1)
        redis.Redis.from_url(redis_clean).client_kill_filter(_type="pubsub")
        await await_until(lambda: subscribers(redis_clean) == 1)  # subscribed again
        await backend.cancel(job.id)
        await asyncio.wait_for(watch, 60)
        assert [r.state for r in seen] == [JobState.QUEUED, JobState.CANCELLED]
    finally:
        await backend.stop(1)


@pytest.mark.asyncio
async def test_a_refused_subscription_leaves_watches_polling(
    redis_acl: RedisAcl, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL granting the channels as ``&limelight:*`` lets the job scripts publish but
    refuses the pattern subscription (Redis matches PSUBSCRIBE patterns literally): watches
    still follow their job (each polls it every second), one WARNING says why, and the
    subscriber stays alive to ask again (the old one ended with its exception unread)."""
    redis.Redis.from_url(redis_acl.admin_url).flushall()
    backend = RedisJobBackend(Settings(cache_dir=tmp_path, jobs=redis_acl.no_pattern_url))
    await backend.start()
    try:
        job = await backend.submit(JobSpec(method="steps", text="a witty film"))
        seen: list[JobRecord] = []
        watch = asyncio.ensure_future(follow(backend, job.id, seen))
        await await_until(lambda: seen and "refused the subscription" in caplog.text)
        (subscriber,) = [t for t in asyncio.all_tasks() if t.get_name() == "job-events"]
        assert not subscriber.done()
        await backend.cancel(job.id)
        await asyncio.wait_for(watch, 60)  # a hang guard
        assert [r.state for r in seen] == [JobState.QUEUED, JobState.CANCELLED]
        assert caplog.text.count("refused the subscription") == 1
    finally:
        await backend.stop(1)


@pytest.mark.asyncio
async def test_a_loop_that_swallows_a_cancellation_is_cancelled_again_until_it_ends() -> None:
    """redis-py can turn a cancellation that lands mid-command (over TLS) into a connection
    error, which the sidecar's queue loops outlive: `RedisJobBackend.stop` then waited for its
    depth loop for ever (seen about once in 25 runs of the TLS lifecycle test)."""
    swallowed = 0

    async def loop_that_outlives_errors() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed == 0:  # as redis-py's ConnectionError would be taken
                    swallowed += 1
                    continue
                raise

    task = asyncio.get_running_loop().create_task(loop_that_outlives_errors())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_until_done(task, again_s=0.05), timeout=30)
    assert task.cancelled() and swallowed == 1
    await cancel_until_done(None)  # nothing to stop
