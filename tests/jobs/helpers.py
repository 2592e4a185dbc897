"""Shared helpers of the job tests (imported as a plain module: tests/jobs is on sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jobs_testing_methods import (
    BlockMethod,
    BrokenMethod,
    CrashMethod,
    LateReportMethod,
    StepMethod,
)

from limelight.api.ports import free_port
from limelight.core.jobs import JobBackend, JobRecord, JobSpec, JobState
from limelight.errors import NotFound
from limelight.jobs.redis_worker import RedisWorker
from limelight.methods.base import MethodRegistry
from limelight.methods.normxlogit import NormXLogit
from limelight.models.loaded import LoadedModel
from tests.waiting import WAIT_S as WAIT_S  # re-exported: the job tests import them from here
from tests.waiting import await_until as await_until
from tests.waiting import wait_until as wait_until


def test_registry() -> MethodRegistry:
    return MethodRegistry(
        {
            m.name: m
            for m in (
                StepMethod(),
                BlockMethod(),
                LateReportMethod(),
                CrashMethod(),
                BrokenMethod(),
                NormXLogit(),
            )
        }
    )


test_registry.__test__ = False  # type: ignore[attr-defined]


async def wait_state(
    backend: JobBackend, job_id: str, states: set[JobState] | None = None
) -> JobRecord:
    """Follow ``watch`` until the job reaches one of ``states`` (default: any terminal)."""
    async for record in backend.watch(job_id):
        if (states is None and record.state.terminal) or (states and record.state in states):
            return record
    return await backend.get(job_id)


async def expired(backend: JobBackend, job_id: str) -> bool:
    """True once ``backend`` no longer knows ``job_id`` (its result TTL has passed)."""
    try:
        await backend.get(job_id)
    except NotFound:
        return True
    return False


def reference_prediction(model: LoadedModel, text: str) -> tuple[list[int], np.ndarray]:
    """Token ids and softmax probabilities computed straight from the HF model."""
    enc = model.tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        logits = model.model(**enc).logits[0]
    return enc["input_ids"][0].tolist(), torch.softmax(logits, -1).numpy()


def wait_serving(client: Any, proc: subprocess.Popen[Any], log: Path | None = None) -> None:
    """Wait until the sidecar ``proc`` answers ``client`` (an SDK ``Client``); fail at once,
    with the end of its ``log``, if it exits first."""
    from limelight_client.errors import LimelightError

    def serving() -> bool:
        if proc.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None else ""
            raise AssertionError(f"sidecar exited early:\n{tail}")
        try:
            client.model(timeout=5)
        except LimelightError:
            return False
        return True

    wait_until(serving, interval=0.2, timeout=300)


@contextmanager
def served_sidecar(
    model_dir: Path, jobs: str, tmp_path: Path, **env: str
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """``limelight serve`` on ``model_dir`` with the job queue ``jobs`` (in the environment, as
    from a Kubernetes Secret) and extra ``LIMELIGHT_*`` ``env``: the process, its port and its
    log file; terminated at the end."""
    port = free_port()
    environ = {**os.environ, "LIMELIGHT_TORCH_THREADS": "1", "LIMELIGHT_JOBS": jobs, **env}
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model_dir)]
    argv += ["--port", str(port), "--metrics-port", "0", "--log-level", "WARNING"]
    log = tmp_path / "sidecar.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=environ, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc, port, log
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("go")


async def cancel_during_a_late_report(backend: JobBackend, tmp_path: Path) -> None:
    """Submit ``late_report``, cancel it while it runs, let it report progress it measured
    before it saw the flag, and check the record still says ``cancelling``; then it must end
    CANCELLED. A worker must be running the backend's jobs."""
    names = ("cancelled", "reported", "resume", "started")
    cancelled, reported, resume, started = (tmp_path / name for name in names)
    params = {name: str(tmp_path / name) for name in names}
    job = await backend.submit(JobSpec(method="late_report", text="a", params=params))
    try:
        await await_until(started.exists)
        assert (await backend.cancel(job.id)).message == "cancelling"
        cancelled.touch()
        await await_until(reported.exists)
        record = await backend.get(job.id)
        assert (record.state, record.message) == (JobState.RUNNING, "cancelling")
    finally:  # never leave the worker waiting, whatever failed
        cancelled.touch()
        resume.touch()
    assert (await wait_state(backend, job.id)).state is JobState.CANCELLED


@contextmanager
def worker_thread(worker: RedisWorker) -> Iterator[threading.Thread]:
    """``worker`` consuming on a thread of its own (yielded) for the ``with`` block, then
    stopped."""
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        worker.request_stop()
        thread.join()
