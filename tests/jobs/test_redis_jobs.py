"""The Redis backend and workers on a real redis-server."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from helpers import (
    await_until,
    cancel_during_a_late_report,
    expired,
    reference_prediction,
    test_registry,
    touch,
    wait_serving,
    wait_state,
    worker_thread,
)
from jobs_testing_methods import expected_scores
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from limelight.api.ports import free_port
from limelight.core.jobs import JobRecord, JobSpec, JobState
from limelight.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from limelight.jobs.redis_backend import NO_WORKER, RedisJobBackend
from limelight.jobs.redis_store import GROUP, Keys, connection, lua
from limelight.jobs.redis_worker import RedisWorker
from limelight.jobs.runner import JobRunner
from limelight.metrics import Metrics
from limelight.models.loaded import LoadedModel
from limelight.settings import Settings
from tests.conftest import RedisAcl

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
#: A queued job's message while no worker consumes the queue.
QUEUED_ALONE = f"queued; {NO_WORKER}"


def _settings(url: str, tmp_path: Path, **kw: Any) -> Settings:
    return Settings(cache_dir=tmp_path, jobs=url, **kw)


def _sample(metrics: Metrics, name: str, labels: dict[str, str]) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.mark.asyncio
async def test_lifecycle_cancel_timeout(
    tiny_model: LoadedModel, redis_queue: str, tmp_path: Path
) -> None:
    # The per-owner limits on too (their script paths under every ACL): 4 jobs kept.
    settings = _settings(
        redis_queue, tmp_path, job_timeout_s=600, job_queue_max_per_owner=10, job_retain_max=4
    )
    runner = JobRunner(tiny_model, test_registry(), settings)
    side_metrics, worker_metrics = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    text = "the acting was awful"
    ids, probs = reference_prediction(tiny_model, text)
    started = tmp_path / "started"

    backend = RedisJobBackend(settings, side_metrics, runner=runner)
    backend.depth_interval_s = 0.05
    await backend.start()
    try:
        with pytest.raises(InvalidArgument):
            await backend.submit(JobSpec(method="steps", text="x", params={"bad": 1}))
        job = await backend.submit(JobSpec(method="steps", text=text, params={"steps": 4}))
        assert job.state is JobState.QUEUED and job.spec.params == {"steps": 4, "sleep": 0.0}
        assert _sample(side_metrics, "limelight_job_queue_depth", {"method": "steps"}) == 1
        worker = RedisWorker(settings, runner, worker_metrics, name="w-inproc")
        with worker_thread(worker):
            seen = [r async for r in backend.watch(job.id)]
            assert seen[-1].state is JobState.SUCCEEDED
            progress = [r.progress for r in seen]
            assert progress == sorted(progress) and progress[-1] == 1.0
            final = await backend.get(job.id)
            assert final.attempts == 1 and final.result is not None
            # The gauge follows the queue drained by the worker, without any sidecar call.
            await await_until(
                lambda: _sample(side_metrics, "limelight_job_queue_depth", {"method": "steps"}) == 0
            )
            predicted = int(np.argmax(probs))
            np.testing.assert_array_equal(
                final.result.attribution.scores, expected_scores(ids, predicted)
            )
            np.testing.assert_allclose(final.result.probabilities, probs, rtol=1e-5)

            # Cancel a running job (flag read at checkpoints), then a queued one.
            params = {"release": str(tmp_path / "never"), "started": str(started)}
            blocking = await backend.submit(JobSpec(method="block", text="a", params=params))
            await wait_state(backend, blocking.id, {JobState.RUNNING})
            queued = await backend.submit(JobSpec(method="steps", text="b"))
            cancelled = await backend.cancel(queued.id)
            assert cancelled.state is JobState.CANCELLED
            pending = await backend.cancel(blocking.id)
            # The worker may already have seen the flag by the time the record is read.
            assert (pending.state, pending.message) in (
                (JobState.RUNNING, "cancelling"),
                (JobState.CANCELLED, "cancelled"),
            )
            assert (await wait_state(backend, blocking.id)).state is JobState.CANCELLED

            # Timeout.
            slow = await backend.submit(
                JobSpec(method="block", text="a", params=params, timeout_s=0.2)
            )
            final = await wait_state(backend, slow.id)
            assert (final.state, final.error) == (JobState.FAILED, "timed out after 0.2s")

            broken = await backend.submit(JobSpec(method="broken", text="a"))
            final = await wait_state(backend, broken.id)
            assert final.state is JobState.FAILED and "secret" not in final.error

        listed = await backend.list(None, 10)
        # The fifth submission dropped the oldest finished job (the owner keeps 4).
        assert [r.id for r in listed] == [broken.id, slow.id, queued.id, blocking.id]
        with pytest.raises(NotFound, match="oldest finished"):
            await backend.get(job.id)
        only = await backend.list([JobState.CANCELLED], 10)
        assert {r.id for r in only} == {queued.id, blocking.id}
        with pytest.raises(NotFound):
            await backend.get("nope")
        with pytest.raises(NotFound):
            await backend.cancel("nope")
    finally:
        await backend.stop(1)
    for method, outcome in (("steps", "succeeded"), ("block", "cancelled"), ("block", "failed")):
        labels = {"method": method, "outcome": outcome}
        assert _sample(worker_metrics, "limelight_jobs_total", labels) == 1
    cancelled_queued = {"method": "steps", "outcome": "cancelled"}
    assert _sample(side_metrics, "limelight_jobs_total", cancelled_queued) == 1
    assert _sample(worker_metrics, "limelight_job_wait_seconds_count", {"method": "steps"}) == 1
    assert _sample(side_metrics, "limelight_job_queue_depth", {"method": "steps"}) == 0
    # Finished entries are acknowledged and removed from the stream.
    client = redis.Redis.from_url(redis_queue)
    assert client.xlen("limelight:stream") == 0
    assert client.xpending("limelight:stream", "workers")["pending"] == 0


@pytest.mark.asyncio
async def test_idempotency_bounded_queue_and_ttl(redis_clean: str, tmp_path: Path) -> None:
    settings = _settings(redis_clean, tmp_path, job_queue_max=2, job_result_ttl_s=0.3)

    backend = RedisJobBackend(settings)  # no workers: jobs stay queued
    await backend.start()
    try:
        a = await backend.submit(JobSpec(method="steps", text="a", idempotency_key="k"))
        assert (await backend.submit(JobSpec("steps", "a", idempotency_key="k"))).id == a.id
        b = await backend.submit(JobSpec(method="steps", text="b"))
        with pytest.raises(ResourceExhausted, match="queue is full"):
            await backend.submit(JobSpec(method="steps", text="c"))
        assert (await backend.submit(JobSpec("steps", "a", idempotency_key="k"))).id == a.id
        # A cancelled job frees its slot and expires after the TTL, key included.
        await backend.cancel(a.id)
        await backend.cancel(b.id)
        c = await backend.submit(JobSpec(method="steps", text="c"))
        await await_until(lambda: expired(backend, a.id))
        await await_until(lambda: expired(backend, b.id))
        fresh = await backend.submit(JobSpec(method="steps", text="a", idempotency_key="k"))
        assert fresh.id != a.id
        assert [r.id for r in await backend.list(None, 10)] == [fresh.id, c.id]
    finally:
        await backend.stop(1)
    client = redis.Redis.from_url(redis_clean)
    assert client.zcard("limelight:index") == 2  # expired ids pruned from the index


@pytest.mark.asyncio
async def test_expired_jobs_leave_the_index_without_anyone_listing_them(
    redis_clean: str, tmp_path: Path
) -> None:
    # ``list`` prunes only the pages it reads, newest first: the ids of old expired jobs would
    # stay in Redis for good. The queue check goes round the index a slice at a time.
    settings = _settings(redis_clean, tmp_path, job_result_ttl_s=0.3)
    backend = RedisJobBackend(settings)  # no workers: jobs stay queued until cancelled
    backend.depth_interval_s, backend.prune_slice = 0.05, 3
    await backend.start()
    client = redis.Redis.from_url(redis_clean, decode_responses=True)
    try:
        jobs = [await backend.submit(JobSpec(method="steps", text=f"t{i}")) for i in range(8)]
        for i in (0, 1, 3, 5, 6):  # spread over more than one slice
            await backend.cancel(jobs[i].id)
        kept = {jobs[i].id for i in (2, 4, 7)}
        await await_until(lambda: set(client.zrange("limelight:index", 0, -1)) == kept)
        assert {r.id for r in await backend.list(None, 10)} == kept
    finally:
        await backend.stop(1)


@pytest.mark.asyncio
async def test_stopping_worker_hands_job_back(
    tiny_model: LoadedModel, redis_clean: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _settings(redis_clean, tmp_path)
    runner = JobRunner(tiny_model, test_registry(), settings)
    release = tmp_path / "release"
    params = {"release": str(release), "started": str(tmp_path / "started")}

    backend = RedisJobBackend(settings)
    await backend.start()
    try:
        job = await backend.submit(JobSpec(method="block", text="a", params=params))
        first = RedisWorker(settings, runner, name="w-first")
        thread = threading.Thread(target=first.run, daemon=True)
        thread.start()
        await wait_state(backend, job.id, {JobState.RUNNING})
        with caplog.at_level(logging.INFO, logger="limelight.jobs.redis_worker"):
            first.abandon()
            await asyncio.to_thread(thread.join)
        back = await backend.get(job.id)
        assert back.state is JobState.QUEUED and back.attempts == 0
        assert f"job {job.id} re-queued: worker w-first stopping" in caplog.text
        touch(release)
        with worker_thread(RedisWorker(settings, runner, name="w-second")):
            final = await wait_state(backend, job.id)
        assert final.state is JobState.SUCCEEDED and final.attempts == 1
        # A cancel that reached the job after its worker's last look at the flag: handed
        # back with the flag set, it is cancelled when next claimed, not run anew.
        release.unlink()
        job = await backend.submit(JobSpec(method="block", text="b", params=params))
        first = RedisWorker(settings, runner, name="w-third")
        thread = threading.Thread(target=first.run, daemon=True)
        thread.start()
        await wait_state(backend, job.id, {JobState.RUNNING})
        first.abandon()
        await asyncio.to_thread(thread.join)
        redis.Redis.from_url(redis_clean).hset(f"limelight:job:{job.id}", "cancel", "1")
        with worker_thread(RedisWorker(settings, runner, name="w-fourth")):
            final = await wait_state(backend, job.id)
        assert (final.state, final.attempts) == (JobState.CANCELLED, 0)
    finally:
        await backend.stop(1)


def _worker_proc(url: str, model_dir: Path, tmp_path: Path, **env: str) -> subprocess.Popen:
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [environ.get("PYTHONPATH")])])
    environ["LIMELIGHT_TORCH_THREADS"] = "1"  # no oversubscription on a busy machine
    environ.update(env)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "limelight.cli.main",
            "worker",
            "--jobs",
            url,
            "--model",
            str(model_dir),
            "--workers",
            "1",
            "--cache-dir",
            str(tmp_path),
            "--method",
            "jobs_testing_methods:BlockMethod",
            "--method",
            "jobs_testing_methods:CrashMethod",
            "--log-level",
            "WARNING",
        ],
        env=environ,
        cwd=ROOT,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _reclaim_setup(
    url: str, tmp_path: Path, reclaim_idle_s: float
) -> tuple[Settings, dict[str, str], Path, Path, dict[str, str]]:
    """Settings and worker environment reclaiming after ``reclaim_idle_s``, and a ``block``
    job's files (release, started) and parameters."""
    settings = _settings(url, tmp_path, job_reclaim_idle_s=reclaim_idle_s)
    env = {"LIMELIGHT_JOB_RECLAIM_IDLE_S": str(reclaim_idle_s)}
    release, started = tmp_path / "release", tmp_path / "started"
    return settings, env, release, started, {"release": str(release), "started": str(started)}


