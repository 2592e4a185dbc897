"""A Redis reply lost with its connection (a Redis restart, a proxy's idle timeout, a network
blip between a command and its answer): the client sends the command again on a new
connection, and the job scripts that may so run twice recognise their own second run.

The loss is real: the clients talk to redis-server through ``LostReplies``, a TCP proxy that
forwards everything but can close a client's connection instead of passing on the reply to a
chosen command, after Redis has run it."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from helpers import await_until, test_registry, wait_state
from prometheus_client import CollectorRegistry

from limelight.core.jobs import JobSpec, JobState
from limelight.jobs.redis_backend import RedisJobBackend
from limelight.jobs.redis_store import Keys, lua
from limelight.jobs.redis_worker import RedisWorker
from limelight.jobs.runner import JobRunner
from limelight.metrics import Metrics
from limelight.models.loaded import LoadedModel
from limelight.settings import Settings


class LostReplies:
    """A loopback TCP proxy to ``upstream`` (host, port) on its own thread and event loop.
    ``lose(marker)``: the next command whose bytes hold ``marker`` and that Redis answers
    without an error (a NOSCRIPT answer passes) is run, but its client's connection is closed
    instead of getting the reply."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.lost = 0
        self._marker: bytes | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0
        self._server: asyncio.Server | None = None

    def __enter__(self) -> LostReplies:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def lose(self, marker: bytes) -> None:
        with self._lock:
            self._marker = marker

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self._server = server
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self.upstream)
        asked = asyncio.Event()  # this connection sent the marked command

        async def to_server() -> None:
            while data := await client_r.read(65536):
                with self._lock:
                    if self._marker is not None and self._marker in data:
                        asked.set()
                server_w.write(data)
                await server_w.drain()

        async def to_client() -> None:
            while data := await server_r.read(65536):
                if asked.is_set():
                    asked.clear()
                    if not data.startswith(b"-"):  # run by Redis, answered: lose the answer
                        with self._lock:
                            self._marker = None
                            self.lost += 1
                        return
                client_w.write(data)
                await client_w.drain()

        pumps = [asyncio.ensure_future(p) for p in (to_server(), to_client())]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            for writer in (client_w, server_w):
                writer.close()


def script(name: str) -> bytes:
    """What marks a call of the job script ``name``: its SHA1, as EVALSHA sends it."""
    return hashlib.sha1(lua(name).encode()).hexdigest().encode()


@pytest.fixture
def proxied(redis_clean: str) -> Iterator[tuple[LostReplies, str]]:
    """A proxy to the test's Redis and the queue URL through it."""
    direct = redis.Redis.from_url(redis_clean).connection_pool.connection_kwargs
    with LostReplies((direct["host"], direct["port"])) as proxy:
        yield proxy, redis_clean.replace(f":{direct['port']}/", f":{proxy.port}/")


@pytest.mark.asyncio
@pytest.mark.parametrize("key", ["", "same-request"], ids=["plain", "idempotency-key"])
async def test_the_sidecar_sends_again_and_a_lost_submit_queues_once(
    proxied: tuple[LostReplies, str], redis_clean: str, tmp_path: Path, key: str
) -> None:
    """The sidecar's asyncio client was given the synchronous retry policy, which it never
    awaited: every lost reply was an UNAVAILABLE call. Sent again, a submit whose reply was
    lost must not queue the job twice (two stream entries, a depth of two)."""
    proxy, url = proxied
    backend = RedisJobBackend(Settings(cache_dir=tmp_path, jobs=url))
    await backend.start()
    try:
        first = await backend.submit(JobSpec(method="steps", text="a"))
        keys = Keys("limelight")
        proxy.lose(keys.job(first.id).encode())
        assert (await backend.get(first.id)).id == first.id  # a read, sent again
        assert proxy.lost == 1

        proxy.lose(script("submit"))
        job = await backend.submit(JobSpec(method="steps", text="b", idempotency_key=key))
        assert proxy.lost == 2
        assert job.state is JobState.QUEUED and job.spec.text == "b"
        direct = redis.Redis.from_url(redis_clean, decode_responses=True)
        assert direct.xlen(keys.stream) == 2  # one entry per job
        assert direct.hget(keys.depth, "steps") == "2"
        assert [j.id for j in await backend.list(None, 10)] == [job.id, first.id]
    finally:
        await backend.stop(1)


@pytest.mark.asyncio
async def test_a_worker_that_loses_a_claim_or_a_finish_reply_counts_one_attempt(
    proxied: tuple[LostReplies, str],
    redis_clean: str,
    tiny_model: LoadedModel,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A claim sent again counted a second attempt (a job at ``job_max_attempts`` failed as
    "worker died" without having run); a finish sent again found its job ended and logged that
    another worker owned it."""
    proxy, url = proxied
    settings = Settings(cache_dir=tmp_path, jobs=url, job_max_attempts=1)
    runner = JobRunner(tiny_model, test_registry(), settings)
    backend = RedisJobBackend(Settings(cache_dir=tmp_path, jobs=redis_clean), runner=runner)
    await backend.start()
    worker = RedisWorker(settings, runner, name="w-lost", backoff_max_s=0.2)
    thread = threading.Thread(target=worker.run, daemon=True)
    try:
        proxy.lose(script("claim"))
        thread.start()
        claimed = await backend.submit(JobSpec(method="steps", text="a fine film"))
        done = await asyncio.wait_for(wait_state(backend, claimed.id), 60)
        assert proxy.lost == 1
        assert (done.state, done.attempts) == (JobState.SUCCEEDED, 1)

        proxy.lose(script("finish"))
        with caplog.at_level(logging.WARNING, logger="limelight.jobs.redis_worker"):
            finished = await backend.submit(JobSpec(method="steps", text="a dull film"))
            done = await asyncio.wait_for(wait_state(backend, finished.id), 60)
            await await_until(lambda: proxy.lost == 2)
            worker.request_stop()  # after the finish it sends again
            await asyncio.to_thread(thread.join, 30)
        assert (done.state, done.attempts) == (JobState.SUCCEEDED, 1)
        assert "another worker owns it" not in caplog.text
        assert worker.jobs_done == 2
    finally:
        worker.request_stop()
        if thread.is_alive():
            thread.join(30)
        await backend.stop(1)


@pytest.mark.asyncio
async def test_a_lost_cancel_reply_counts_the_cancelled_job(
    proxied: tuple[LostReplies, str], redis_clean: str, tmp_path: Path
) -> None:
    """A cancel sent again found the job already cancelled by its first run and did not count
    it in ``limelight_jobs_total``."""
    proxy, url = proxied
    metrics = Metrics(CollectorRegistry())
    backend = RedisJobBackend(Settings(cache_dir=tmp_path, jobs=url), metrics)
    await backend.start()
    try:
        job = await backend.submit(JobSpec(method="steps", text="a"))
        proxy.lose(script("cancel"))
        assert (await backend.cancel(job.id)).state is JobState.CANCELLED
        assert proxy.lost == 1
        counted = {"method": "steps", "outcome": "cancelled"}
        assert metrics.registry.get_sample_value("limelight_jobs_total", counted) == 1
        direct = redis.Redis.from_url(redis_clean, decode_responses=True)
        assert direct.hget(Keys("limelight").depth, "steps") == "0"
    finally:
        await backend.stop(1)
