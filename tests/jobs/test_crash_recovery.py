"""End to end: `limelight serve` with the SQLite journal survives kill -9 without losing jobs.

A real sidecar process on a loopback port serves the BERT-tiny demo model; jobs are submitted
over gRPC with the client SDK; the process is killed with SIGKILL while a job runs; a new process
on the same journal finishes every job, and results finished before the crash read back equal.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import wait_serving

from limelight.api.ports import free_port
from limelight.cli.main import main as cli
from limelight_client import Client
from limelight_client.types import JobState

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "a gripping , beautifully acted film",
    "the plot is a mess and the jokes fall flat",
    "not bad , but far too long",
    "one of the best movies of the year",
]


@contextmanager
def sidecar(model_dir: Path, db: Path, port: int, log: Path) -> Iterator[subprocess.Popen]:
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model_dir)]
    argv += ["--port", str(port), "--metrics-port", "0", "--jobs", "sqlite"]
    argv += ["--jobs-db", str(db), "--job-workers", "1", "--log-level", "WARNING"]
    # One intra-op thread: on a busy machine torch's default pool oversubscribes the cores and
    # every step slows down by an order of magnitude.
    env = {**os.environ, "LIMELIGHT_TORCH_THREADS": "1"}
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_kill_9_mid_job_then_restart(
    bert_tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db, log = tmp_path / "jobs.sqlite3", tmp_path / "sidecar.log"
    port = free_port()
    target = f"127.0.0.1:{port}"
    slow: dict[str, Any] = {"steps": 256, "batch_size": 1}  # 256 checkpoints: easy to catch
    fast: dict[str, Any] = {"steps": 8}

    with sidecar(bert_tiny_dir, db, port, log) as proc, Client(target, timeout=30) as client:
        wait_serving(client, proc, log)
        done_job = client.submit(TEXTS[0], "integrated_gradients", steps=8)
        before = done_job.result(timeout=300)
        ids = [
            client.submit(t, "integrated_gradients", **(slow if i == 0 else fast)).id
            for i, t in enumerate(TEXTS[1:])
        ]
        first = client.job(ids[0])
        for info in first.watch(timeout=300):
            if info.state == JobState.RUNNING and info.progress > 0:
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    journal = dict(sqlite3.connect(db).execute("SELECT id, state FROM jobs").fetchall())
    assert journal[done_job.id] == "succeeded"
    assert journal[ids[0]] == "running"  # interrupted mid-job
    assert [journal[i] for i in ids[1:]] == ["queued", "queued"]

    with sidecar(bert_tiny_dir, db, port, log) as proc, Client(target, timeout=30) as client:
        wait_serving(client, proc, log)
        after = client.job(done_job.id).result(timeout=60)
        assert after.tokens == before.tokens
        np.testing.assert_array_equal(after.scores, before.scores)
        results = [client.job(i).result(timeout=600) for i in ids]
        infos = [client.job(i).info for i in ids]
        assert [i.state for i in infos] == [JobState.SUCCEEDED] * 3
        assert [i.attempts for i in infos] == [2, 1, 1]
        for text, result in zip(TEXTS[1:], results, strict=True):
            words = [t for t in result.tokens if not t.special]
            assert [text[t.start : t.end].lower() for t in words] == [
                t.text.removeprefix("##") for t in words
            ]
            assert len(result.scores) == len(result.tokens)
            assert np.isfinite(result.scores).all()
        listed = {j.id: j.state for j in client.jobs(limit=10)}
        assert listed == {i: JobState.SUCCEEDED for i in [done_job.id, *ids]}

        # The `limelight jobs` CLI against the same sidecar.
        capsys.readouterr()
        assert cli(["jobs", "list", "--target", target]) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split()[:4] == ["ID", "STATE", "MODEL", "METHOD"]
        assert {row.split()[0] for row in table[1:]} == {done_job.id, *ids}
        served = client.model()
        model = f"{served.name}@{served.version[:8]}"  # jobs survive the restart on one model
        assert all(
            row.split()[1:4] == ["succeeded", model, "integrated_gradients"] for row in table[1:]
        )
        assert cli(["jobs", "list", "--state", "failed", "--target", target]) == 0
        assert capsys.readouterr().out.strip() == "no jobs"
        assert cli(["jobs", "show", ids[0], "--target", target]) == 0
        page = capsys.readouterr().out
        assert "state      succeeded" in page and "attempts   2" in page
        assert re.search(r"^for \S+: ", page, re.M), page
        assert cli(["jobs", "show", "no-such-job", "--target", target]) == 1
        assert "NOT_FOUND" in capsys.readouterr().err
        running = client.submit(TEXTS[0], "integrated_gradients", **slow)
        assert cli(["jobs", "cancel", running.id, "--target", target]) == 0
        assert running.id in capsys.readouterr().out
        final = list(running.watch(timeout=600))[-1]
        assert final.state == JobState.CANCELLED


def test_jobs_of_another_model_are_failed_not_run_after_a_restart_on_a_new_model(
    bert_tiny_dir: Path, random_bert_dir: Path, tmp_path: Path
) -> None:
    """The journal outlives the model: a sidecar restarted on another model (the same cache,
    or a rollout) used to run the jobs queued for the old one with the new one and call them
    succeeded. They now fail, saying which model they were for."""
    db, log = tmp_path / "jobs.sqlite3", tmp_path / "sidecar.log"
    port = free_port()
    target = f"127.0.0.1:{port}"
    with sidecar(bert_tiny_dir, db, port, log) as proc, Client(target, timeout=30) as client:
        wait_serving(client, proc, log)
        old_version = client.model().version
        slow = client.submit(TEXTS[1], "integrated_gradients", steps=256, batch_size=1)
        queued = client.submit(TEXTS[2], "integrated_gradients", steps=8)
        for info in slow.watch(timeout=300):
            if info.state == JobState.RUNNING and info.progress > 0:
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    with sidecar(random_bert_dir, db, port, log) as proc, Client(target, timeout=30) as client:
        wait_serving(client, proc, log)
        new_version = client.model().version
        assert new_version != old_version
        for job_id in (slow.id, queued.id):
            final = list(client.job(job_id).watch(timeout=300))[-1]
            assert final.state == JobState.FAILED
            assert f"submitted to model {bert_tiny_dir.name} version {old_version}" in final.error
            assert f"version {new_version} is served" in final.error
        # A job submitted to the new model runs on it.
        fresh = client.submit(TEXTS[0], "integrated_gradients", steps=8).result(timeout=300)
        assert fresh.model_version == new_version