async def _started_block_job(
    backend: RedisJobBackend, params: dict[str, str], started: Path
) -> JobRecord:
    """A ``block`` job submitted and running in a worker process."""
    job = await backend.submit(JobSpec(method="block", text="a", params=params))
    # The file exists a moment before its pid line is in it: wait for the line.
    await await_until(lambda: started.exists() and started.read_text().endswith("\n"))
    return job


@pytest.mark.asyncio
async def test_killed_worker_job_is_reclaimed(
    tiny_model_dir: Path, redis_clean: str, tmp_path: Path
) -> None:
    settings, env, release, started, params = _reclaim_setup(redis_clean, tmp_path, 2.0)
    workers = [_worker_proc(redis_clean, tiny_model_dir, tmp_path, **env) for _ in range(2)]
    try:
        backend = RedisJobBackend(settings)
        await backend.start()
        try:
            job = await _started_block_job(backend, params, started)
            running = await backend.get(job.id)
            victim = int(started.read_text().split()[0])  # pid of the child running it
            client = redis.Redis.from_url(redis_clean, decode_responses=True)
            owner = client.hget(f"limelight:job:{job.id}", "consumer")
            assert isinstance(owner, str) and owner.endswith(f"-{victim}")
            assert running.state is JobState.RUNNING and running.attempts == 1
            os.kill(victim, signal.SIGKILL)
            # The survivor (or the victim's replacement) reclaims it after the idle time.
            await await_until(lambda: started.read_text().count("\n") >= 2)
            touch(release)
            final = await wait_state(backend, job.id)
            assert final.state is JobState.SUCCEEDED
            assert final.attempts == 2
            new_owner = client.hget(f"limelight:job:{job.id}", "consumer")
            assert new_owner != owner
            assert client.xpending("limelight:stream", "workers")["pending"] == 0
        finally:
            await backend.stop(1)
    finally:
        for proc in workers:
            _stop(proc)
    assert [p.returncode for p in workers] == [0, 0]


