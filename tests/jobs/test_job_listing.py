"""Listing jobs a page at a time (``ListJobs.page_token``), on both backends: every job once,
newest first by (created_at, id), jobs created in the same instant split across pages, jobs
submitted or expired while paging; and end to end through gRPC, the SDK's ``iter_jobs``,
``limelight jobs list --all`` and the viewer's HTTP route."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from itertools import count
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import redis

from limelight.core.jobs import JobBackend, JobCursor, JobRecord, JobSpec
from limelight.errors import InvalidArgument
from limelight.jobs import redis_backend, sqlite_backend
from limelight.jobs.redis_backend import RedisJobBackend
from limelight.jobs.redis_store import owner_tag
from limelight.jobs.sqlite_backend import SqliteJobBackend
from limelight.settings import Settings
from limelight_client import Client
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The backends' clock (``time.time`` as their modules see it) moves every fifth job, so
    jobs share creation instants in fives."""
    steps = count()

    class Clock:
        @staticmethod
        def time() -> float:
            return 1_800_000_000.0 + next(steps) // 5

        def __getattr__(self, name: str) -> object:
            import time

            return getattr(time, name)

    for module in (sqlite_backend, redis_backend):
        monkeypatch.setattr(module, "time", Clock())
    yield


@pytest_asyncio.fixture(params=["sqlite", "redis"])
async def backend(
    request: pytest.FixtureRequest, tmp_path: Path, ticks: None
) -> AsyncIterator[JobBackend]:
    """A backend with no workers: submitted jobs stay queued."""
    if request.param == "sqlite":
        store: JobBackend = SqliteJobBackend(
            Settings(cache_dir=tmp_path, jobs_db=tmp_path / "jobs.sqlite3"), None
        )
    else:
        url = request.getfixturevalue("redis_clean")
        store = RedisJobBackend(Settings(cache_dir=tmp_path, jobs=url))
    await store.start()
    yield store
    await store.stop(1.0)


async def submit(backend: JobBackend, n: int) -> list[JobRecord]:
    return [await backend.submit(JobSpec(method="steps", text=f"review {i}")) for i in range(n)]


def newest_first(records: list[JobRecord]) -> list[str]:
    return [r.id for r in sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)]


async def pages(
    backend: JobBackend, size: int, owner: str | None = None
) -> AsyncIterator[list[JobRecord]]:
    after = None
    while page := await backend.list(None, size, owner, after=after):
        yield page
        after = JobCursor.of(page[-1])


@pytest.mark.asyncio
async def test_pages_list_every_job_once_newest_first(backend: JobBackend) -> None:
    jobs = await submit(backend, 23)
    created = sorted((r.created_at for r in jobs), reverse=True)
    # The premise: jobs of one instant on both sides of a page boundary.
    assert any(created[k - 1] == created[k] for k in range(4, 23, 4))
    listed = [r.id async for page in pages(backend, 4) for r in page]
    assert listed == newest_first(jobs)
    assert [r.id for r in await backend.list(None, 100)] == newest_first(jobs)


@pytest.mark.asyncio
async def test_jobs_submitted_or_expired_while_paging(backend: JobBackend) -> None:
    jobs = await submit(backend, 12)
    first = await backend.list(None, 5)
    later = await submit(backend, 3)  # newer than the cursor: on a fresh first page only
    order = newest_first(jobs)
    expired = order[7]
    if isinstance(backend, RedisJobBackend):  # its TTL ran out: the hash is gone
        await backend.client.delete(backend.keys.job(expired))
    else:
        assert isinstance(backend, SqliteJobBackend) and backend._db is not None
        with backend._lock:
            backend._db.execute("UPDATE jobs SET expires_at = 1 WHERE id = ?", (expired,))
    rest = await backend.list(None, 100, after=JobCursor.of(first[-1]))
    assert [r.id for r in first + rest] == [i for i in order if i != expired]
    assert not {r.id for r in later} & {r.id for r in rest}


