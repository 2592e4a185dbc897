"""The ``kserve`` package's inference clients (gRPC, REST v2, REST v1) against a real sidecar.

The clients run in a child process (``kserve_probe.py``) because kserve and tritonclient register
the same protobuf names; the results are compared with ``Explain`` here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from limelight_client import Client
from tests.conftest import RunningSidecar

PROBE = Path(__file__).with_name("kserve_probe.py")
TEXTS = ["a gorgeous, witty, seductive movie", "the plot is thin and the acting is worse"]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("kserve") is None, reason="the kserve package is not installed"
)


def _assert_matches(outputs: dict[str, Any], expected: list[Any]) -> None:
    for row, e in enumerate(expected):
        n = outputs["num_tokens"][row]
        assert outputs["label"][row] == e.label
        assert outputs["probabilities"][row] == pytest.approx(
            [e.probabilities[k] for k in e.labels], abs=1e-5
        )
        assert outputs["tokens"][row][:n] == [t.text for t in e.tokens]
        assert [tuple(o) for o in outputs["token_offsets"][row][:n]] == [
            (t.start, t.end) for t in e.tokens
        ]
        assert outputs["attributions"][row][:n] == pytest.approx(e.scores, rel=1e-4, abs=1e-5)


def test_kserve_clients_get_what_explain_gives(sidecar: RunningSidecar) -> None:
    assert sidecar.settings.model_dir is not None
    model = sidecar.settings.model_dir.name
    url = f"http://127.0.0.1:{sidecar.server.metrics_port}"
    run = subprocess.run(
        [sys.executable, str(PROBE), sidecar.target, url, model, *TEXTS],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    with Client(sidecar.target, timeout=30) as client:
        expected = [client.explain(t) for t in TEXTS]
        pair = client.explain("a man sleeps", text_pair="a person rests", target="rotten")

    grpc_report, rest = report["grpc"], report["rest"]
    assert grpc_report["live"] and grpc_report["ready"] and grpc_report["model_ready"]
    _assert_matches(grpc_report["infer"], expected)
    assert grpc_report["pair"]["target_label"] == ["rotten"]
    n = len(pair.tokens)
    assert grpc_report["pair"]["attributions"][0][:n] == pytest.approx(
        pair.scores, rel=1e-4, abs=1e-5
    )
    assert grpc_report["errors"] == {
        "unknown_model": "NOT_FOUND",
        "wrong_datatype": "INVALID_ARGUMENT",
        "missing_input": "INVALID_ARGUMENT",
    }

    assert rest["live"] and rest["ready"] and rest["model_ready"]
    _assert_matches(rest["infer_json"], expected)
    _assert_matches(rest["infer_binary"], expected)
    assert rest["bad_status"] == 400
    # The server's message reaches the user (kserve reads it under application/json only).
    assert "unknown input 'nope'" in rest["bad_message"]
    assert [p["label"] for p in rest["v1_predict"]["predictions"]] == [e.label for e in expected]
    explained = rest["v1_explain"]["explanations"]
    for got, e in zip(explained, expected, strict=True):
        assert [t["text"] for t in got["tokens"]] == [t.text for t in e.tokens]
        assert [t["score"] for t in got["tokens"]] == pytest.approx(e.scores, rel=1e-4, abs=1e-5)
    assert rest["v1_unknown_status"] == 404
    assert "unknown model 'no-such-model'" in rest["v1_unknown_message"]
