"""Server paths are named, not spelled out, in what clients read (core.redaction); the
sidecar's log keeps them whole."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from limelight.core.redaction import PathRedactor
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.api.test_oip_http import call
from tests.conftest import RunningSidecar
from tests.test_reload import bare_copy
from tests.waiting import wait_until


def test_each_directory_is_named_the_longest_first(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    model = cache / "models" / "m-1"
    redact = PathRedactor({"<model dir>": model, "<cache dir>": cache, "<none>": None})
    assert redact(f"run `limelight distill --model {model}`") == (
        "run `limelight distill --model <model dir>`"
    )
    assert redact(f"no table in {cache}/lexicons/x") == "no table in <cache dir>/lexicons/x"
    # A longer name that merely starts like a known one is not that directory.
    assert redact(f"{model}-old and {cache}s") == f"<cache dir>/models/m-1-old and {cache}s"
    assert redact("") == "" and redact("nothing to hide") == "nothing to hide"


def test_a_resolved_path_is_named_too(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    redact = PathRedactor({"<model dir>": link})
    assert redact(f"{real}/config.json and {link}") == "<model dir>/config.json and <model dir>"


def test_clients_read_the_model_dir_named_on_every_port(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A method's reason (GetModel, its refusal on gRPC and HTTP) and a failed job's error
    spelled out the server's model directory to any client."""
    caplog.set_level(logging.INFO)
    model = bare_copy(bert_tiny_dir, tmp_path / "secret-layout" / "model")
    served = start_sidecar(
        model_dir=model,
        default_method="normxlogit",
        method_plugins=["tests.jobs.jobs_testing_methods:MissingFileMethod"],
    )
    secret = str(tmp_path / "secret-layout")
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(served.target))

    (distilled,) = [
        m for m in stub.GetModel(pb.GetModelRequest(), timeout=30).methods if m.name == "distilled"
    ]
    assert "limelight distill --model <model dir>" in distilled.unavailable_reason
    with pytest.raises(grpc.RpcError) as refused:
        stub.Explain(pb.ExplainRequest(text="a film", method="distilled"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "<model dir>" in (refused.value.details() or "")

    url = f"http://127.0.0.1:{served.server.metrics_port}/v2/models/{model.name}/infer"
    body = {
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a film"]}],
        "parameters": {"method": "distilled"},
    }
    status, error = call(url, body)
    assert status == 400 and "<model dir>" in error["error"]

    job = stub.SubmitJob(pb.SubmitJobRequest(text="a film", method="missing_file"), timeout=30)
    failed = wait_until(
        lambda: (
            (j := stub.GetJob(pb.GetJobRequest(id=job.id), timeout=30)).state == pb.JOB_STATE_FAILED
            and j
        )
    )
    assert failed.error == "no table at <model dir>/table.npy; build one"

    for shown in (distilled.unavailable_reason, refused.value.details(), error["error"]):
        assert secret not in (shown or "")
    # The operator's log has the whole path.
    assert any(secret in r.getMessage() for r in caplog.records)