@pytest.mark.asyncio
async def test_an_owners_listing_reads_its_own_jobs_not_every_tenants(backend: JobBackend) -> None:
    """A tenant with two jobs beside another with hundreds: its pages are its own jobs, newest
    first, and on Redis its listing reads its own index (it walked the shared one, reading
    every tenant's job hashes to keep its own)."""
    crowd = [
        await backend.submit(JobSpec(method="steps", text=f"r{i}", owner="token:b"))
        for i in range(250)
    ]
    mine = [await backend.submit(JobSpec(method="steps", text=t, owner="token:a")) for t in "xy"]
    reads = await hash_reads(backend)
    listed = [r.id async for page in pages(backend, 1, owner="token:a") for r in page]
    assert listed == newest_first(mine)
    if isinstance(backend, RedisJobBackend):
        assert await hash_reads(backend) - reads <= 2 * len(mine)
        # Jobs submitted by a sidecar from before the owner's index are listed from the shared
        # one (filtered) until they expire.
        await backend.client.delete(backend.keys.owner(owner_tag("token:a")))
        assert [r.id for r in await backend.list(None, 10, "token:a")] == newest_first(mine)
    theirs = await backend.list(None, 300, owner="token:b")
    assert [r.id for r in theirs] == newest_first(crowd)
    everyone = await backend.list(None, 300)  # in-process callers: every job
    assert len(everyone) == len(crowd) + len(mine)


async def hash_reads(backend: JobBackend) -> int:
    """How many job hashes Redis has been asked for (0 for SQLite)."""
    if not isinstance(backend, RedisJobBackend):
        return 0
    stats = await backend.client.info("commandstats")
    return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))


def test_page_tokens_are_checked() -> None:
    cursor = JobCursor(1_800_000_000.25, "abc")
    assert JobCursor.from_token(cursor.token()) == cursor
    huge = base64.urlsafe_b64encode(f'[{"9" * 400},"a"]'.encode()).decode()  # no float holds it
    for token in ("not a token", "e30", JobCursor(0.0, "x").token()[:-3] + "!!!", huge):
        with pytest.raises(InvalidArgument, match="page_token"):
            JobCursor.from_token(token)


def test_listing_a_page_at_a_time_end_to_end(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    redis_clean: str,
    tmp_path: Path,
) -> None:
    """With a Redis queue and no worker the 250 jobs stay queued: more than one page holds."""
    sidecar = start_sidecar(model_dir=bert_tiny_dir, jobs=redis_clean)
    with Client(sidecar.target, timeout=60) as client:
        ids = [client.submit(f"review {i}", "integrated_gradients").id for i in range(250)]
        assert [j.id for j in client.iter_jobs(page_size=100)] == ids[::-1]
        assert [j.id for j in client.jobs(limit=10)] == ids[:-11:-1]  # the first page
        served = client.model()
        assert {(j.model_name, j.model_version) for j in client.jobs(limit=10)} == {
            (served.name, served.version)
        }

    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(sidecar.target))
    first = stub.ListJobs(pb.ListJobsRequest(limit=200), timeout=30)
    last = stub.ListJobs(pb.ListJobsRequest(page_token=first.next_page_token), timeout=30)
    assert len(first.jobs) == 200 and len(last.jobs) == 50 and not last.next_page_token
    with pytest.raises(grpc.RpcError) as bad:
        stub.ListJobs(pb.ListJobsRequest(page_token="nonsense"), timeout=30)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    cli = [sys.executable, "-m", "limelight.cli.main", "jobs", "list", "--all", "--json"]
    listed = subprocess.run(
        [*cli, "--target", sidecar.target],
        capture_output=True,
        text=True,
        check=True,
    )
    assert [j["id"] for j in json.loads(listed.stdout)] == ids[::-1]

    url = f"http://127.0.0.1:{sidecar.server.metrics_port}/viewer/api/jobs?limit=200"
    with urllib.request.urlopen(url, timeout=30) as reply:
        page = json.load(reply)
    with urllib.request.urlopen(f"{url}&page_token={page['next_page_token']}") as reply:
        rest = json.load(reply)
    assert [j["id"] for j in page["jobs"] + rest["jobs"]] == ids[::-1]
    assert rest["next_page_token"] == ""
    redis.Redis.from_url(redis_clean).flushall()
