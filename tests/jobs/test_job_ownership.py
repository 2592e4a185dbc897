"""Jobs belong to the principal that submitted them; idempotency keys are scoped by owner and
bound to their request. On both backends (SQLite journal, real redis-server)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import test_registry

from limelight.core.jobs import JobBackend, JobSpec, JobState
from limelight.errors import InvalidArgument, NotFound
from limelight.jobs.redis_backend import RedisJobBackend
from limelight.jobs.runner import JobRunner
from limelight.jobs.sqlite_backend import SqliteJobBackend
from limelight.models.loaded import LoadedModel
from limelight.settings import Settings

ALICE, BOB = "token:alice", "x509:CN=bob"


def _backend(
    kind: str, tmp_path: Path, model: LoadedModel, request: pytest.FixtureRequest
) -> JobBackend:
    if kind == "sqlite":
        settings = Settings(cache_dir=tmp_path, jobs="sqlite")
        backend = SqliteJobBackend(settings, runner=None)  # no workers: jobs stay queued
        return backend
    url = request.getfixturevalue("redis_clean")
    settings = Settings(cache_dir=tmp_path, jobs=url)
    return RedisJobBackend(settings, runner=JobRunner(model, test_registry(), settings))


def _spec(text: str, owner: str, key: str = "") -> JobSpec:
    return JobSpec(method="steps", text=text, params={"steps": 4, "sleep": 0.0}, owner=owner,
                   idempotency_key=key)  # fmt: skip


async def _raises(kind: type[Exception], call: Callable[[], object]) -> None:
    with pytest.raises(kind):
        result = call()
        if asyncio.iscoroutine(result):
            await result


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_other_principals_cannot_see_or_cancel_a_job(
    kind: str, tmp_path: Path, tiny_model: LoadedModel, request: pytest.FixtureRequest
) -> None:
    backend = _backend(kind, tmp_path, tiny_model, request)

    await backend.start()
    try:
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
    finally:
        await backend.stop(1.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_idempotency_keys_are_per_owner_and_bound_to_their_request(
    kind: str, tmp_path: Path, tiny_model: LoadedModel, request: pytest.FixtureRequest
) -> None:
    backend = _backend(kind, tmp_path, tiny_model, request)

    await backend.start()
    try:
        first = await backend.submit(_spec("a fun film", ALICE, key="k-1"))
        again = await backend.submit(_spec("a fun film", ALICE, key="k-1"))
        assert again.id == first.id
        with pytest.raises(InvalidArgument, match="idempotency key"):
            await backend.submit(_spec("a different film", ALICE, key="k-1"))
        # Bob's "k-1" is his own key: a job of his, not Alice's.
        bobs = await backend.submit(_spec("a fun film", BOB, key="k-1"))
        assert bobs.id != first.id and bobs.spec.owner == BOB
        assert (await backend.get(first.id, ALICE)).spec.text == "a fun film"
    finally:
        await backend.stop(1.0)