@pytest.mark.asyncio
async def test_a_running_job_whose_only_worker_died_says_so(
    tiny_model_dir: Path, redis_clean: str, tmp_path: Path
) -> None:
    # RUNNING forever looked like progress: with no live worker left the job says it waits
    # for one, and a worker started later reclaims and runs it.
    settings, env, release, started, params = _reclaim_setup(redis_clean, tmp_path, 1.0)
    proc = _worker_proc(redis_clean, tiny_model_dir, tmp_path, **env)
    backend = RedisJobBackend(settings)
    await backend.start()
    try:
        job = await _started_block_job(backend, params, started)
        running = await backend.get(job.id)
        assert running.state is JobState.RUNNING and not running.no_worker
        os.kill(proc.pid, signal.SIGKILL)  # the parent first: it would start another child
        proc.wait()
        os.kill(int(started.read_text().split()[0]), signal.SIGKILL)

        async def orphaned() -> bool:
            record = await backend.get(job.id)
            return record.no_worker

        await await_until(orphaned)
        record = await backend.get(job.id)
        assert record.state is JobState.RUNNING
        # (after the job's last progress message, "waiting for release")
        assert record.message.endswith(f"; its worker is gone, and {NO_WORKER} to run it again")
        touch(release)
        proc = _worker_proc(redis_clean, tiny_model_dir, tmp_path, **env)
        final = await wait_state(backend, job.id)
        assert (final.state, final.attempts, final.no_worker) == (JobState.SUCCEEDED, 2, False)
    finally:
        await backend.stop(1)
        _stop(proc)


