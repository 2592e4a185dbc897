"""A Redis that answers but refuses (a wrong password, an ACL user without Limelight's keys), on
a real redis-server with ACL users: the worker does not crash and reload its model in a loop,
it logs one error saying what the user needs, reports not ready, and takes work as soon as an
operator fixes the user (``ACL SETUSER`` while it runs); the sidecar answers job calls
``UNAVAILABLE`` with the reason in its log (once, not once per call), never in the reply."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers import await_until, served_sidecar, test_registry, wait_serving, wait_state
from prometheus_client import CollectorRegistry

from limelight.core.jobs import JobRecord, JobSpec, JobState
from limelight.errors import InvalidArgument, Unavailable
from limelight.jobs.redis_backend import RedisJobBackend
from limelight.jobs.redis_worker import RedisWorker
from limelight.jobs.runner import JobRunner
from limelight.metrics import Metrics
from limelight.models.loaded import LoadedModel
from limelight.settings import Settings
from tests.conftest import REDIS_ACL, REDIS_ACL_NARROW, RedisAcl

PASSWORD = "pw-never-shown"
README = Path(__file__).resolve().parents[2] / "README.md"
WITHOUT_KEYS = "~other:* &* +@all"
"""An ACL user that may connect and run every command, on keys Limelight does not use."""


def test_the_readme_grants_the_acls_the_suite_runs_as() -> None:
    """The README's two ``ACL SETUSER`` lines are the rules the job tests' users have."""
    given = [
        line.removeprefix("ACL SETUSER limelight on >PASSWORD ")
        for line in README.read_text().splitlines()
        if line.startswith("ACL SETUSER limelight on >PASSWORD ")
    ]
    assert given == [REDIS_ACL, REDIS_ACL_NARROW]


@contextmanager
def acl_user(acl: RedisAcl, rules: str) -> Iterator[tuple[str, redis.Redis]]:
    """A fresh ACL user with ``rules``: its queue URL and an admin client to change it."""
    admin = redis.Redis.from_url(acl.admin_url)
    admin.flushall()
    name = f"user-{uuid.uuid4().hex[:8]}"
    admin.execute_command("ACL", "SETUSER", name, "on", f">{PASSWORD}", *rules.split())
    url = acl.admin_url.replace("default:admin-secret", f"{name}:{PASSWORD}")
    try:
        yield url, admin
    finally:
        admin.acl_deluser(name)
        admin.close()


def set_rules(admin: redis.Redis, url: str, rules: str) -> None:
    """Replace the keys and channels of ``url``'s user by ``rules`` (as an operator would)."""
    name = url.split("//", 1)[1].split(":", 1)[0]
    admin.execute_command("ACL", "SETUSER", name, "resetkeys", "resetchannels", *rules.split())


