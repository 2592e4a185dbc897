"""The HTTP port against rude and cross-site clients, on a real sidecar over a socket: an
oversized binary-header length is a 400 (not a 500), a malformed request is one short WARNING
line without its bytes (not an ERROR with a traceback quoting a bearer token), a DNS-rebinding
``Host`` is refused where the port is bound to loopback, and a body a web page could post
without a CORS preflight (``text/plain``, a form) is refused with 415 while real clients —
Triton's HTTP clients, JSON posts, curl-style posts — keep working."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as thttp
import tritonclient.http.aio as thttp_aio
from prometheus_client.parser import text_string_to_metric_families

from limelight.api.ports import free_port
from limelight.settings import Settings
from tests.conftest import RunningSidecar, SidecarThread, cache_dir

SECRET = "SECRET-TOKEN-5f1d"
GOOD_V2 = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["fine"]}]}
GOOD_V1 = {"instances": ["a gorgeous, witty, seductive movie"]}
REBINDING_HOST = "rebind.evil.example"


@pytest.fixture(scope="module")
def side(bert_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSidecar]:
    """One sidecar for the module, bound to 127.0.0.1 (the default), no auth (the default)."""
    handle = SidecarThread(
        Settings(
            model_dir=bert_tiny_dir,
            port=0,
            metrics_port=free_port(),
            jobs_db=tmp_path_factory.mktemp("jobs") / "jobs.sqlite3",
            cache_dir=cache_dir(),
            drift_bootstrap_n=20,
            drift_min_count=20,  # at most the bootstrap: settings refuse a larger one
        )
    )
    running = handle.start()
    yield running
    handle.stop()


def send(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    host: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """One request; ``host`` replaces the ``Host`` header (127.0.0.1:port otherwise)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=host is not None, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", host)
        for key, value in (headers or {}).items():
            conn.putheader(key, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        raw = response.read()
        try:
            payload = json.loads(raw or b"{}")
        except ValueError:
            payload = {"raw": raw.decode(errors="replace")}
        return response.status, payload if isinstance(payload, dict) else {"list": payload}
    finally:
        conn.close()


def raw_exchange(port: int, data: bytes) -> bytes:
    """``data`` sent as is on a new connection; what comes back until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def request_counts(side: RunningSidecar, rpc: str) -> dict[str, float]:
    """``limelight_request_duration_seconds_count`` of ``rpc`` by status code."""
    with urllib.request.urlopen(side.metrics_url, timeout=30) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "limelight_request_duration_seconds_count"
                and sample.labels.get("rpc") == rpc
            ):
                counts[sample.labels["code"]] = sample.value
    return counts


def faults(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# --- an Inference-Header-Content-Length of thousands of digits ---------------------------------


def test_a_header_length_of_thousands_of_digits_is_a_400(
    side: RunningSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    port, name = side.server.metrics_port, side.settings.model_dir.name  # type: ignore[union-attr]
    body = json.dumps(GOOD_V2).encode()
    before = request_counts(side, "v2.ModelInfer")
    with caplog.at_level(logging.INFO):
        status, error = send(
            port,
            "POST",
            f"/v2/models/{name}/infer",
            body,
            {"Content-Type": "application/json", "Inference-Header-Content-Length": "9" * 5000},
        )
    assert status == 400, error
    assert "Inference-Header-Content-Length is larger than the request body" in error["error"]
    assert f"({len(body)} bytes)" in error["error"]
    assert not faults(caplog), [r.getMessage() for r in faults(caplog)]
    after = request_counts(side, "v2.ModelInfer")
    assert after.get("INVALID_ARGUMENT", 0) == before.get("INVALID_ARGUMENT", 0) + 1
    assert after.get("INTERNAL", 0) == before.get("INTERNAL", 0)
    # The same number written with thousands of leading zeros is still that number.
    status, answer = send(
        port,
        "POST",
        f"/v2/models/{name}/infer",
        body,
        {
            "Content-Type": "application/json",
            "Inference-Header-Content-Length": "0" * 5000 + str(len(body)),
        },
    )
    assert status == 200 and answer["outputs"], answer


# --- malformed HTTP ----------------------------------------------------------------------------


def test_a_malformed_request_logs_no_error_no_traceback_and_none_of_its_bytes(
    side: RunningSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    port = side.server.metrics_port
    host = f"Host: 127.0.0.1:{port}\r\n".encode()
    junk = [
        # a bearer token over aiohttp's 8,190-byte header line limit
        b"GET /v2 HTTP/1.1\r\n"
        + host
        + b"Authorization: Bearer "
        + SECRET.encode()
        + b"x" * 9000
        + b"\r\n\r\n",
        # too many headers
        b"GET /v2/health/live HTTP/1.1\r\n"
        + host
        + b"".join(f"X-{SECRET}-{i}: {SECRET}\r\n".encode() for i in range(200))
        + b"\r\n",
        # a Content-Length that is no length
        b"POST /v1/models/M:predict HTTP/1.1\r\n"
        + host
        + f"Content-Length: -1{SECRET}\r\n\r\n".encode(),
    ]
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        for _ in range(5):
            for data in junk:
                answer = raw_exchange(port, data)
                assert answer.split(b" ", 2)[1] == b"400", answer[:200]
        # The port keeps serving.
        status, live = send(port, "GET", "/v2/health/live")
    assert status == 200 and live == {"live": True}
    assert not faults(caplog), [r.getMessage()[:200] for r in faults(caplog)]
    for record in caplog.records:
        assert SECRET not in record.getMessage() and "xxxxxxxx" not in record.getMessage()
        assert record.exc_text is None and record.stack_info is None
    server_lines = [r for r in caplog.records if r.name == "aiohttp.server"]
    # At most one line a minute (none if an earlier test in this process had the minute's).
    assert len(server_lines) <= 1, [r.getMessage() for r in server_lines]
    for record in server_lines:
        assert record.levelno <= logging.WARNING
        assert record.getMessage().startswith("malformed HTTP request from 127.0.0.1 refused")


def test_malformed_request_lines_are_summarised() -> None:
    from aiohttp.http_exceptions import LineTooLong

    from limelight.api.http_server import MalformedRequests

    now = [1000.0]
    logs = MalformedRequests(clock=lambda: now[0])

    def record() -> logging.LogRecord:
        exc = LineTooLong(f"Bearer {SECRET}xxxx", "8190")
        return logging.LogRecord(
            "aiohttp.server",
            logging.ERROR,
            __file__,
            1,
            "Error handling request from %s",
            ("10.0.0.7",),
            (type(exc), exc, None),
        )

    first = record()
    assert logs.filter(first)
    assert first.levelno == logging.WARNING and first.exc_info is None
    assert first.getMessage() == "malformed HTTP request from 10.0.0.7 refused (400 LineTooLong)"
    now[0] += 59.0
    assert not any(logs.filter(record()) for _ in range(7))  # within the minute: left out
    now[0] += 1.0
    later = record()
    assert logs.filter(later)
    assert later.getMessage().endswith("(400 LineTooLong); 7 more since the last such line")
    # Anything else aiohttp logs is left as it is.
    other = logging.LogRecord(
        "aiohttp.server", logging.ERROR, __file__, 1, "Unhandled exception", (), None
    )
    assert logs.filter(other) and other.levelno == logging.ERROR


# --- Host: DNS rebinding -----------------------------------------------------------------------


def test_a_loopback_port_refuses_a_rebinding_host(side: RunningSidecar) -> None:
    port = side.server.metrics_port
    send(
        port,
        "POST",
        "/viewer/api/jobs",
        json.dumps({"text": "my private support ticket", "method": "random"}).encode(),
        {"Content-Type": "application/json"},
    )
    for path in ("/viewer/api/jobs", "/v1/models", "/metrics", "/viewer/"):
        status, error = send(port, "GET", path, host=f"{REBINDING_HOST}:{port}")
        assert status == 403, (path, error)
        assert "private support ticket" not in json.dumps(error)
        assert (
            "DNS rebinding" in error["error"] and "LIMELIGHT_HTTP_ALLOWED_HOSTS" in error["error"]
        )
        assert "localhost, an IP address (127.0.0.1, [::1]" in error["error"]
    # A kubelet probe or a Prometheus scrape by IP (no name to re-point) is served too.
    loopback_names = ["localhost", "LOCALHOST", f"localhost:{port}", f"127.0.0.1:{port}"]
    for host in [*loopback_names, f"[::1]:{port}", f"10.1.2.3:{port}"]:
        status, jobs = send(port, "GET", "/viewer/api/jobs", host=host)
        assert status == 200, (host, jobs)
    # HTTP/1.0 without a Host: no browser sends that.
    answer = raw_exchange(port, b"GET /v2/health/live HTTP/1.0\r\n\r\n")
    assert answer.split(b" ", 2)[1] == b"200", answer[:100]


def test_a_port_bound_to_every_address_serves_any_host(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    # In a container (0.0.0.0) the port is reached by a pod IP or a Service's name.
    running = start_sidecar(model_dir=bert_tiny_dir, host="0.0.0.0", jobs="off")
    port = running.server.metrics_port
    for host in (f"10.1.2.3:{port}", "limelight.default.svc.cluster.local", REBINDING_HOST):
        for path in ("/v2/health/ready", "/metrics", "/viewer/api/model"):
            status, answer = send(port, "GET", path, host=host)
            assert status == 200, (host, path, answer)
    # The body rule does not depend on where the port is bound.
    status, error = send(
        port,
        "POST",
        f"/v1/models/{bert_tiny_dir.name}:predict",
        json.dumps(GOOD_V1).encode(),
        {"Content-Type": "text/plain", "Origin": "http://evil.example"},
        host=REBINDING_HOST,
    )
    assert status == 415, error


def test_which_hosts_a_port_serves() -> None:
    from limelight.api.http_server import host_allowed, host_name

    assert host_name("[::1]:9464") == "::1" and host_name("Example.COM:80") == "example.com"
    loopback, everywhere = "127.0.0.1", "0.0.0.0"
    # An IP literal cannot be rebound (a page whose origin is an address was loaded from it):
    # kubelet probes and Prometheus use the pod IP.
    literals = ["127.0.0.1:1", "[::1]", "127.9.9.9", "10.0.0.1:9464", "[fd00::1]:80"]
    for bind in (loopback, "::1", "localhost", "127.0.0.2"):
        for host in ["localhost", "localhost:9464", "LocalHost", *literals, None]:
            assert host_allowed(host, bind, []), (host, bind)
        for host in (REBINDING_HOST, "localhost.evil.example", "", "[::1", "localhost:x"):
            assert not host_allowed(host, bind, []), (host, bind)
    for bind in (everywhere, "::", "10.0.0.5", ""):
        assert host_allowed(REBINDING_HOST, bind, []) and host_allowed("svc.local:80", bind, [])
    listed = ["Viewer.example.com", "proxy.example.com:8080"]
    for bind in (loopback, everywhere):
        assert host_allowed("viewer.example.com:9464", bind, listed)
        assert host_allowed("proxy.example.com", bind, listed)
        for host in ["localhost", *literals]:
            assert host_allowed(host, bind, listed), (host, bind)
        assert not host_allowed(REBINDING_HOST, bind, listed)
        assert host_allowed(REBINDING_HOST, bind, ["*"])


# --- bodies a web page could post without a preflight ------------------------------------------


def test_bodies_that_are_not_json_are_refused_with_415(side: RunningSidecar) -> None:
    port, name = side.server.metrics_port, side.settings.model_dir.name  # type: ignore[union-attr]
    routes = [
        ("v1.predict", f"/v1/models/{name}:predict", GOOD_V1),
        ("v1.explain", f"/v1/models/{name}:explain", GOOD_V1),
        ("v2.ModelInfer", f"/v2/models/{name}/infer", GOOD_V2),
        ("viewer.explain", "/viewer/api/explain", {"text": "a fine film"}),
        ("viewer.submit", "/viewer/api/jobs", {"text": "a fine film", "method": "random"}),
    ]
    browser = {"Origin": "http://evil.example"}
    for rpc, path, good in routes:
        body = json.dumps(good).encode()
        before = request_counts(side, rpc)
        refused = [
            {"Content-Type": "text/plain", **browser},
            {"Content-Type": "text/plain;charset=UTF-8"},  # what fetch() sends for a string
            {"Content-Type": "multipart/form-data; boundary=x", **browser},
            {"Content-Type": "application/x-www-form-urlencoded", **browser},
            browser,  # fetch() with an ArrayBuffer body: no Content-Type at all
        ]
        for headers in refused:
            status, error = send(port, "POST", path, body, headers)
            assert status == 415, (path, headers, error)
            assert "application/json" in error["error"] and "preflight" in error["error"]
        after = request_counts(side, rpc)
        assert after.get("INVALID_ARGUMENT", 0) == before.get("INVALID_ARGUMENT", 0) + len(refused)
        for headers in (
            {"Content-Type": "application/json"},
            {"Content-Type": "application/json; charset=utf-8", **browser},
        ):
            status, answer = send(port, "POST", path, body, headers)
            assert status in (200, 201), (path, headers, answer)


def test_real_clients_keep_working(side: RunningSidecar) -> None:
    port, name = side.server.metrics_port, side.settings.model_dir.name  # type: ignore[union-attr]
    # Triton's HTTP client sends no Content-Type at all, binary or JSON tensors.
    client = thttp.InferenceServerClient(url=f"127.0.0.1:{port}")
    try:
        for binary in (True, False):
            tensor = thttp.InferInput("text", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([b"a fine film"], dtype=object), binary)
            result = client.infer(name, [tensor])
            assert result.as_numpy("label")[0] in (b"rotten", b"fresh")
    finally:
        client.close()

    # Its aio client sends application/octet-stream.
    async def aio() -> Any:
        async_client = thttp_aio.InferenceServerClient(url=f"127.0.0.1:{port}")
        try:
            tensor = thttp_aio.InferInput("text", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([b"a fine film"], dtype=object), True)
            return (await async_client.infer(name, [tensor])).as_numpy("label")[0]
        finally:
            await async_client.close()

    assert asyncio.run(aio()) in (b"rotten", b"fresh")
    # curl -d and urllib send application/x-www-form-urlencoded unless told otherwise.
    for path, good in (
        (f"/v1/models/{name}:predict", GOOD_V1),
        (f"/v2/models/{name}/infer", GOOD_V2),
    ):
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", json.dumps(good).encode()
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
    # The viewer's own page: JSON, with its Origin, on its own host.
    status, answer = send(
        port,
        "POST",
        "/viewer/api/explain",
        json.dumps({"text": "a fine film"}).encode(),
        {"Content-Type": "application/json", "Origin": f"http://localhost:{port}"},
        host=f"localhost:{port}",
    )
    assert status == 200, answer
    # But the viewer takes nothing else, even from a client that is no browser.
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/viewer/api/explain", json.dumps({"text": "x"}).encode()
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 415


def test_a_body_that_does_not_arrive_in_time_is_refused_and_its_connection_closed(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """A client that announces a body and sends part of it held the buffer (up to 4 MiB) for
    as long as it kept the connection: 300 of them took 1.3 GB. Past ``http_body_timeout_s``
    it is a 400 and the connection closes; the port keeps serving."""
    handle = SidecarThread(
        Settings(
            model_dir=bert_tiny_dir,
            port=0,
            metrics_port=free_port(),
            jobs="off",
            cache_dir=cache_dir(),
            http_body_timeout_s=1.0,
        )
    )
    running = handle.start()
    try:
        port, name = running.server.metrics_port, bert_tiny_dir.name
        head = (
            f"POST /v1/models/{name}:explain HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        ).encode()
        answer = raw_exchange(port, head + b'{"instances": ["a witty')  # and nothing more
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        assert b"did not arrive within 1 s" in answer
        body = json.dumps(GOOD_V1).encode()
        json_type = {"Content-Type": "application/json"}
        assert send(port, "POST", f"/v1/models/{name}:explain", body, json_type)[0] == 200
    finally:
        handle.stop()


def test_the_grpc_port_limits_the_streams_of_one_connection(side: RunningSidecar) -> None:
    """HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS is announced: without it gRPC's defence against
    streams opened and reset in a loop (rapid reset) never engaged, and one such client
    starved every other."""
    port = int(side.target.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        data = b""
        while True:
            while len(data) < 9:
                chunk = sock.recv(65536)
                assert chunk, "the server closed the connection before its SETTINGS"
                data += chunk
            length, kind, flags = int.from_bytes(data[:3], "big"), data[3], data[4]
            while len(data) < 9 + length:
                data += sock.recv(65536)
            payload, data = data[9 : 9 + length], data[9 + length :]
            if kind == 4 and not flags & 1:  # the server's SETTINGS (not an ACK)
                break
    settings = {
        int.from_bytes(payload[i : i + 2], "big"): int.from_bytes(payload[i + 2 : i + 6], "big")
        for i in range(0, len(payload), 6)
    }
    assert settings.get(3) == Settings().grpc_max_concurrent_streams  # MAX_CONCURRENT_STREAMS