@pytest.mark.asyncio
async def test_job_whose_worker_keeps_dying_fails(
    tiny_model_dir: Path, redis_clean: str, tmp_path: Path
) -> None:
    settings = _settings(redis_clean, tmp_path, job_max_attempts=2, job_reclaim_idle_s=0.5)
    env = {"LIMELIGHT_JOB_RECLAIM_IDLE_S": "0.5", "LIMELIGHT_JOB_MAX_ATTEMPTS": "2"}
    env["LIMELIGHT_GRACE_PERIOD_S"] = "0.5"
    proc = _worker_proc(redis_clean, tiny_model_dir, tmp_path, **env)
    started = tmp_path / "started"
    never = {"release": str(tmp_path / "never"), "started": str(started)}
    stuck_id = ""
    try:
        backend = RedisJobBackend(settings)
        await backend.start()
        try:
            job = await backend.submit(JobSpec(method="crash", text="a"))
            final = await wait_state(backend, job.id)
            assert final.state is JobState.FAILED
            assert final.error == "worker died 2 times"
            assert final.attempts == 2
            # The queue keeps working afterwards.
            ok = await backend.submit(
                JobSpec(method="block", text="b", params={"release": str(tmp_path)})
            )
            assert (await wait_state(backend, ok.id)).state is JobState.SUCCEEDED
            # SIGTERM while a job runs past the grace period: it goes back to the queue.
            stuck = await backend.submit(JobSpec(method="block", text="c", params=never))
            stuck_id = stuck.id
            await wait_state(backend, stuck.id, {JobState.RUNNING})
        finally:
            await backend.stop(1)
    finally:
        _stop(proc)
    assert proc.returncode == 0

    backend = RedisJobBackend(settings)
    await backend.start()
    try:
        back = await backend.get(stuck_id)
        assert (back.state, back.attempts) == (JobState.QUEUED, 0)
        assert back.message == f"re-queued: its worker stopped; {NO_WORKER}"
    finally:
        await backend.stop(1)


