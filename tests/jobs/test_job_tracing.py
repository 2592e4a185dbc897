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

import grpc
import pytest

from limelight import tracing
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
