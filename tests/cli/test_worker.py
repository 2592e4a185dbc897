"""`limelight worker`: a queue that refuses it stops it at start with one line (before any
worker process loads the model), and a worker process that keeps dying is restarted after
growing pauses, not in a tight loop."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from limelight.cli import worker as worker_cli
from limelight.cli.main import EXIT_FAILURE, EXIT_USAGE
from tests.conftest import REDIS_ACL, RedisAcl


def limelight_worker(jobs_url: str) -> subprocess.CompletedProcess[str]:
    # The address from the environment, as from a Kubernetes Secret.
    env = {**os.environ, "LIMELIGHT_JOBS": jobs_url}
    argv = [sys.executable, "-m", "limelight.cli.main", "worker", "--demo", "bert-tiny"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("jobs", ["sqlite", "off"])
def test_a_worker_without_a_redis_queue_says_so_in_one_line(jobs: str) -> None:
    out = limelight_worker(jobs)
    assert out.returncode == EXIT_USAGE, out.stderr
    (line,) = [line for line in out.stderr.splitlines() if line.strip()]
    assert line.startswith(
        f"limelight worker: error: workers take their jobs from a Redis queue, not {jobs!r}"
    )
    assert "LIMELIGHT_JOBS" in line


@pytest.mark.parametrize("refusal", ["wrong password", "no keys"])
def test_a_refusing_queue_stops_the_worker_with_one_line(redis_acl: RedisAcl, refusal: str) -> None:
    admin = redis.Redis.from_url(redis_acl.admin_url)
    admin.execute_command("ACL", "SETUSER", "no-keys", "on", ">s3cret", "~other:*", "+@all")
    url = redis_acl.url
    if refusal == "wrong password":
        url = url.replace(":s3cret@", ":not-the-password@")
    else:
        url = url.replace("limelight:s3cret@", "no-keys:s3cret@")
    out = limelight_worker(url)
    assert out.returncode == EXIT_FAILURE, out.stderr
    assert "Traceback" not in out.stderr and "started worker process" not in out.stderr
    (line,) = [line for line in out.stderr.splitlines() if line.strip()]
    assert line.startswith("limelight worker: error: the job queue at redis://***@127.0.0.1:")
    assert "s3cret" not in line and "not-the-password" not in line
    if refusal == "wrong password":
        assert "check the user and password" in line
    else:
        assert REDIS_ACL in line


def test_restart_pauses_grow_while_a_worker_keeps_dying_young(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(worker_cli.time, "monotonic", lambda: now[0])
    backoff = worker_cli.RestartBackoff(2, healthy_s=60.0, max_s=30.0)

    def dies_after(i: int, lived: float) -> float:
        now[0] += lived
        delay = backoff.died(i)
        assert not backoff.ready(i) or delay == 0
        now[0] += delay
        assert backoff.ready(i)
        backoff.started(i)
        assert not backoff.ready(i)  # running again
        return delay

    assert [dies_after(0, 5.0) for _ in range(6)] == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert dies_after(0, 600.0) == 0.0  # it ran for a while: restarted at once, count reset
    assert dies_after(0, 5.0) == 2.0
    backoff.started(1)
    assert dies_after(1, 5.0) == 2.0  # each slot counts its own deaths
