"""What a real `limelight worker` process exports on its metrics port: the job series and nothing
of the sidecar's (no model, batches, drift or readiness, which dashboards and alerts would read
as a sidecar's), in a format promtool accepts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers import await_until, wait_state
from prometheus_client.parser import text_string_to_metric_families

from limelight.api.ports import free_port
from limelight.core.jobs import JobSpec, JobState
from limelight.jobs.redis_backend import RedisJobBackend
from limelight.settings import Settings

HERE = Path(__file__).parent
ROOT = HERE.parent.parent

#: A worker's metric families (counters without ``_total``, as prometheus_client names them).
WORKER_FAMILIES = {
    "limelight_job_queue_up",
    "limelight_job_wait_seconds",
    "limelight_job_duration_seconds",
    "limelight_jobs",
}


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return str(response.read().decode())
    except OSError:  # not listening yet
        return ""


@pytest.mark.asyncio
async def test_a_worker_exports_the_job_series_only(
    tiny_model_dir: Path, redis_clean: str, tmp_path: Path
) -> None:
    port = free_port()  # the worker binds the port it is given and does not report it
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [environ.get("PYTHONPATH")])])
    environ["LIMELIGHT_TORCH_THREADS"] = "1"
    argv = [sys.executable, "-m", "limelight.cli.main", "worker", "--jobs", redis_clean]
    argv += ["--model", str(tiny_model_dir), "--workers", "1", "--cache-dir", str(tmp_path)]
    argv += ["--metrics-port", str(port), "--method", "jobs_testing_methods:StepMethod"]
    argv += ["--log-level", "WARNING"]
    worker = subprocess.Popen(argv, env=environ, cwd=ROOT)
    backend = RedisJobBackend(Settings(cache_dir=tmp_path, jobs=redis_clean))
    await backend.start()
    try:
        job = await backend.submit(JobSpec(method="steps", text="a good film", params={}))
        assert (await wait_state(backend, job.id)).state is JobState.SUCCEEDED

        def counted() -> str:
            text = _scrape(port)
            done = 'limelight_jobs_total{method="steps",outcome="succeeded"} 1.0'
            return text if done in text else ""

        exposition = await await_until(counted)
    finally:
        await backend.stop(5)
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()

    families = {f.name: f for f in text_string_to_metric_families(exposition)}
    # The text parser gives the counters' and histograms' _created samples families of their own.
    declared = {name for name in families if not name.endswith("_created")}
    assert declared == WORKER_FAMILIES  # e.g. no limelight_ready, _model_info, _drift_*
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in families["limelight_job_queue_up"].samples
    }
    assert samples == {("limelight_job_queue_up", (("backend", "redis"),)): 1.0}
    for name in ("limelight_job_wait_seconds", "limelight_job_duration_seconds"):
        counts = [s for s in families[name].samples if s.name == f"{name}_count"]
        assert [(s.labels, s.value) for s in counts] == [({"method": "steps"}, 1.0)], name
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH: `make sysdeps` (apt-get install prometheus)")
    check = subprocess.run(
        [promtool, "check", "metrics"], input=exposition.encode(), capture_output=True, check=False
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    assert check.stdout.strip() == b"", check.stdout.decode()
