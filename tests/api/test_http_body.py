"""Broken HTTP requests are the client's mistake: a 4xx with a JSON error, never a 500 with a
traceback in the log, and the port keeps serving (the OIP v2 and KServe v1 routes, the viewer's
API; a real sidecar, raw requests so that headers and bodies can be anything)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from limelight.api.ports import free_port
from limelight.settings import Settings
from tests.conftest import SidecarThread, cache_dir

TOKEN = "body-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GOOD = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["fine"]}]}


def send(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Mapping[str, str | bytes] | None = None,
) -> tuple[int, http.client.HTTPResponse, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest(method, path)
        all_headers: dict[str, str | bytes] = {
            "Content-Type": "application/json",
            **(headers or {}),
        }
        if body is not None:
            all_headers["Content-Length"] = str(len(body))
        for key, value in all_headers.items():
            conn.putheader(key, value)  # type: ignore[arg-type]  # bytes values go out raw
        conn.endheaders(body)
        response = conn.getresponse()
        payload = json.loads(response.read() or b"{}")
        return response.status, response, payload
    finally:
        conn.close()


@pytest.fixture(scope="module")
def port(bert_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """One sidecar for the module (with a bearer token: auth runs before anything else)."""
    handle = SidecarThread(
        Settings(
            model_dir=bert_tiny_dir,
            auth_token=TOKEN,
            port=0,
            metrics_port=free_port(),
            jobs_db=tmp_path_factory.mktemp("jobs") / "jobs.sqlite3",
            cache_dir=cache_dir(),
        )
    )
    side = handle.start()
    yield side.server.metrics_port
    handle.stop()


def v2(model: str = "") -> str:
    return f"/v2/models/{model or 'M'}/infer"


# (what, method, path, body, headers, status, words in the error)
CASES: list[tuple[str, str, str, bytes | None, Mapping[str, str | bytes], int, str]] = [
    (
        "an Authorization header that is not UTF-8",
        "GET",
        "/v1/models",
        None,
        {"Authorization": b"Bearer \xff"},
        401,
        "bearer token",
    ),
    (
        "a bare 'Bearer' with no token",
        "GET",
        "/v1/models",
        None,
        {"Authorization": "Bearer"},
        401,
        "bearer token",
    ),
    (
        "a binary-header length that is a digit but no number",
        "POST",
        v2(),
        json.dumps(GOOD).encode(),
        {**AUTH, "Inference-Header-Content-Length": "\u00b2".encode()},
        400,
        "Inference-Header-Content-Length",
    ),
    (
        "half a surrogate pair in v2 BYTES data",
        "POST",
        v2(),
        b'{"inputs":[{"name":"text","shape":[1],"datatype":"BYTES","data":["\\ud800"]}]}',
        AUTH,
        400,
        "not valid Unicode",
    ),
    (
        "half a surrogate pair in a KServe v1 instance",
        "POST",
        "/v1/models/M:predict",
        b'{"instances":["a \\ud800 b"]}',
        AUTH,
        400,
        "lone surrogate (U+D800) at character 2",
    ),
    (
        "half a surrogate pair in the viewer's text",
        "POST",
        "/viewer/api/explain",
        b'{"text":"a \\udfff b"}',
        AUTH,
        400,
        "lone surrogate (U+DFFF)",
    ),
    (
        "an output's parameters that are not an object",
        "POST",
        v2(),
        json.dumps({**GOOD, "outputs": [{"name": "label", "parameters": "x"}]}).encode(),
        AUTH,
        400,
        "'parameters' must be an object",
    ),
    (
        "JSON nested too deep (v2)",
        "POST",
        v2(),
        b"[" * 100_000 + b"]" * 100_000,
        AUTH,
        400,
        "nested too deep",
    ),
    (
        "JSON nested too deep (viewer)",
        "POST",
        "/viewer/api/explain",
        b"[" * 100_000 + b"]" * 100_000,
        AUTH,
        400,
        "nested too deep",
    ),
    (
        "Content-Encoding: gzip over a plain body",
        "POST",
        v2(),
        json.dumps(GOOD).encode(),
        {**AUTH, "Content-Encoding": "gzip"},
        400,
        "could not be read",
    ),
    (
        "a job timeout of 400 digits",
        "POST",
        "/viewer/api/jobs",
        json.dumps({"text": "hi", "method": "gradient", "timeout_s": 10**400}).encode(),
        AUTH,
        400,
        "'timeout_s' is out of range",
    ),
    (
        "a negative job timeout (named as this API names it)",
        "POST",
        "/viewer/api/jobs",
        json.dumps({"text": "hi", "method": "gradient", "timeout_s": -1}).encode(),
        AUTH,
        400,
        "'timeout_s' must be a finite number >= 0",
    ),
    (
        "a job timeout over the server's maximum (named as this API names it)",
        "POST",
        "/viewer/api/jobs",
        json.dumps({"text": "hi", "method": "gradient", "timeout_s": 10**9}).encode(),
        AUTH,
        400,
        "'timeout_s' 1e+09 exceeds this server's maximum",
    ),
    ("a POST to the metrics page", "POST", "/metrics", b"", {}, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize(
    ("what", "method", "path", "body", "headers", "status", "words"),
    CASES,
    ids=[case[0] for case in CASES],
)
def test_a_broken_request_is_the_clients_mistake(
    port: int,
    bert_tiny_dir: Path,
    caplog: pytest.LogCaptureFixture,
    what: str,
    method: str,
    path: str,
    body: bytes | None,
    headers: Mapping[str, str | bytes],
    status: int,
    words: str,
) -> None:
    path = path.replace("/M", f"/{bert_tiny_dir.name}")
    with caplog.at_level("ERROR"):
        got, response, error = send(port, method, path, body, headers)
    assert (got, words in error.get("error", "")) == (status, True), error
    assert not [r for r in caplog.records if r.levelname == "ERROR"], "logged as a fault"
    if status == 405:  # RFC 9110: a 405 says which methods the resource takes
        assert response.getheader("Allow") == "GET,HEAD"
    # The port keeps serving.
    good, _, answer = send(port, "POST", v2(bert_tiny_dir.name), json.dumps(GOOD).encode(), AUTH)
    assert good == 200 and answer["outputs"], answer


def test_a_body_that_cannot_be_read_closes_its_connection(port: int, bert_tiny_dir: Path) -> None:
    # After a body its Content-Encoding does not describe, the stream is in no state for a
    # next request: the answer says so, and a new connection is served.
    status, response, _ = send(
        port,
        "POST",
        v2(bert_tiny_dir.name),
        json.dumps(GOOD).encode(),
        {**AUTH, "Content-Encoding": "deflate"},
    )
    assert status == 400 and response.getheader("Connection") == "close"
    assert send(port, "POST", v2(bert_tiny_dir.name), json.dumps(GOOD).encode(), AUTH)[0] == 200
