"""Redis faults on a real redis-server that the tests stop and start: the sidecar side answers
UNAVAILABLE and reconnects by itself (also when Redis was down as it started, and after a
failover), watch rides out a restart, workers wait instead of dying, and with append-only
persistence queued jobs survive a Redis restart."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from helpers import (
    await_until,
    served_sidecar,
    test_registry,
    touch,
    wait_serving,
    wait_state,
    wait_until,
    worker_thread,
)
from prometheus_client import CollectorRegistry

from limelight.api.ports import free_port
from limelight.core.jobs import JobSpec, JobState
from limelight.errors import ErrorKind, LimelightError, ResourceExhausted, Unavailable
from limelight.jobs.redis_backend import RedisJobBackend
from limelight.jobs.redis_worker import RedisWorker
from limelight.jobs.runner import JobRunner
from limelight.metrics import Metrics
from limelight.models.loaded import LoadedModel
from limelight.settings import Settings
from tests.conftest import running_redis


class RedisProcess:
    """A redis-server on a fixed port with append-only persistence, stopped and started at will."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir = workdir
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (run `make sysdeps`)")
        argv = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url)
        wait_until(lambda: self._pings(client))

    def _pings(self, client: redis.Redis) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail("redis-server did not start")
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
            return False

    def stop(self) -> None:
        """SIGTERM: Redis flushes its append-only file and exits."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis", free_port())
    server.workdir.mkdir()
    server.start()
    yield server
    server.stop()


def _settings(url: str, tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path, jobs=url, job_reclaim_idle_s=30)


def _kind(exc: BaseException) -> ErrorKind | None:
    return exc.kind if isinstance(exc, LimelightError) else None


@pytest.mark.asyncio
async def test_backend_answers_unavailable_while_redis_is_down_and_reconnects(
    tiny_model: LoadedModel, restartable_redis: RedisProcess, tmp_path: Path
) -> None:
    settings = _settings(restartable_redis.url, tmp_path)
    runner = JobRunner(tiny_model, test_registry(), settings)

    metrics = Metrics(CollectorRegistry())
    backend = RedisJobBackend(settings, metrics, runner=runner)
    backend.depth_interval_s = 0.1

    def queue_up() -> float | None:
        return metrics.registry.get_sample_value("limelight_job_queue_up", {"backend": "redis"})

    await backend.start()
    try:
        assert queue_up() == 1
        jobs = [
            await backend.submit(JobSpec(method="steps", text=f"good film {i}")) for i in range(12)
        ]
        restartable_redis.stop()
        calls = {
            "submit": backend.submit(JobSpec(method="steps", text="bad")),
            "get": backend.get(jobs[0].id),
            "list": backend.list(None, 10),
            "cancel": backend.cancel(jobs[0].id),
        }
        for name, call in calls.items():
            with pytest.raises(Unavailable) as err:
                await call
            assert _kind(err.value) is ErrorKind.UNAVAILABLE, name
        assert queue_up() == 0  # for LimelightJobQueueDown
        restartable_redis.start()
        await await_until(lambda: queue_up() == 1)
        # Same backend, no restart: it reconnects on the next command, and with
        # append-only persistence every queued job is still there.
        listed = await backend.list([JobState.QUEUED], 100)
        assert {j.id for j in listed} == {j.id for j in jobs}
        assert (await backend.cancel(jobs[0].id)).state is JobState.CANCELLED
    finally:
        await backend.stop(1.0)


@pytest.mark.asyncio
async def test_watch_and_workers_survive_a_redis_restart(
    tiny_model: LoadedModel, restartable_redis: RedisProcess, tmp_path: Path
) -> None:
    settings = _settings(restartable_redis.url, tmp_path)
    runner = JobRunner(tiny_model, test_registry(), settings)
    release, started = tmp_path / "release", tmp_path / "started"
    worker = RedisWorker(settings, runner, name="w-faults", backoff_max_s=0.2)

    backend = RedisJobBackend(settings, runner=runner)
    backend.watch_reconnect_s = 120
    await backend.start()
    try:
        job = await backend.submit(
            JobSpec(
                method="block",
                text="the plot is great fun",
                params={"release": str(release), "started": str(started)},
            )
        )
        seen: list[JobState] = []

        async def follow() -> None:
            async for record in backend.watch(job.id):
                seen.append(record.state)

        watcher = asyncio.create_task(follow())
        with worker_thread(worker) as thread:
            await await_until(lambda: started.exists() and JobState.RUNNING in seen)
            restartable_redis.stop()
            # The worker notices (its next progress poll fails) and waits, alive.
            await await_until(lambda: not worker.ready)
            assert thread.is_alive()
            restartable_redis.start()
            await await_until(lambda: worker.ready)
            touch(release)
            await asyncio.wait_for(watcher, timeout=120)
            assert thread.is_alive() and worker.outages >= 1
        assert seen[-1] is JobState.SUCCEEDED
        assert (await backend.get(job.id)).state is JobState.SUCCEEDED
    finally:
        await backend.stop(1.0)


@pytest.mark.asyncio
async def test_a_worker_started_while_redis_is_down_waits_for_it(
    tiny_model: LoadedModel, restartable_redis: RedisProcess, tmp_path: Path
) -> None:
    settings = _settings(restartable_redis.url, tmp_path)
    runner = JobRunner(tiny_model, test_registry(), settings)
    restartable_redis.stop()
    worker = RedisWorker(settings, runner, name="w-early", backoff_max_s=0.2)
    with worker_thread(worker) as thread:
        assert not worker.ready and thread.is_alive()
        restartable_redis.start()
        await await_until(lambda: worker.ready)

        backend = RedisJobBackend(settings, runner=runner)
        await backend.start()
        try:
            job = await backend.submit(JobSpec(method="steps", text="fun"))
            final: JobState | None = None
            async for record in backend.watch(job.id):
                if record.state.terminal:
                    final = record.state
                    break
            assert final is JobState.SUCCEEDED  # None: the watch ended before the job did
        finally:
            await backend.stop(1.0)


def test_a_sidecar_started_while_redis_is_down_serves_and_takes_jobs_once_it_is_up(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """Inline explanations do not need the job queue: a sidecar whose Redis is down when it
    starts (restarting beside it, say) serves them, answers job calls UNAVAILABLE, and takes
    jobs once Redis answers, without a restart (it used to exit, taking the pod's readiness
    and every inline explanation with it)."""
    import grpc

    from limelight_client import Client
    from limelight_client.errors import LimelightError
    from limelight_client.types import JobState as ClientState

    queue = RedisProcess(tmp_path / "redis", free_port())  # not started yet
    queue.workdir.mkdir()
    try:
        with (
            served_sidecar(bert_tiny_dir, queue.url, tmp_path) as (server, port, log),
            Client(f"127.0.0.1:{port}", timeout=30, retries=0) as client,
        ):
            wait_serving(client, server, log)
            assert client.explain("a moving , funny film").tokens
            with pytest.raises(LimelightError) as down:
                client.submit("dull and far too long", "integrated_gradients", steps=8)
            assert down.value.code == grpc.StatusCode.UNAVAILABLE
            assert "unreachable" in log.read_text()

            queue.start()
            job = client.submit("dull and far too long", "integrated_gradients", steps=8)
            assert job.refresh().state == ClientState.QUEUED
            # Once Redis answered, the sidecar also made the workers' consumer group (KEDA
            # reads its lag before any worker started).
            admin = redis.Redis.from_url(queue.url)
            wait_until(lambda: len(admin.xinfo_groups("limelight:stream")) == 1)
            assert server.poll() is None
    finally:
        queue.stop()


@pytest.fixture
def demoted_node(tmp_path: Path) -> Iterator[str]:
    """The URL of a Redis that is a replica: what a client's open connections reach after a
    managed Redis failed over (the old primary demoted, the address moved on). Promoting it
    (``REPLICAOF NO ONE``) stands for the new primary answering."""
    (tmp_path / "primary").mkdir()
    (tmp_path / "replica").mkdir()
    url = "redis://127.0.0.1:{port}/0"
    with running_redis(tmp_path / "primary", url) as primary:
        port = primary.rsplit(":", 1)[1].split("/")[0]
        with running_redis(tmp_path / "replica", url, "--replicaof", "127.0.0.1", port) as node:
            yield node


def _clients(node: redis.Redis) -> set[str]:
    """Ids of the node's client connections, not counting ``node``'s own or its link to its
    primary (flag M)."""
    own = str(node.client_id())
    return {
        str(c["id"])
        for c in node.client_list()
        if str(c["id"]) != own and "M" not in str(c.get("flags", ""))
    }


@pytest.mark.asyncio
async def test_a_failover_is_unavailable_and_the_sidecar_dials_the_new_primary(
    demoted_node: str, tmp_path: Path
) -> None:
    node = redis.Redis.from_url(demoted_node)
    others = _clients(node)
    backend = RedisJobBackend(_settings(demoted_node, tmp_path))
    await backend.start()  # READONLY on its consumer group: serves, and says so
    try:
        assert await backend.list(None, 10) == []  # reads work on a replica
        pooled = _clients(node) - others
        assert pooled
        with pytest.raises(Unavailable):  # READONLY: a write, refused (was INTERNAL)
            await backend.submit(JobSpec(method="steps", text="a witty film"))
        # Every connection that reached the demoted node is closed: the next command dials
        # the address again, which after a real failover reaches the new primary.
        await await_until(lambda: not pooled & _clients(node))
        node.replicaof("NO", "ONE")
        job = await backend.submit(JobSpec(method="steps", text="a witty film"))
        assert (await backend.get(job.id)).state is JobState.QUEUED
    finally:
        await backend.stop(1.0)


@pytest.mark.asyncio
async def test_a_worker_waits_out_a_failover(
    tiny_model: LoadedModel, demoted_node: str, tmp_path: Path
) -> None:
    settings = _settings(demoted_node, tmp_path)
    runner = JobRunner(tiny_model, test_registry(), settings)
    worker = RedisWorker(settings, runner, name="w-failover", backoff_max_s=0.2)
    with worker_thread(worker) as thread:
        await asyncio.sleep(0.5)  # READONLY on its consumer group, several times
        assert thread.is_alive() and not worker.ready
        redis.Redis.from_url(demoted_node).replicaof("NO", "ONE")
        await await_until(lambda: worker.ready)
        backend = RedisJobBackend(settings, runner=runner)
        await backend.start()
        try:
            job = await backend.submit(JobSpec(method="steps", text="fun"))
            final = await asyncio.wait_for(wait_state(backend, job.id), 120)  # a hang guard
            assert final.state is JobState.SUCCEEDED
        finally:
            await backend.stop(1.0)


@pytest.fixture
def small_redis(tmp_path: Path) -> Iterator[str]:
    """A Redis that refuses writes once it holds its ``maxmemory`` (``noeviction``); tests
    make it full by setting that limit below what it holds (``full``)."""
    (tmp_path / "small").mkdir()
    config = ("--maxmemory-policy", "noeviction")
    with running_redis(tmp_path / "small", "redis://127.0.0.1:{port}/0", *config) as url:
        yield url


def full(url: str, is_full: bool = True) -> None:
    """A ``maxmemory`` of 1 byte (every write refused) or none (room again)."""
    redis.Redis.from_url(url).config_set("maxmemory", 1 if is_full else 0)


@pytest.mark.asyncio
async def test_a_full_redis_is_resource_exhausted_and_workers_wait_for_room(
    tiny_model: LoadedModel, small_redis: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _settings(small_redis, tmp_path)
    runner = JobRunner(tiny_model, test_registry(), settings)
    backend = RedisJobBackend(settings, runner=runner)
    await backend.start()
    try:
        job = await backend.submit(JobSpec(method="steps", text="a witty film"))
        full(small_redis)
        for _ in range(3):  # INTERNAL before
            with pytest.raises(ResourceExhausted):
                await backend.submit(JobSpec(method="steps", text="one more"))
        assert (await backend.get(job.id)).state is JobState.QUEUED  # reads still work
        assert caplog.text.count("the job queue is out of memory") == 1  # not one per call

        worker = RedisWorker(settings, runner, name="w-full", backoff_max_s=0.2)
        with worker_thread(worker) as thread:
            await await_until(lambda: "Redis is out of memory" in caplog.text)
            assert thread.is_alive() and worker.jobs_done == 0  # it waits (it crashed before)
            full(small_redis, False)  # room again
            await await_until(lambda: worker.jobs_done == 1)
        assert (await backend.get(job.id)).state is JobState.SUCCEEDED
    finally:
        await backend.stop(1.0)


@pytest.mark.asyncio
async def test_a_redis_that_may_evict_jobs_is_named_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``allkeys-*`` lets a full Redis drop queued jobs, even the stream: the sidecar and
    ``limelight worker`` say so when they connect (``noeviction`` passes silently)."""
    from limelight.jobs.redis_store import check_access

    url = "redis://127.0.0.1:{port}/0"
    for policy, warned in (("allkeys-lru", True), ("noeviction", False)):
        caplog.clear()
        with running_redis(tmp_path, url, "--maxmemory-policy", policy) as queue:
            settings = _settings(queue, tmp_path)
            backend = RedisJobBackend(settings)
            await backend.start()
            await backend.stop(1.0)
            check_access(settings)  # what `limelight worker` asks before starting its processes
        assert caplog.text.count(f"maxmemory-policy {policy}") == (2 if warned else 0)
