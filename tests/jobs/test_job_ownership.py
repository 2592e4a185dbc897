"""Jobs belong to the principal that submitted them; idempotency keys are scoped by owner and
bound to their request; each owner has its own share of the queue and of the jobs kept. On both
backends (SQLite journal, real redis-server)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from helpers import test_registry

from limelight.core.jobs import JobBackend, JobSpec, JobState
from limelight.errors import InvalidArgument, NotFound, ResourceExhausted
from limelight.jobs.redis_backend import RedisJobBackend
from limelight.jobs.runner import JobRunner
from limelight.jobs.sqlite_backend import SqliteJobBackend
from limelight.models.loaded import LoadedModel
from limelight.settings import Settings

ALICE, BOB = "token:alice", "x509:CN=bob"


@contextlib.asynccontextmanager
async def _backend(
    kind: str,
    tmp_path: Path,
    model: LoadedModel,
    request: pytest.FixtureRequest,
    **overrides: object,
) -> AsyncIterator[JobBackend]:
    """A started backend of ``kind`` (stopped afterwards), with ``overrides`` of the settings."""
    backend: JobBackend
    if kind == "sqlite":
        settings = Settings(cache_dir=tmp_path, jobs="sqlite", **overrides)  # type: ignore[arg-type]
        backend = SqliteJobBackend(settings, runner=None)  # no workers: jobs stay queued
    else:
        url = request.getfixturevalue("redis_clean")
        settings = Settings(cache_dir=tmp_path, jobs=url, **overrides)  # type: ignore[arg-type]
        backend = RedisJobBackend(settings, runner=JobRunner(model, test_registry(), settings))
    await backend.start()
    try:
        yield backend
    finally:
        await backend.stop(1.0)


OpenBackend = Callable[..., contextlib.AbstractAsyncContextManager[JobBackend]]


@pytest.fixture(params=["sqlite", "redis"])
def open_backend(
    request: pytest.FixtureRequest, tmp_path: Path, tiny_model: LoadedModel
) -> OpenBackend:
    """``open_backend(**settings)``: a started backend of each kind in turn (``_backend``)."""
    return functools.partial(_backend, request.param, tmp_path, tiny_model, request)


def _spec(text: str, owner: str, key: str = "") -> JobSpec:
    return JobSpec(method="steps", text=text, params={"steps": 4, "sleep": 0.0}, owner=owner,
                   idempotency_key=key)  # fmt: skip


async def _raises(kind: type[Exception], call: Callable[[], object]) -> None:
    with pytest.raises(kind):
        result = call()
        if asyncio.iscoroutine(result):
            await result


@pytest.mark.asyncio
async def test_other_principals_cannot_see_or_cancel_a_job(open_backend: OpenBackend) -> None:
    async with open_backend() as backend:
        mine = await backend.submit(_spec("the plot is great fun", ALICE))
        assert mine.spec.owner == ALICE
        await _raises(NotFound, lambda: backend.get(mine.id, BOB))
        await _raises(NotFound, lambda: backend.get(mine.id, ""))  # anonymous is no owner
        await _raises(NotFound, lambda: backend.cancel(mine.id, BOB))
        with pytest.raises(NotFound):
            async for _ in backend.watch(mine.id, BOB):
                pass
        assert await backend.list(None, 100, BOB) == []
        assert [j.id for j in await backend.list(None, 100, ALICE)] == [mine.id]
        assert (await backend.get(mine.id, ALICE)).state is JobState.QUEUED
        assert (await backend.get(mine.id)).spec.owner == ALICE  # in-process: unchecked
        assert (await backend.cancel(mine.id, ALICE)).state is JobState.CANCELLED


@pytest.mark.asyncio
async def test_idempotency_keys_are_per_owner_and_bound_to_their_request(
    open_backend: OpenBackend,
) -> None:
    async with open_backend() as backend:
        first = await backend.submit(_spec("a fun film", ALICE, key="k-1"))
        again = await backend.submit(_spec("a fun film", ALICE, key="k-1"))
        assert again.id == first.id
        with pytest.raises(InvalidArgument, match="idempotency key"):
            await backend.submit(_spec("a different film", ALICE, key="k-1"))
        # Bob's "k-1" is his own key: a job of his, not Alice's.
        bobs = await backend.submit(_spec("a fun film", BOB, key="k-1"))
        assert bobs.id != first.id and bobs.spec.owner == BOB
        assert (await backend.get(first.id, ALICE)).spec.text == "a fun film"


@pytest.mark.asyncio
async def test_one_owner_cannot_fill_the_queue_past_its_share(open_backend: OpenBackend) -> None:
    async with open_backend(job_queue_max_per_owner=2) as backend:
        first = await backend.submit(_spec("one", ALICE, key="k-1"))
        await backend.submit(_spec("two", ALICE))
        with pytest.raises(ResourceExhausted, match=r"your jobs are queued \(2, limit 2 per"):
            await backend.submit(_spec("three", ALICE))
        # Another owner still gets in, and a retry of a queued job (same key) is no new job.
        assert (await backend.submit(_spec("one", BOB))).spec.owner == BOB
        assert (await backend.submit(_spec("one", ALICE, key="k-1"))).id == first.id
        await backend.cancel(first.id, ALICE)  # a share frees up once a job leaves the queue
        third = await backend.submit(_spec("three", ALICE))
        assert (await backend.get(third.id, ALICE)).state is JobState.QUEUED


@pytest.mark.asyncio
async def test_past_the_retain_limit_an_owners_oldest_finished_jobs_are_dropped(
    open_backend: OpenBackend,
) -> None:
    async with open_backend(job_retain_max=3) as backend:
        bobs = await backend.submit(_spec("bob's", BOB, key="b"))
        await backend.cancel(bobs.id, BOB)
        waiting = await backend.submit(_spec("still queued", ALICE))  # the oldest, never dropped
        done = []
        for n in range(4):
            job = await backend.submit(_spec(f"review {n}", ALICE, key=f"k-{n}"))
            await backend.cancel(job.id, ALICE)  # cancelled: finished
            done.append(job.id)
        # Five of Alice's jobs were submitted, three are kept: the two oldest finished went.
        for dropped in done[:2]:
            with pytest.raises(NotFound, match="oldest finished jobs past"):
                await backend.get(dropped, ALICE)
        assert (await backend.get(waiting.id, ALICE)).state is JobState.QUEUED
        kept = {job.id for job in await backend.list(None, 100, ALICE)}
        assert kept == {waiting.id, *done[2:]}
        # Bob's finished job is his own share's: Alice's submissions never drop it.
        assert (await backend.get(bobs.id, BOB)).state is JobState.CANCELLED
        # A dropped job's idempotency key is free for new work.
        again = await backend.submit(_spec("review 0", ALICE, key="k-0"))
        assert again.id != done[0]
