"""The embedded SQLite backend: lifecycle, timeout, cancel, TTL, idempotency, bounds, resume."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    await_until,
    cancel_during_a_late_report,
    expired,
    reference_prediction,
    served_sidecar,
    test_registry,
    touch,
    wait_serving,
    wait_state,
)
from jobs_testing_methods import expected_scores
from prometheus_client import CollectorRegistry

from limelight.core.jobs import JobSpec, JobState
from limelight.core.types import TargetSpec
from limelight.errors import (
    DataLoss,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from limelight.jobs.priority import InlineGate
from limelight.jobs.runner import JobRunner
from limelight.jobs.sqlite_backend import SqliteJobBackend
from limelight.metrics import Metrics
from limelight.models.loaded import LoadedModel
from limelight.settings import Settings


def _settings(tmp_path: Path, **kw: Any) -> Settings:
    return Settings(cache_dir=tmp_path, jobs_db=tmp_path / "jobs.sqlite3", **kw)


def _backend(
    model: LoadedModel | None,
    settings: Settings,
    metrics: Metrics | None = None,
    gate: InlineGate | None = None,
    **kw: float,
) -> SqliteJobBackend:
    runner = JobRunner(model, test_registry(), settings) if model is not None else None
    return SqliteJobBackend(settings, runner, metrics, gate, **kw)


def _sample(metrics: Metrics, name: str, labels: dict[str, str]) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.mark.asyncio
async def test_lifecycle_result_and_metrics(tiny_model: LoadedModel, tmp_path: Path) -> None:
    metrics = Metrics(CollectorRegistry())
    text = "the film was great"
    ids, probs = reference_prediction(tiny_model, text)

    # The gate holds the job at its first checkpoint until the watch has seen it running: a
    # five-step job can otherwise finish before the watch's first read (then only SUCCEEDED).
    gate = InlineGate()
    backend = _backend(tiny_model, _settings(tmp_path), metrics, gate=gate, yield_timeout_s=600)
    await backend.start()
    try:
        gate.enter()
        job = await backend.submit(JobSpec(method="steps", text=text, params={"steps": 5}))
        assert job.state is JobState.QUEUED and job.attempts == 0
        seen = []
        async for record in backend.watch(job.id):
            seen.append(record)
            if record.state is JobState.RUNNING and gate.active:
                gate.exit()
        final = await backend.get(job.id)
        listed = await backend.list(None, 10)
    finally:
        await backend.stop(5)

    states = [r.state for r in seen]
    assert states[-1] is JobState.SUCCEEDED
    assert JobState.RUNNING in states
    progress = [r.progress for r in seen]
    assert progress == sorted(progress) and progress[-1] == 1.0
    assert final.attempts == 1 and final.error == ""
    assert final.started_at is not None and final.finished_at is not None
    assert final.created_at <= final.started_at <= final.finished_at
    predicted = int(np.argmax(probs))
    assert final.result is not None
    np.testing.assert_array_equal(final.result.attribution.scores, expected_scores(ids, predicted))
    np.testing.assert_allclose(final.result.probabilities, probs, rtol=1e-5, atol=1e-6)
    assert final.result.request_id == final.id
    assert [r.id for r in listed] == [final.id] and listed[0].result is None
    succeeded = {"method": "steps", "outcome": "succeeded"}
    assert _sample(metrics, "limelight_jobs_total", succeeded) == 1
    assert _sample(metrics, "limelight_job_duration_seconds_count", {"method": "steps"}) == 1
    assert _sample(metrics, "limelight_job_wait_seconds_count", {"method": "steps"}) == 1
    assert _sample(metrics, "limelight_job_queue_depth", {"method": "steps"}) == 0


@pytest.mark.asyncio
async def test_validation_before_queueing(tiny_model: LoadedModel, tmp_path: Path) -> None:
    backend = _backend(tiny_model, _settings(tmp_path))
    await backend.start()
    try:
        with pytest.raises(InvalidArgument):
            await backend.submit(JobSpec(method="steps", text="x", params={"steps": -1}))
        with pytest.raises(InvalidArgument):
            await backend.submit(JobSpec(method="steps", text="x", target=TargetSpec(label="nope")))
        assert await backend.list(None, 10) == []
        with pytest.raises(NotFound):
            await backend.get("missing")
        with pytest.raises(NotFound):
            await backend.cancel("missing")
        # Defaults are journalled with the job: what ran is what the record says.
        job = await backend.submit(JobSpec(method="steps", text="x"))
        assert job.spec.params == {"steps": 4, "sleep": 0.0}
    finally:
        await backend.stop(5)


@pytest.mark.asyncio
async def test_failures_are_reported_without_internals(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    metrics = Metrics(CollectorRegistry())

    backend = _backend(tiny_model, _settings(tmp_path), metrics)
    await backend.start()
    try:
        job = await backend.submit(JobSpec(method="broken", text="the plot"))
        final = await wait_state(backend, job.id)
        assert final.state is JobState.FAILED
        assert "internal error" in final.error and "secret" not in final.error
        assert final.result is None
    finally:
        await backend.stop(5)
    assert _sample(metrics, "limelight_jobs_total", {"method": "broken", "outcome": "failed"}) == 1


@pytest.mark.asyncio
async def test_timeout(tiny_model: LoadedModel, tmp_path: Path) -> None:
    backend = _backend(tiny_model, _settings(tmp_path, job_timeout_s=0.2))
    await backend.start()
    try:
        never = str(tmp_path / "never")
        job = await backend.submit(JobSpec(method="block", text="a", params={"release": never}))
        final = await wait_state(backend, job.id)
        assert final.state is JobState.FAILED
        assert final.error == "timed out after 0.2s"
        own = await backend.submit(
            JobSpec(method="block", text="a", params={"release": never}, timeout_s=0.1)
        )
        final = await wait_state(backend, own.id)
        assert final.error == "timed out after 0.1s"
    finally:
        await backend.stop(5)


@pytest.mark.asyncio
async def test_cancel_queued_and_running(tiny_model: LoadedModel, tmp_path: Path) -> None:
    metrics = Metrics(CollectorRegistry())
    started = tmp_path / "started"

    backend = _backend(tiny_model, _settings(tmp_path, job_workers=1), metrics)
    await backend.start()
    try:
        params = {"release": str(tmp_path / "never"), "started": str(started)}
        running = await backend.submit(JobSpec(method="block", text="a", params=params))
        await wait_state(backend, running.id, {JobState.RUNNING})
        queued = await backend.submit(JobSpec(method="steps", text="b"))
        assert _sample(metrics, "limelight_job_queue_depth", {"method": "steps"}) == 1
        cancelled = await backend.cancel(queued.id)
        assert cancelled.state is JobState.CANCELLED
        assert _sample(metrics, "limelight_job_queue_depth", {"method": "steps"}) == 0
        pending = await backend.cancel(running.id)
        assert pending.state is JobState.RUNNING and pending.message == "cancelling"
        final = await wait_state(backend, running.id)
        assert final.state is JobState.CANCELLED and final.result is None
        again = await backend.cancel(running.id)  # cancelling a finished job is a no-op
        assert again.state is JobState.CANCELLED
        # The worker is free again.
        after = await backend.submit(JobSpec(method="steps", text="c"))
        assert (await wait_state(backend, after.id)).state is JobState.SUCCEEDED
        assert (await backend.get(queued.id)).state is JobState.CANCELLED
    finally:
        await backend.stop(5)
    for method in ("steps", "block"):
        assert _sample(metrics, "limelight_jobs_total", {"method": method, "outcome": "cancelled"})


@pytest.mark.asyncio
async def test_result_ttl(tiny_model: LoadedModel, tmp_path: Path) -> None:
    # The watch must read the finished job before it expires: 1.5 s of slack for a busy machine.
    backend = _backend(tiny_model, _settings(tmp_path, job_result_ttl_s=1.5))
    await backend.start()
    try:
        job = await backend.submit(JobSpec(method="steps", text="a", idempotency_key="k"))
        final = await wait_state(backend, job.id)
        assert final.state is JobState.SUCCEEDED
        assert final.finished_at is not None
        await await_until(lambda: expired(backend, job.id))
        assert await backend.list(None, 10) == []
        # The expired job's idempotency key is free again: a new job.
        fresh = await backend.submit(JobSpec(method="steps", text="a", idempotency_key="k"))
        assert fresh.id != job.id
    finally:
        await backend.stop(5)
    rows = sqlite3.connect(tmp_path / "jobs.sqlite3").execute("SELECT COUNT(*) FROM jobs")
    assert rows.fetchone()[0] == 1  # the expired row was purged, not just hidden


@pytest.mark.asyncio
async def test_idempotency_and_bounded_queue(tmp_path: Path) -> None:
    # No runner: nothing runs, so the queue fills.
    backend = _backend(None, _settings(tmp_path, job_queue_max=2))
    await backend.start()
    try:
        a = await backend.submit(JobSpec(method="steps", text="a", idempotency_key="same"))
        a2 = await backend.submit(JobSpec(method="steps", text="a", idempotency_key="same"))
        assert a2.id == a.id
        b = await backend.submit(JobSpec(method="steps", text="b"))
        assert b.id != a.id
        with pytest.raises(ResourceExhausted, match="queue is full"):
            await backend.submit(JobSpec(method="steps", text="c"))
        # An existing key still answers while the queue is full.
        assert (await backend.submit(JobSpec("steps", "a", idempotency_key="same"))).id == a.id
        await backend.cancel(b.id)
        c = await backend.submit(JobSpec(method="steps", text="c"))
        listed = await backend.list([JobState.QUEUED], 10)
        assert [r.id for r in listed] == [c.id, a.id]  # newest first
        assert [r.id for r in await backend.list(None, 1)] == [c.id]
    finally:
        await backend.stop(1)


@pytest.mark.asyncio
async def test_priority_gate_holds_jobs(tiny_model: LoadedModel, tmp_path: Path) -> None:
    gate = InlineGate()

    backend = _backend(tiny_model, _settings(tmp_path), gate=gate, yield_timeout_s=600)
    await backend.start()
    try:
        gate.enter()  # an inline forward pass is running
        job = await backend.submit(JobSpec(method="steps", text="a", params={"steps": 3}))
        await await_until(lambda: gate.yields >= 1)
        held = await backend.get(job.id)
        # Blocked at its first checkpoint: running, but no step reported yet.
        assert held.state is JobState.RUNNING and held.progress == 0.0
        assert held.message == "running"
        gate.exit()
        assert (await wait_state(backend, job.id)).state is JobState.SUCCEEDED
    finally:
        await backend.stop(5)


@pytest.mark.asyncio
async def test_stop_requeues_and_restart_resumes(tiny_model: LoadedModel, tmp_path: Path) -> None:
    settings = _settings(tmp_path, job_workers=1)
    release = tmp_path / "release"
    started = tmp_path / "started"
    params = {"release": str(release), "started": str(started)}

    async def first() -> tuple[str, str]:
        backend = _backend(tiny_model, settings)
        await backend.start()
        running = await backend.submit(JobSpec(method="block", text="a", params=params))
        await wait_state(backend, running.id, {JobState.RUNNING})
        queued = await backend.submit(JobSpec(method="steps", text="b"))
        await backend.stop(grace_s=0.05)  # grace elapses: the running job is re-queued
        return running.id, queued.id

    async def second(ids: tuple[str, str]) -> list:
        backend = _backend(tiny_model, settings)
        await backend.start()
        try:
            touch(release)
            return [await wait_state(backend, i) for i in ids]
        finally:
            await backend.stop(5)

    ids = await first()
    states = dict(
        sqlite3.connect(settings.resolved_jobs_db()).execute("SELECT id, state FROM jobs")
    )
    assert states == {ids[0]: "queued", ids[1]: "queued"}
    done = await second(ids)
    assert [r.state for r in done] == [JobState.SUCCEEDED, JobState.SUCCEEDED]
    # A hand-back at shutdown is not a failed attempt.
    assert done[0].attempts == 1 and done[1].attempts == 1
    assert done[0].result is not None and done[1].result is not None


@pytest.mark.asyncio
async def test_a_cancel_that_meets_the_hand_back_at_shutdown_is_kept(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    # The cancel reaches the journal after the job's last look at its flag: the job hands
    # itself back at shutdown, and must not go back to the queue to run again at the next start.
    settings = _settings(tmp_path, job_workers=1)
    params = {"release": str(tmp_path / "never"), "started": str(tmp_path / "started")}
    backend = _backend(tiny_model, settings)
    await backend.start()
    job = await backend.submit(JobSpec(method="block", text="a", params=params))
    await wait_state(backend, job.id, {JobState.RUNNING})
    with sqlite3.connect(settings.resolved_jobs_db()) as db:  # the flag, not the live control
        db.execute("UPDATE jobs SET cancel_requested=1 WHERE id=?", (job.id,))
    await backend.stop(grace_s=0.05)
    state, message = (
        sqlite3.connect(settings.resolved_jobs_db())
        .execute("SELECT state, message FROM jobs WHERE id=?", (job.id,))
        .fetchone()
    )
    assert (state, message) == ("cancelled", "cancelled")


@pytest.mark.asyncio
async def test_job_interrupted_too_often_fails(tmp_path: Path) -> None:
    settings = _settings(tmp_path, job_max_attempts=2)

    async def submit() -> list[str]:
        backend = _backend(None, settings)
        await backend.start()
        try:
            return [(await backend.submit(JobSpec(method="steps", text=t))).id for t in "ab"]
        finally:
            await backend.stop(1)

    ids = await submit()
    # What the journal holds after the process died while running both, once and twice.
    with sqlite3.connect(settings.resolved_jobs_db()) as db:
        db.execute("UPDATE jobs SET state='running', attempts=1 WHERE id=?", (ids[0],))
        db.execute("UPDATE jobs SET state='running', attempts=2 WHERE id=?", (ids[1],))

    async def reopen() -> list:
        backend = _backend(None, settings)
        await backend.start()
        try:
            return [await backend.get(i) for i in ids]
        finally:
            await backend.stop(1)

    first, second = await reopen()
    assert (first.state, first.attempts) == (JobState.QUEUED, 1)
    assert second.state is JobState.FAILED
    assert second.error == "server died while running it 2 times"


_CRASH_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, {tests!r})
    from helpers import test_registry
    from limelight.core.jobs import JobSpec
    from limelight.jobs.runner import JobRunner
    from limelight.jobs.sqlite_backend import SqliteJobBackend
    from limelight.models.loaded import load_model
    from limelight.settings import Settings

    async def main():
        settings = Settings(cache_dir={tmp!r}, jobs_db={db!r}, job_workers=1)
        runner = JobRunner(load_model({model!r}), test_registry(), settings)
        backend = SqliteJobBackend(settings, runner)
        await backend.start()
        params = {{"release": {release!r}, "started": {started!r}}}
        for text in ("first", "second", "third"):
            job = await backend.submit(JobSpec(method="block", text=text, params=params))
            print(job.id, flush=True)
        await asyncio.Event().wait()  # until the test kills this process

    asyncio.run(main())
    """
)


