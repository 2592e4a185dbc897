"""The trace context travels with a job through Redis to a `limelight worker` process: the job's
span, exported by the worker, is a child of the SubmitJob span exported by the sidecar."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from limelight import tracing
from limelight.core.jobs import JobSpec
from limelight.jobs.execution import StopReason
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar
from tests.otlp_receiver import running_receiver

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


def test_job_span_from_a_redis_worker_joins_the_submitting_trace(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    redis_clean: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with running_receiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        sidecar = start_sidecar(model_dir=bert_tiny_dir, jobs=redis_clean, job_workers=0)
        stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(sidecar.target))
        job = stub.SubmitJob(
            pb.SubmitJobRequest(method="random", text="a gorgeous movie"),
            metadata=(("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),),
            timeout=30,
        )
        environ = {**os.environ, "LIMELIGHT_TORCH_THREADS": "1"}
        argv = [sys.executable, "-m", "limelight.cli.main", "worker", "--jobs", redis_clean]
        argv += ["--model", str(bert_tiny_dir), "--workers", "1", "--cache-dir", str(tmp_path)]
        worker = subprocess.Popen([*argv, "--log-level", "WARNING"], env=environ)
        try:
            for update in stub.WatchJob(pb.GetJobRequest(id=job.id), timeout=300):
                if update.state == pb.JOB_STATE_SUCCEEDED:
                    break
                assert update.state in (pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING)
        finally:
            # SIGTERM: the worker stops after its job and flushes its exporter on the way out.
            worker.send_signal(signal.SIGTERM)
            worker.wait(120)
        assert tracing.flush()
        for _ in range(200):  # the worker's export may still be in flight
            if receiver.named("job random"):
                break
            threading.Event().wait(0.05)
    (submit,) = [
        s
        for s in receiver.named("limelight.v1.Explainer/SubmitJob")
        if s.trace_id.hex() == TRACE_ID
    ]
    (run,) = receiver.named("job random")
    # The sidecar runs no jobs (job_workers=0, Redis queue): this span came from the worker.
    assert run.trace_id.hex() == TRACE_ID and run.parent_span_id == submit.span_id


@pytest.mark.parametrize(
    ("reason", "outcome", "error"),
    [
        (StopReason.CANCELLED, "cancelled", False),
        (StopReason.TIMEOUT, "timed_out", True),
        (StopReason.RELEASE, "requeued", False),
    ],
)
def test_a_job_span_says_how_the_job_ended(
    reason: StopReason, outcome: str, error: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's cancel and a timeout both stopped the run with ``JobCancelled``, and both spans
    ended ERROR "JobCancelled: job stopped"; the span names the outcome, an error only when the
    job failed (a timeout included), with no exception event (stack trace, server paths)."""
    from limelight.jobs.execution import JobHooks, execute
    from limelight.methods.base import JobCancelled
    from limelight.settings import Settings

    class Runner:
        def redact(self, text: str) -> str:
            return text

        def run(self, spec: Any, job_id: str, report: Any, should_stop: Any, **_: Any) -> Any:
            assert should_stop()
            raise JobCancelled("job stopped")

    with running_receiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        assert tracing.setup_tracing()
        try:
            hooks = JobHooks(check=lambda: reason, write_progress=lambda *_: None, settle=bool)
            spec = JobSpec(method="random", text="a movie", trace_context={})
            settings = Settings(cache_dir=tmp_path, jobs="sqlite")
            execute(Runner(), settings, "job-1", spec, hooks)  # type: ignore[arg-type]
            assert tracing.flush()
        finally:
            tracing.shutdown_tracing()
    (span,) = receiver.named("job random")
    attributes = {a.key: a.value.string_value for a in span.attributes}
    assert attributes["limelight.job.outcome"] == outcome
    assert (span.status.code == span.status.STATUS_CODE_ERROR) == error
    assert "JobCancelled" not in span.status.message
    assert [e for e in span.events if e.name == "exception"] == []