def test_worker_refuses_non_redis_queue(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", "worker", "--jobs", "sqlite"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2 and "redis" in out.stderr


@pytest.mark.asyncio
async def test_a_refused_password_is_unavailable_and_never_shown(
    redis_acl: RedisAcl, tmp_path: Path
) -> None:
    """A sidecar whose queue refuses its password does not start, and says where it tried to
    connect and why, without the password (the message goes to logs)."""
    wrong = redis_acl.url.replace(":s3cret@", ":not-the-password@")
    backend = RedisJobBackend(_settings(wrong, tmp_path))
    with pytest.raises(Unavailable) as refused:
        await backend.start()
    message = refused.value.message
    assert "not-the-password" not in message
    assert "redis://***@127.0.0.1:" in message and "password" in message  # redis-py's reason
    with pytest.raises(ValidationError, match="unknown job backend") as unknown:
        _settings("reddis://limelight:not-the-password@host/0", tmp_path)  # a typo'd scheme
    assert "not-the-password" not in str(unknown.value)


def test_sidecar_enqueues_and_workers_run(
    bert_tiny_dir: Path, redis_queue: str, tmp_path: Path
) -> None:
    """`limelight serve --jobs redis://…` only enqueues; a `limelight worker` runs the jobs."""
    from limelight_client import Client
    from limelight_client.types import JobState as ClientState

    port = free_port()
    # The queue's address in the environment, as from a Kubernetes Secret (argv is readable by
    # every user of the machine, and the address may hold a password).
    env = {**os.environ, "LIMELIGHT_TORCH_THREADS": "1", "LIMELIGHT_JOBS": redis_queue}
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(bert_tiny_dir)]
    argv += ["--port", str(port), "--metrics-port", "0"]
    argv += ["--log-level", "WARNING"]
    server = subprocess.Popen(argv, cwd=ROOT, env=env)
    worker: subprocess.Popen | None = None
    try:
        with Client(f"127.0.0.1:{port}", timeout=30) as client:
            wait_serving(client, server)
            jobs = [
                client.submit(text, "integrated_gradients", steps=8)
                for text in ("a moving , funny film", "dull and far too long")
            ]
            # No worker yet: the sidecar itself runs nothing, and says so.
            assert all(j.refresh().state == ClientState.QUEUED for j in jobs)
            assert jobs[0].info.message == QUEUED_ALONE and jobs[0].info.no_worker
            with pytest.raises(TimeoutError) as raised:
                jobs[0].result(timeout=0.5)
            assert str(raised.value).endswith(f"not finished after 0.5 s ({QUEUED_ALONE}, 0%)")
            worker = _worker_proc(redis_queue, bert_tiny_dir, tmp_path)
            results = [j.result(timeout=600) for j in jobs]
            assert all(len(r.scores) == len(r.tokens) for r in results)
            assert not any(j.info.no_worker for j in jobs)
            assert [j.refresh().attempts for j in jobs] == [1, 1]
            assert {j.id for j in client.jobs(states=["succeeded"])} == {j.id for j in jobs}
    finally:
        for proc in (worker, server):
            if proc is not None:
                _stop(proc)