@pytest.mark.asyncio
async def test_kill_9_loses_nothing(
    tiny_model: LoadedModel, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = _settings(tmp_path, job_workers=1)
    release, started = tmp_path / "release", tmp_path / "started"
    script = _CRASH_SCRIPT.format(
        tests=str(Path(__file__).parent),
        tmp=str(tmp_path),
        db=str(settings.resolved_jobs_db()),
        model=str(tiny_model_dir),
        release=str(release),
        started=str(started),
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ids = [proc.stdout.readline().strip() for _ in range(3)]
    await await_until(started.exists)  # the first job is running in the child
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    backend = _backend(tiny_model, settings)
    await backend.start()
    try:
        touch(release)
        done = [await wait_state(backend, i) for i in ids]
    finally:
        await backend.stop(5)
    assert [r.state for r in done] == [JobState.SUCCEEDED] * 3
    assert [r.attempts for r in done] == [2, 1, 1]
    assert [r.spec.text for r in done] == ["first", "second", "third"]


@pytest.mark.asyncio
async def test_a_report_racing_a_cancel_keeps_it_cancelling(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    backend = _backend(tiny_model, _settings(tmp_path, job_workers=1))
    await backend.start()
    try:
        await cancel_during_a_late_report(backend, tmp_path)
    finally:
        await backend.stop(5)


def fill_the_disk(backend: SqliteJobBackend) -> None:
    """SQLite may not grow the database (``max_page_count`` at its size) and its free pages are
    taken: a write that needs a page fails with SQLITE_FULL, as on a full disk."""
    with backend._lock:
        db = backend._db
        assert db is not None
        db.execute("CREATE TABLE IF NOT EXISTS filler (x BLOB)")
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count={pages}")
        with pytest.raises(sqlite3.OperationalError, match="full"):
            while True:
                db.execute("INSERT INTO filler VALUES (zeroblob(256))")


def make_room(backend: SqliteJobBackend) -> None:
    with backend._lock:
        assert backend._db is not None
        backend._db.execute("PRAGMA max_page_count=1073741823")


@pytest.mark.asyncio
async def test_a_full_disk_is_resource_exhausted_and_outcomes_wait_for_room(
    tiny_model: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Submitting to a full store is RESOURCE_EXHAUSTED (it was INTERNAL), logged once; a job
    that finishes meanwhile keeps its outcome until it can be written (the worker thread died
    before, and no job ran again until a restart)."""
    metrics = Metrics(CollectorRegistry())
    backend = _backend(tiny_model, _settings(tmp_path), metrics)

    def queue_up() -> float | None:
        return metrics.registry.get_sample_value("limelight_job_queue_up", {"backend": "sqlite"})

    await backend.start()
    try:
        assert queue_up() == 1
        release = tmp_path / "release"
        text = " ".join(["a witty and moving film"] * 30)  # a result larger than a page
        job = await backend.submit(
            JobSpec(method="block", text=text, params={"release": str(release)})
        )
        await wait_state(backend, job.id, {JobState.RUNNING})
        fill_the_disk(backend)
        for _ in range(3):
            with pytest.raises(ResourceExhausted, match="job store is full"):
                await backend.submit(JobSpec(method="steps", text=text * 10))  # > a page
        touch(release)  # the job ends; its outcome does not fit
        await asyncio.sleep(1.0)  # time to try
        assert (await backend.get(job.id)).state is JobState.RUNNING
        assert caplog.text.count("cannot be written") == 1  # one line for every refusal
        assert queue_up() == 0  # for LimelightJobQueueDown
        make_room(backend)
        final = await asyncio.wait_for(wait_state(backend, job.id), 60)  # a hang guard
        assert final.state is JobState.SUCCEEDED and final.result is not None
        assert queue_up() == 1
        # The same worker thread runs the next job.
        after = await backend.submit(JobSpec(method="steps", text="fun"))
        assert (await asyncio.wait_for(wait_state(backend, after.id), 60)).state.name == "SUCCEEDED"
    finally:
        await backend.stop(5)


def _damage(path: Path, how: str) -> None:
    """Make the journal at ``path`` unreadable the way a disk or a copy does."""
    data = bytearray(path.read_bytes())
    if how == "not a database":
        data[:] = np.random.default_rng(0).bytes(len(data))
    elif how == "truncated":
        del data[len(data) // 2 :]
    else:  # "damaged page": one page's bytes overwritten
        page = 4096
        data[2 * page + 100 : 3 * page - 100] = np.random.default_rng(0).bytes(page - 200)
    path.write_bytes(bytes(data))


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["not a database", "truncated", "damaged page"])
async def test_an_unreadable_journal_is_moved_aside_and_the_sidecar_starts(
    tiny_model: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A journal SQLite cannot read stopped the sidecar at every start (a crash loop that took
    the classifier's pod down with it). It is kept beside, under a name that says why, the
    sidecar starts an empty one, says so once, and runs jobs."""
    settings = _settings(tmp_path)
    journal = settings.resolved_jobs_db()
    old = _backend(None, settings)  # no workers: the jobs stay queued in the journal
    await old.start()
    for i in range(40):  # several pages of jobs
        await old.submit(JobSpec(method="steps", text=f"review {i} " + "a witty film " * 40))
    await old.stop(1.0)
    assert not journal.with_name(journal.name + "-wal").exists()  # checkpointed into the file
    _damage(journal, how)
    damaged = journal.read_bytes()

    backend = _backend(tiny_model, settings)
    await backend.start()
    try:
        (aside,) = tmp_path.glob("jobs.sqlite3.corrupt-*[0-9]Z")
        assert aside.read_bytes() == damaged  # kept as it was, for `sqlite3 … .recover`
        (error,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert "unreadable" in error and str(aside) in error
        assert await backend.list(None, 100) == []  # the jobs it held are lost, as logged
        job = await backend.submit(JobSpec(method="steps", text="fun"))
        assert (await asyncio.wait_for(wait_state(backend, job.id), 60)).state.name == "SUCCEEDED"
    finally:
        await backend.stop(5)


def test_a_journal_damaged_while_served_is_replaced_without_a_restart(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """A journal that goes bad under a running sidecar (a disk fault, a file overwritten) made
    every job call a bare INTERNAL, then DATA_LOSS until an operator restarted the sidecar. The
    call that finds it is DATA_LOSS with what happened; the journal is moved aside as a start
    does, said once in the log, and the next calls run jobs on an empty one; inline
    explanations never stop."""
    from limelight_client import Client
    from limelight_client import errors as client_errors

    journal = tmp_path / "jobs.sqlite3"
    env = {"LIMELIGHT_JOBS_DB": str(journal)}
    text = "a moving , witty and gorgeous film " * 12
    with served_sidecar(bert_tiny_dir, "sqlite", tmp_path, **env) as (server, port, log):
        with Client(f"127.0.0.1:{port}", timeout=60, retries=0) as client:
            wait_serving(client, server, log)
            jobs = [client.submit(text, "integrated_gradients", steps=4) for _ in range(12)]
            for job in jobs:  # every write done: nothing changes the file while it is damaged
                job.result(timeout=120)
            with sqlite3.connect(journal) as db:  # every page into the file, none in the WAL
                assert db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
            page = 4096
            assert journal.stat().st_size > 3 * page
            with journal.open("r+b") as f:  # keep the header and schema page, damage the rest
                f.seek(page)
                # 0xFF is no b-tree page type: every read of these pages is corrupt. (Random
                # bytes made a valid-looking page now and then: a lookup found no row instead.)
                f.write(b"\xff" * (journal.stat().st_size - page))
            damaged = journal.read_bytes()
            with sqlite3.connect(journal) as db:  # a commit elsewhere: the sidecar's page cache
                db.execute("PRAGMA user_version = 7")  # of the file is stale, it reads again
            # The first call to read the journal finds the damage: this one (DATA_LOSS), or a job
            # worker's poll for work just before it (CI saw it), and then this call learns where
            # its job went (NOT_FOUND naming the replacement).
            found = (client_errors.DataLoss, client_errors.NotFound)
            with pytest.raises(found, match="replaced by an empty one") as lost:
                client.job(jobs[0].id)
            assert lost.value.code is not None
            assert lost.value.code.name in ("DATA_LOSS", "NOT_FOUND")
            (aside,) = tmp_path.glob("jobs.sqlite3.corrupt-*[0-9]Z")
            assert aside.read_bytes()[page:] == damaged[page:]  # kept for `sqlite3 … .recover`
            with pytest.raises(client_errors.NotFound, match="replaced by an empty one"):
                client.job(jobs[1].id)  # lost with the journal, as the log says
            assert client.submit(text, "integrated_gradients", steps=4).result(timeout=120)
            assert client.explain("still serving").tokens
            assert server.poll() is None
        server.terminate()
        assert server.wait(60) == 0
    damaged_lines = [line for line in log.read_text().splitlines() if "went bad" in line]
    assert len(damaged_lines) == 1 and str(aside) in damaged_lines[0], damaged_lines


@pytest.mark.asyncio
async def test_a_damaged_journal_that_cannot_be_replaced_fails_job_calls_until_one_can(
    tiny_model: LoadedModel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The double fault: no new journal can be opened where the damaged one was moved aside
    from (here its opening is made to fail). Job calls are DATA_LOSS, logged once however many
    fail, and each tries again: once a journal opens, jobs run without a restart."""
    settings = _settings(tmp_path)
    backend = _backend(tiny_model, settings)
    await backend.start()
    try:
        for i in range(40):  # several pages of jobs
            await backend.submit(JobSpec(method="steps", text=f"review {i} " + "a film " * 80))
        await asyncio.wait_for(_drained(backend), 120)
        _damage_open_journal(settings.resolved_jobs_db())

        def refuse() -> sqlite3.Connection:
            raise sqlite3.OperationalError("unable to open database file")

        connect = backend._connect
        monkeypatch.setattr(backend, "_connect", refuse)
        for _ in range(3):
            with pytest.raises(DataLoss, match="no new one can be opened"):
                await backend.submit(JobSpec(method="steps", text="fun"))
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "no new journal can be opened" in errors[0], errors

        monkeypatch.setattr(backend, "_connect", connect)
        job = await backend.submit(JobSpec(method="steps", text="fun"))
        assert (await asyncio.wait_for(wait_state(backend, job.id), 60)).state.name == "SUCCEEDED"
        assert len(list(tmp_path.glob("jobs.sqlite3.corrupt-*[0-9]Z"))) == 1
    finally:
        await backend.stop(1)


@pytest.mark.asyncio
async def test_a_job_the_damaged_journal_held_says_where_it_went_whoever_found_the_damage(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    """Another call (a job worker polling for work) may find the damage first: asking for a job
    the damaged journal held then answered "unknown, or expired after its TTL"."""
    settings = _settings(tmp_path)
    backend = _backend(tiny_model, settings)
    await backend.start()
    try:
        held = [
            await backend.submit(JobSpec(method="steps", text=f"review {i} " + "a film " * 80))
            for i in range(40)
        ]
        await asyncio.wait_for(_drained(backend), 120)
        _damage_open_journal(settings.resolved_jobs_db())
        with pytest.raises(DataLoss, match="replaced by an empty one"):
            await backend.list(None, 10)  # as a worker's poll finds it
        with pytest.raises(NotFound, match=r"replaced by an empty one at \d{4}-\d\d-\d\d "):
            await backend.get(held[0].id)
    finally:
        await backend.stop(1)


async def _drained(backend: SqliteJobBackend) -> None:
    while any(j.state.name in ("QUEUED", "RUNNING") for j in await backend.list(None, 100)):
        await asyncio.sleep(0.05)


def _damage_open_journal(path: Path) -> None:
    """Overwrite every page after the first of a journal a backend holds open, and commit from
    another connection so that the backend reads the file again."""
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    page = 4096
    assert path.stat().st_size > 3 * page
    with path.open("r+b") as f:
        f.seek(page)
        f.write(np.random.default_rng(0).bytes(path.stat().st_size - page))
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 7")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB filesystem (tmpfs) to fill: mounting needs root (CI runs as root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path) -> Path:
    """Write to ``disk`` until no byte more fits; the file that took the room."""
    fill = disk / "fill"
    with fill.open("wb", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(b"x" * 512)
    return fill


@pytest.mark.asyncio
async def test_a_sidecar_that_starts_on_a_full_disk_serves_and_opens_the_journal_later(
    tiny_model: LoadedModel, small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A journal that cannot be opened for want of disk space (SQLite cannot even grow its
    shared-memory file) stopped the sidecar at start, and with it the classifier's pod. It
    starts without the journal: job calls are RESOURCE_EXHAUSTED, the queue is down on
    /metrics, one error says why; once there is room it opens the journal and runs the jobs
    that were queued in it."""
    settings = Settings(cache_dir=small_disk, jobs_db=small_disk / "jobs.sqlite3")
    before = _backend(None, settings)  # no workers: the jobs stay queued in the journal
    await before.start()
    queued = [await before.submit(JobSpec(method="steps", text=f"film {i}")) for i in range(5)]
    await before.stop(1.0)
    fill = _fill(small_disk)

    metrics = Metrics(CollectorRegistry())
    backend = _backend(tiny_model, settings, metrics, open_retry_s=0.1)
    await backend.start()  # raised "disk I/O error" before
    try:
        assert _sample(metrics, "limelight_job_queue_up", {"backend": "sqlite"}) == 0
        with pytest.raises(ResourceExhausted, match="cannot be opened"):
            await backend.submit(JobSpec(method="steps", text="now"))
        with pytest.raises(ResourceExhausted):
            await backend.get(queued[0].id)
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "disk is full" in errors[0], errors
        await asyncio.sleep(0.5)  # several tries, not one line each
        assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1

        fill.unlink()
        await await_until(
            lambda: _sample(metrics, "limelight_job_queue_up", {"backend": "sqlite"}) == 1
        )
        for job in queued:
            done = await asyncio.wait_for(wait_state(backend, job.id), 60)
            assert done.state is JobState.SUCCEEDED
        job = await backend.submit(JobSpec(method="steps", text="later"))
        assert (await asyncio.wait_for(wait_state(backend, job.id), 60)).state.name == "SUCCEEDED"
    finally:
        await backend.stop(5)


@pytest.mark.asyncio
async def test_a_sidecar_waiting_for_room_stops_at_once(
    tiny_model: LoadedModel, small_disk: Path
) -> None:
    settings = Settings(cache_dir=small_disk, jobs_db=small_disk / "jobs.sqlite3")
    before = _backend(None, settings)
    await before.start()
    await before.submit(JobSpec(method="steps", text="film"))
    await before.stop(1.0)
    _fill(small_disk)
    backend = _backend(tiny_model, settings, open_retry_s=30.0)
    await backend.start()
    await asyncio.wait_for(backend.stop(5), 10)  # does not wait out its next try
    with pytest.raises(Unavailable):
        await backend.get("any")


@pytest.mark.parametrize(("workers", "said"), [(0, "1 thread"), (1, "1 thread"), (3, "3 threads")])
def test_the_start_up_log_names_the_journal_and_its_threads(
    workers: int, said: str, tmp_path: Path
) -> None:
    settings = Settings(cache_dir=tmp_path, job_workers=workers)
    described = SqliteJobBackend(settings, None).describe()
    assert str(tmp_path / "jobs.sqlite3") in described and described.endswith(said)