@contextlib.asynccontextmanager
async def worker_and_sidecar(
    model: LoadedModel,
    url: str,
    tmp_path: Path,
    name: str,
    *,
    reclaim_idle_s: float = 30.0,
    **settings_: Any,
) -> AsyncIterator[tuple[RedisWorker, threading.Thread, RedisJobBackend]]:
    """A worker running in a thread (asking again 0.1 s after a refusal) and a sidecar's job
    backend on ``url``, not started (it would refuse to while Redis refuses); both stopped at
    the end."""
    settings = Settings(
        cache_dir=tmp_path, jobs=url, job_reclaim_idle_s=reclaim_idle_s, **settings_
    )
    runner = JobRunner(model, test_registry(), settings)
    worker = RedisWorker(settings, runner, name=name)
    worker.refused_retry_s = 0.1
    thread = threading.Thread(target=worker.run, daemon=True)
    backend = RedisJobBackend(settings, runner=runner)
    thread.start()
    try:
        yield worker, thread, backend
    finally:
        worker.request_stop()
        thread.join()
        await backend.stop(1.0)


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.asyncio
async def test_a_refused_worker_waits_says_why_and_works_once_the_user_is_fixed(
    tiny_model: LoadedModel, redis_acl: RedisAcl, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with acl_user(redis_acl, WITHOUT_KEYS) as (url, admin):
        async with worker_and_sidecar(tiny_model, url, tmp_path, "w-refused") as (
            worker,
            thread,
            backend,
        ):
            await await_until(lambda: errors(caplog))
            assert thread.is_alive() and not worker.ready
            (error,) = errors(caplog)
            assert REDIS_ACL in error and PASSWORD not in caplog.text

            set_rules(admin, url, REDIS_ACL)  # the operator grants the README's ACL
            await await_until(lambda: worker.ready)
            await backend.start()
            job = await backend.submit(JobSpec(method="steps", text="a witty film"))
            final = await asyncio.wait_for(wait_state(backend, job.id), 120)  # a hang guard
            assert final.state is JobState.SUCCEEDED

            # Revoked while it runs: not ready again, one more error, back once granted.
            set_rules(admin, url, WITHOUT_KEYS)
            await await_until(lambda: not worker.ready)
            await asyncio.sleep(0.5)  # several refusals: still one error for this outage
            assert len(errors(caplog)) == 2 and thread.is_alive()
            set_rules(admin, url, REDIS_ACL)
            await await_until(lambda: worker.ready)
            assert worker.outages == 1  # the first refusal came before it was ever ready


@pytest.mark.asyncio
async def test_a_refused_sidecar_answers_unavailable_and_logs_the_reason_once(
    redis_acl: RedisAcl, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with acl_user(redis_acl, WITHOUT_KEYS) as (url, admin):
        backend = RedisJobBackend(Settings(cache_dir=tmp_path, jobs=url))
        with pytest.raises(Unavailable) as at_start:
            await backend.start()
        # Startup errors go to the operator: where, and what the user needs; no password.
        assert REDIS_ACL in at_start.value.message and "redis://***@" in at_start.value.message
        assert PASSWORD not in at_start.value.message

        set_rules(admin, url, REDIS_ACL)
        await backend.start()
        try:
            job = await backend.submit(JobSpec(method="steps", text="a witty film"))
            set_rules(admin, url, WITHOUT_KEYS)
            caplog.clear()
            for call in (backend.submit(JobSpec(method="steps", text="x")), backend.get(job.id)):
                with pytest.raises(Unavailable) as refused:
                    await call
                # Clients learn that the queue refused, not the ACL or the address.
                assert "refused" in refused.value.message
                assert "~" not in refused.value.message and "redis://" not in refused.value.message
            with pytest.raises(Unavailable):
                async for _ in backend.watch(job.id):
                    pass
            (error,) = errors(caplog)  # one line for the three refusals
            assert REDIS_ACL in error and PASSWORD not in caplog.text

            set_rules(admin, url, REDIS_ACL)
            assert (await backend.get(job.id)).state is JobState.QUEUED
        finally:
            await backend.stop(1.0)


@pytest.mark.asyncio
async def test_a_job_running_through_a_refusal_finishes_and_logs_it_once(
    tiny_model: LoadedModel, redis_acl: RedisAcl, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The ACL revoked while a job runs: the job keeps computing, its heartbeats fail quietly
    (one line, not one per beat), and its outcome is written once the user is fixed."""
    with acl_user(redis_acl, REDIS_ACL) as (url, admin):
        # Heartbeats every 0.1 s; one worker, so nobody reclaims its job meanwhile.
        async with worker_and_sidecar(
            tiny_model, url, tmp_path, "w-revoked", reclaim_idle_s=0.3
        ) as (_worker, _thread, backend):
            await backend.start()
            release = tmp_path / "release"
            job = await backend.submit(
                JobSpec(method="block", text="a witty film", params={"release": str(release)})
            )
            await await_until(lambda: admin.hget(f"limelight:job:{job.id}", "state") == b"running")
            set_rules(admin, url, WITHOUT_KEYS)
            await await_until(lambda: caplog.text.count("heartbeat failed") == 1)
            await asyncio.sleep(1.0)  # about ten more beats, refused
            set_rules(admin, url, REDIS_ACL)
            release.write_text("go")

            final = await asyncio.wait_for(wait_state(backend, job.id), 120)  # a hang guard
            assert final.state is JobState.SUCCEEDED
            assert caplog.text.count("heartbeat failed") == 1


def queue_up(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("limelight_job_queue_up", {"backend": "redis"})


@pytest.mark.asyncio
async def test_a_sidecar_told_to_serve_through_a_refusal_at_start_takes_jobs_once_fixed(
    redis_acl: RedisAcl, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``jobs_refused_at_start=serve``: the job backend starts although Redis refuses its user,
    job calls are UNAVAILABLE (the reason logged once, however often it asks again), and it
    takes jobs as soon as the operator fixes the user, without a restart."""
    with acl_user(redis_acl, WITHOUT_KEYS) as (url, admin):
        metrics = Metrics(CollectorRegistry())
        settings = Settings(cache_dir=tmp_path, jobs=url, jobs_refused_at_start="serve")
        backend = RedisJobBackend(settings, metrics)
        backend.refused_retry_s = 0.1
        await backend.start()
        try:
            assert queue_up(metrics) == 0
            with pytest.raises(Unavailable) as refused:
                await backend.submit(JobSpec(method="steps", text="a witty film"))
            assert "refused" in refused.value.message and "~" not in refused.value.message
            await asyncio.sleep(0.5)  # asked again several times, refused each time
            (error,) = errors(caplog)
            assert REDIS_ACL in error and PASSWORD not in caplog.text

            set_rules(admin, url, REDIS_ACL)
            await await_until(lambda: queue_up(metrics) == 1)
            job = await backend.submit(JobSpec(method="steps", text="a witty film"))
            assert (await backend.get(job.id)).state is JobState.QUEUED
            assert len(errors(caplog)) == 1
        finally:
            await backend.stop(1.0)


@pytest.mark.parametrize("at_start", ["stop", "serve"])
def test_limelight_serve_against_a_queue_that_refuses_it_at_start(
    bert_tiny_dir: Path, redis_acl: RedisAcl, tmp_path: Path, at_start: str
) -> None:
    """By default ``limelight serve`` stops with one line naming what the queue's user lacks (a
    wrong Secret stalls the rollout); with ``LIMELIGHT_JOBS_REFUSED_AT_START=serve`` it serves
    inline explanations and answers job calls UNAVAILABLE, so a classifier sharing its pod
    stays Ready."""
    import grpc

    from limelight_client import Client
    from limelight_client.errors import LimelightError

    with (
        acl_user(redis_acl, WITHOUT_KEYS) as (url, _admin),
        served_sidecar(bert_tiny_dir, url, tmp_path, LIMELIGHT_JOBS_REFUSED_AT_START=at_start) as (
            server,
            port,
            log,
        ),
    ):
        if at_start == "stop":
            assert server.wait(300) != 0
            text = log.read_text()
            assert REDIS_ACL in text and "redis://***@" in text
            assert PASSWORD not in text and "Traceback" not in text
            return
        with Client(f"127.0.0.1:{port}", timeout=30, retries=0) as client:
            wait_serving(client, server, log)
            assert client.explain("a moving , funny film").tokens
            with pytest.raises(LimelightError) as refused:
                client.submit("dull and far too long", "integrated_gradients", steps=8)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert server.poll() is None
        text = log.read_text()
        assert text.count(REDIS_ACL) == 1 and PASSWORD not in text


@pytest.mark.asyncio
async def test_the_eviction_policy_is_checked_with_the_readmes_acl(
    redis_acl: RedisAcl, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The README's ACL grants INFO, so a sidecar running as that user warns about a policy
    that may evict queued jobs; a user without INFO is told that the policy goes unchecked."""
    caplog.set_level(logging.INFO, logger="limelight.jobs.redis_store")
    admin = redis.Redis.from_url(redis_acl.admin_url)
    admin.config_set("maxmemory-policy", "allkeys-lru")
    try:
        for rules, said in (
            (REDIS_ACL, "maxmemory-policy allkeys-lru"),
            (REDIS_ACL.replace(" +info", ""), "its eviction policy goes unchecked"),
        ):
            caplog.clear()
            with acl_user(redis_acl, rules) as (url, _):
                backend = RedisJobBackend(Settings(cache_dir=tmp_path, jobs=url))
                await backend.start()
                await backend.stop(1.0)
            assert caplog.text.count(said) == 1
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.close()


async def submit_as_clients_do(backend: RedisJobBackend, spec: JobSpec) -> JobRecord:
    """Submit, trying again after UNAVAILABLE as the SDK does (a connection Redis closed
    fails the call that finds it so)."""
    for _ in range(5):
        try:
            return await backend.submit(spec)
        except Unavailable as exc:
            if "refused" in exc.message:  # not a connection fault: trying again will not help
                raise
            await asyncio.sleep(0.1)
    return await backend.submit(spec)


@pytest.mark.asyncio
async def test_a_password_file_rotates_without_a_restart(
    tiny_model: LoadedModel, redis_acl: RedisAcl, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``jobs_password_file`` (a mounted Secret): every new connection reads the password, so
    after an operator rotates it in Redis and in the Secret, the sidecar and the workers
    reconnect with the new one (with the password in the address they were refused until
    someone restarted them)."""
    with acl_user(redis_acl, REDIS_ACL) as (url, admin):
        name = url.split("//", 1)[1].split(":", 1)[0]
        secret = tmp_path / "redis-password"
        secret.write_text(PASSWORD + "\n")  # as `kubectl create secret --from-file` may leave it
        address = url.replace(f":{PASSWORD}@", "@")
        async with worker_and_sidecar(
            tiny_model, address, tmp_path, "w-rotated", jobs_password_file=secret
        ) as (worker, _thread, backend):
            await backend.start()
            job = await backend.submit(JobSpec(method="steps", text="a witty film"))
            assert (await asyncio.wait_for(wait_state(backend, job.id), 120)).state.name == (
                "SUCCEEDED"
            )
            admin.execute_command("ACL", "SETUSER", name, "resetpass", ">rotated-pw")
            secret.write_text("rotated-pw\n")
            admin.execute_command("CLIENT", "KILL", "USER", name)  # every connection dials again
            job = await submit_as_clients_do(backend, JobSpec(method="steps", text="a dull film"))
            assert (await asyncio.wait_for(wait_state(backend, job.id), 120)).state.name == (
                "SUCCEEDED"
            )
            assert worker.ready and not errors(caplog)

            secret.unlink()  # a Secret not mounted: a refusal that says which file
            admin.execute_command("CLIENT", "KILL", "USER", name)
            with pytest.raises(Unavailable, match="refused"):
                await submit_as_clients_do(backend, JobSpec(method="steps", text="x"))
            assert any(str(secret) in e for e in errors(caplog))
            assert "rotated-pw" not in caplog.text


@pytest.mark.asyncio
async def test_a_password_in_the_address_and_in_a_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text("pw")
    settings = Settings(
        cache_dir=tmp_path, jobs="redis://u:pw@127.0.0.1:1/0", jobs_password_file=secret
    )
    with pytest.raises(InvalidArgument, match="keep one"):
        await RedisJobBackend(settings).start()