@pytest.mark.asyncio
async def test_a_report_racing_a_cancel_keeps_it_cancelling(
    tiny_model: LoadedModel, redis_clean: str, tmp_path: Path
) -> None:
    settings = _settings(redis_clean, tmp_path)
    runner = JobRunner(tiny_model, test_registry(), settings)
    backend = RedisJobBackend(settings, Metrics(CollectorRegistry()), runner=runner)
    await backend.start()
    try:
        with worker_thread(RedisWorker(settings, runner, Metrics(CollectorRegistry()))):
            await cancel_during_a_late_report(backend, tmp_path)
    finally:
        await backend.stop(5)


@pytest.mark.asyncio
async def test_a_queued_job_says_when_no_worker_consumes_the_queue(
    tiny_model: LoadedModel, redis_clean: str, tmp_path: Path
) -> None:
    """A sidecar on Redis with no `limelight worker` takes jobs that nothing will run: their
    status says so (submit, get, list, watch) and ``limelight_job_workers`` counts 0; once a
    worker consumes the queue, a queued job reads plain "queued" again; a worker that stops
    leaves at once, one that dies is forgotten when its announcement runs out (Redis's clock)."""
    settings = _settings(redis_clean, tmp_path, job_reclaim_idle_s=1.5)
    runner = JobRunner(tiny_model, test_registry(), settings)
    metrics = Metrics(CollectorRegistry())
    backend = RedisJobBackend(settings, metrics, runner=runner)
    backend.depth_interval_s = 0.1
    release = tmp_path / "release"
    params = {"release": str(release), "started": str(tmp_path / "started")}

    def workers() -> float:
        return _sample(metrics, "limelight_job_workers", {"backend": "redis"})

    await backend.start()
    try:
        first = await backend.submit(JobSpec(method="block", text="a", params=params))
        assert first.state is JobState.QUEUED and first.message == QUEUED_ALONE
        assert first.no_worker
        assert workers() == 0
        listed = await backend.list([JobState.QUEUED], 10)
        assert [(j.message, j.no_worker) for j in listed] == [(QUEUED_ALONE, True)]
        watching = backend.watch(first.id)
        assert isinstance(watching, AsyncGenerator)
        assert (await anext(watching)).no_worker

        worker = RedisWorker(settings, runner, name="w-present")
        with worker_thread(worker):
            try:
                assert (await wait_state(backend, first.id, {JobState.RUNNING})).attempts == 1
                await await_until(lambda: workers() == 1)
                second = await backend.submit(JobSpec(method="block", text="b", params=params))
                # One worker, busy with the first job (heartbeats announce it): the second
                # waits, and says so.
                assert (second.state, second.message) == (JobState.QUEUED, "queued")
                assert not second.no_worker
                # Still counted while its job outlasts an announcement (1.5 s) twice over.
                await asyncio.sleep(3.5)
                assert workers() == 1
                assert (await backend.get(second.id)).message == "queued"
            finally:  # a failure above must not leave the worker's job blocking its stop
                touch(release)
            assert (await wait_state(backend, second.id)).state is JobState.SUCCEEDED
        await watching.aclose()
        # A worker that stopped took its name off the set.
        await await_until(lambda: workers() == 0)

        # A worker that died without leaving stays counted until its announcement runs out.
        gone = RedisWorker(settings, runner, name="w-killed")
        gone._announce(due_only=False)
        await await_until(lambda: workers() == 1)
        third = await backend.submit(JobSpec(method="block", text="c", params=params))
        assert third.message == "queued"
        await await_until(lambda: workers() == 0)
        assert (await backend.get(third.id)).message == QUEUED_ALONE
        # The next announcement drops the one that ran out (sidecars only read).
        RedisWorker(settings, runner, name="w-next")._announce(due_only=False)
        assert redis.Redis.from_url(redis_clean).zrange("limelight:workers", 0, -1) == [b"w-next"]
    finally:
        await backend.stop(1)


