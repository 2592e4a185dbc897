"""``max_connection_age_s``: clients move to new connections (gRPC GOAWAY, HTTP
``Connection: close``) without failing a call, against a real sidecar on a socket."""

from __future__ import annotations

import concurrent.futures
import http.client
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from limelight.api.http_server import HttpServer
from limelight.metrics import Metrics
from limelight.settings import Settings
from limelight_client import Client
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar


def _client_ports(port: int) -> set[int]:
    """Local ports of this process's open TCP connections to ``port`` (the client ends)."""
    return {
        c.laddr.port
        for c in psutil.Process().connections("tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    }


def _port(target: str) -> int:
    return int(target.rsplit(":", 1)[1])


@pytest.mark.parametrize("age_s", [None, 0.3])
def test_a_plain_grpc_client_moves_to_new_connections_without_an_error(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, age_s: float | None
) -> None:
    running = start_sidecar(model_dir=bert_tiny_dir, jobs="off", max_connection_age_s=age_s)
    channel = grpc.insecure_channel(running.target)
    stub = explainer_pb2_grpc.ExplainerStub(channel)
    seen: set[int] = set()
    try:
        # Four threads calling back to back for about five connection ages: calls in progress
        # when the GOAWAY comes, and calls sent just as it comes, must all be answered. Each
        # makes at least six calls however slow a busy machine makes them (a count, not a
        # speed requirement).
        def call_for(seconds: float, at_least: int = 6) -> int:
            end, answered = time.monotonic() + seconds, 0
            while time.monotonic() < end or answered < at_least:
                reply = stub.Explain(pb.ExplainRequest(text="a fine, moving film"), timeout=30)
                assert reply.label
                answered += 1
                seen.update(_client_ports(_port(running.target)))
            return answered

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answered = sum(pool.map(call_for, [1.5] * 4))
    finally:
        channel.close()
    assert answered > 20
    if age_s is None:
        assert len(seen) == 1  # one connection for the whole run
    else:
        assert len(seen) >= 3  # a new one about every 0.3 s


def test_a_stream_cut_by_the_age_grace_is_opened_again_by_the_sdk(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    running = start_sidecar(
        model_dir=bert_tiny_dir,
        jobs="off",
        max_connection_age_s=0.3,
        max_connection_age_grace_s=0.2,
    )
    texts = [f"review number {i}: {'good' if i % 2 else 'dull'} film" for i in range(40)]

    def slowly() -> Iterator[str]:  # the stream outlives several connection ages
        for text in texts:
            time.sleep(0.04)
            yield text

    seen: set[int] = set()
    answers = []
    with Client(running.target, connections=1, timeout=30) as client:
        for answer in client.explain_many(slowly()):
            answers.append(answer)
            seen.update(_client_ports(_port(running.target)))
    assert [a.text for a in answers] == texts  # every text answered once, in order
    assert len(seen) >= 2  # the stream was cut under it and opened again elsewhere


def _keep_alive_answers(port: int, count: int, pause_s: float) -> list[str | None]:
    """``Connection`` header of ``count`` requests on one keep-alive connection (a new one
    whenever the server closes it)."""
    headers: list[str | None] = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        for _ in range(count):
            conn.request("GET", "/v2/health/live")
            response = conn.getresponse()
            response.read()
            headers.append(response.getheader("Connection"))
            if response.will_close:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            time.sleep(pause_s)
    finally:
        conn.close()
    return headers


@pytest.mark.parametrize("age_s", [None, 0.3])
def test_http_keep_alive_connections_are_closed_after_the_age(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, age_s: float | None
) -> None:
    running = start_sidecar(model_dir=bert_tiny_dir, jobs="off", max_connection_age_s=age_s)
    headers = _keep_alive_answers(running.server.metrics_port, count=20, pause_s=0.05)
    closes = sum(1 for h in headers if h is not None and h.lower() == "close")
    assert headers[0] != "close"
    if age_s is None:
        assert closes == 0
    else:
        assert 2 <= closes < 20  # about once per 0.3 s, not on every answer


@pytest.fixture
def http_not_ready() -> Iterator[int]:
    """The HTTP port of a sidecar whose model is not (or no longer) ready to serve."""
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    server = HttpServer(Settings(), Metrics(), lambda: None)
    port = loop.run_until_complete(server.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield port
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


def test_http_answers_close_the_connection_while_not_ready(http_not_ready: int) -> None:
    # Loading or draining: every answer says ``Connection: close`` so that a keep-alive client
    # leaves a draining replica at once instead of at its final stop.
    headers = _keep_alive_answers(http_not_ready, count=3, pause_s=0.0)
    assert [h.lower() if h else h for h in headers] == ["close"] * 3


def test_grace_without_an_age_is_refused_before_any_port_opens(bert_tiny_dir: Path) -> None:
    from limelight.cli.serve import preflight
    from limelight.errors import InvalidArgument

    settings: Any = Settings(model_dir=bert_tiny_dir, max_connection_age_grace_s=1.0)
    with pytest.raises(InvalidArgument, match="--max-connection-age-s"):
        preflight(settings)