@pytest.mark.asyncio
async def test_two_queues_on_one_database_keep_their_jobs_apart(
    tiny_model: LoadedModel, redis_clean: str, tmp_path: Path
) -> None:
    """Two models deployed on one Redis database, each with its own queue name: a worker takes
    only its own queue's jobs (the other's stay queued, saying no worker consumes them), and
    every key a queue writes begins with its name, so an ACL can keep each to its own."""
    runner = JobRunner(tiny_model, test_registry(), _settings(redis_clean, tmp_path))
    alpha_settings = _settings(redis_clean, tmp_path, jobs_queue="alpha")
    beta_settings = _settings(redis_clean, tmp_path, jobs_queue="beta")
    alpha = RedisJobBackend(alpha_settings, runner=runner)
    beta = RedisJobBackend(beta_settings, runner=runner)
    for backend in (alpha, beta):
        backend.depth_interval_s = 0.05
        await backend.start()
    try:
        on_alpha = await alpha.submit(JobSpec(method="steps", text="a", params={"steps": 2}))
        on_beta = await beta.submit(JobSpec(method="steps", text="b", params={"steps": 2}))
        with worker_thread(RedisWorker(alpha_settings, runner, name="w-alpha")):
            assert (await wait_state(alpha, on_alpha.id)).state is JobState.SUCCEEDED
            await asyncio.sleep(0.5)  # a worker of the wrong queue would have taken it by now
            waiting = await beta.get(on_beta.id)
            assert (waiting.state, waiting.message) == (JobState.QUEUED, QUEUED_ALONE)
        # Each queue lists and finds only its own jobs.
        assert [j.id for j in await alpha.list(None, 10)] == [on_alpha.id]
        with pytest.raises(NotFound):
            await beta.get(on_alpha.id)
        with worker_thread(RedisWorker(beta_settings, runner, name="w-beta")):
            assert (await wait_state(beta, on_beta.id)).state is JobState.SUCCEEDED
        listed: list[bytes] = redis.Redis.from_url(redis_clean).keys("*")  # type: ignore[assignment]
        keys = {k.decode() for k in listed}
        assert keys and all(k.startswith(("alpha:", "beta:")) for k in keys), keys
        assert {f"alpha:job:{on_alpha.id}", f"beta:job:{on_beta.id}"} <= keys
    finally:
        for backend in (alpha, beta):
            await backend.stop(1)


@pytest.mark.parametrize("name", ["", "a b", "jobs:x", "-lead", "x" * 65])
def test_a_queue_name_that_would_blur_its_keys_is_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="the queue name is 1 to 64"):
        Settings(cache_dir=tmp_path, jobs_queue=name)


def test_the_start_up_log_names_the_queue_never_its_password(tmp_path: Path) -> None:
    settings = _settings("redis://limelight:s3cret@redis:6379/0", tmp_path, jobs_queue="reviews")
    said = RedisJobBackend(settings).describe()
    assert "redis://***@redis:6379/0" in said and "'reviews'" in said
    assert "s3cret" not in said


def test_a_dead_workers_entry_behind_ten_busy_ones_is_reclaimed(
    tiny_model: LoadedModel, redis_clean: str, tmp_path: Path
) -> None:
    # XAUTOCLAIM looks at ten pending entries per call: a scan that always started at the
    # front never reached an entry behind ten older ones whose workers are alive and busy.
    settings = _settings(redis_clean, tmp_path, job_reclaim_idle_s=5.0)
    worker = RedisWorker(settings, JobRunner(tiny_model, test_registry(), settings), name="w")
    worker._ensure_group()
    client = redis.Redis.from_url(redis_clean, decode_responses=True)
    stream, group = "limelight:stream", "workers"
    for i in range(12):  # older entries, each held by a live worker (idle ~0 s)
        client.xadd(stream, {"job": f"busy-{i}"})
        client.xreadgroup(group, f"live-{i}", {stream: ">"}, count=1)
    dead = client.xadd(stream, {"job": "orphan"})
    client.xreadgroup(group, "dead", {stream: ">"}, count=1)
    client.xclaim(stream, group, "dead", 0, [dead], idle=60_000)  # its worker died a minute ago
    found = [worker._reclaim() for _ in range(3)]
    assert (dead, "orphan") in found
    assert client.xpending_range(stream, group, dead, dead, 1)[0]["consumer"] == "w"
    # The busy entries stay with their workers.
    owners = {p["consumer"] for p in client.xpending_range(stream, group, "-", "+", 20)}
    assert owners == {f"live-{i}" for i in range(12)} | {"w"}


@pytest.mark.asyncio
async def test_workers_that_do_not_announce_themselves_count_while_redis_sees_them(
    redis_queue: str, tmp_path: Path
) -> None:
    """Workers from before the announcements (a rolling update: new sidecars, old workers)
    consume the stream without writing to ``limelight:workers``: a consumer of the group that
    Redis saw within the reclaim time counts as a live worker (gauge, queued jobs), and a
    running job whose consumer still re-claims its entry is not "without a worker"; once the
    consumer is silent past the reclaim time, it no longer counts."""
    settings = _settings(redis_queue, tmp_path, job_reclaim_idle_s=2.0)
    metrics = Metrics(CollectorRegistry())
    backend = RedisJobBackend(settings, metrics)
    backend.depth_interval_s = 0.1
    url, options = connection(settings)
    old = redis.Redis.from_url(url, **options)  # an old worker's client
    claim = old.register_script(lua("claim"))
    keys = Keys(settings.jobs_queue)

    def workers() -> float:
        return _sample(metrics, "limelight_job_workers", {"backend": "redis"})

    await backend.start()
    try:
        running = await backend.submit(JobSpec(method="steps", text="a"))
        assert running.no_worker and workers() == 0  # nothing consumes the queue yet
        # What an old worker does: read the entry under its consumer name, claim the job.
        read: Any = old.xreadgroup(GROUP, "old-host-1", {keys.stream: ">"}, 1)
        [[_, [(entry, fields)]]] = read
        assert fields["job"] == running.id
        claim(
            keys=[keys.job(running.id), keys.depth, keys.stream],
            args=["old-host-1", repr(time.time()), 3, 60000, GROUP, entry, keys.idem(""),
                  keys.events(running.id), "token"],
        )  # fmt: skip
        queued = await backend.submit(JobSpec(method="steps", text="b"))

        def heartbeat() -> None:  # the old worker's: re-claim its own entry
            old.xclaim(keys.stream, GROUP, "old-host-1", 0, [entry], justid=True)

        async def seen_alive() -> bool:
            heartbeat()
            record, waiting = await backend.get(running.id), await backend.get(queued.id)
            assert record.state is JobState.RUNNING and waiting.state is JobState.QUEUED
            return not record.no_worker and waiting.message == "queued" and workers() == 1

        await await_until(seen_alive)
        listed = await backend.list(None, 10)
        assert [(j.id, j.no_worker) for j in listed] == [(queued.id, False), (running.id, False)]
        assert redis.Redis.from_url(url, **options).zcard(keys.workers) == 0  # never announced

        # Silent past the reclaim time: dead, as far as anyone can tell.
        async def gone() -> bool:
            record, waiting = await backend.get(running.id), await backend.get(queued.id)
            return record.no_worker and waiting.no_worker and workers() == 0

        await await_until(gone)
        record = await backend.get(running.id)
        assert record.message.endswith(f"; its worker is gone, and {NO_WORKER} to run it again")
        assert (await backend.get(queued.id)).message == QUEUED_ALONE
        # Its heartbeat back (a long pause, not a death): counted again.
        await await_until(seen_alive)
    finally:
        await backend.stop(1)
        old.close()
