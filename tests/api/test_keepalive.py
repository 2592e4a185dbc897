"""Connections that die without a word — a load balancer or NAT that forgets an idle
connection, a client pod that vanished — stand in for by a TCP proxy that stops forwarding
the connections it holds without closing them. The SDK's keepalive pings notice and its next
call dials anew (without them that call hangs until its deadline); the sidecar's notice a
client that is gone and end the stream it held open (without them it stays open for ever)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import grpc
import pytest

from limelight_client import Client
from limelight_client.errors import DeadlineExceeded
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar
from tests.waiting import wait_until


class SilentProxy:
    """Forwards TCP connections on ``port`` to ``upstream``; ``drop_silently`` stops
    forwarding on every connection open now, without closing any (new ones are forwarded)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.accepted = 0
        self.closed_by_client = 0
        self._flows: list[dict[str, bool]] = []
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            flow = {"dropped": False}
            self.accepted += 1
            self._flows.append(flow)
            self._sockets += [conn, up]
            for source, sink in ((conn, up), (up, conn)):
                threading.Thread(
                    target=self._pump, args=(source, sink, flow, source is conn), daemon=True
                ).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, flow: dict[str, bool], client: bool
    ) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    self.closed_by_client += client
                    sink.shutdown(socket.SHUT_WR)
                    return
                if not flow["dropped"]:
                    sink.sendall(data)
            except OSError:
                return

    def drop_silently(self) -> None:
        for flow in self._flows:
            flow["dropped"] = True

    def __enter__(self) -> SilentProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.listener.close()
        for sock in self._sockets:
            sock.close()


def port_of(sidecar: RunningSidecar) -> int:
    return int(sidecar.target.rsplit(":", 1)[1])


@pytest.mark.parametrize("keepalive", [1.0, None])
def test_the_sdk_notices_a_connection_dropped_silently(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, keepalive: float | None
) -> None:
    sidecar = start_sidecar(
        model_dir=bert_tiny_dir, jobs="off", keepalive_min_client_interval_s=0.5
    )
    with (
        SilentProxy(port_of(sidecar)) as proxy,
        Client(f"127.0.0.1:{proxy.port}", timeout=5, retries=0, keepalive=keepalive) as client,
    ):
        assert client.explain("before the load balancer forgets us").label
        proxy.drop_silently()
        if keepalive is None:
            time.sleep(3)  # idle as long as the pinging client takes to notice
            assert proxy.closed_by_client == 0  # it never does
            with pytest.raises(DeadlineExceeded):  # sent into the void
                client.explain("after")
        else:
            # Idle: a ping after 1 s, unanswered for 1 s, and the client closes the connection.
            wait_until(lambda: proxy.closed_by_client == 1)
            assert client.explain("after").label
            assert proxy.accepted == 2


def test_the_sidecar_ends_the_stream_of_a_client_that_vanished(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    # Until the proxy drops the connection the client answers the sidecar's pings, through the
    # proxy's threads: a second to answer each is slack for a busy machine.
    sidecar = start_sidecar(
        model_dir=bert_tiny_dir, jobs="off", keepalive_time_s=1.0, keepalive_timeout_s=1.0
    )

    def streams_open() -> float:
        registry = sidecar.server.metrics.registry
        value = registry.get_sample_value("limelight_requests_in_flight", {"rpc": "ExplainStream"})
        return value or 0.0

    more = threading.Event()

    def inputs() -> Iterator[pb.ExplainRequest]:
        yield pb.ExplainRequest(text="one review, then silence")
        more.wait()

    with SilentProxy(port_of(sidecar)) as proxy:
        channel = grpc.insecure_channel(f"127.0.0.1:{proxy.port}")  # no keepalive of its own
        call = explainer_pb2_grpc.ExplainerStub(channel).ExplainStream(inputs())
        assert next(call).explanation.scores
        assert streams_open() == 1
        proxy.drop_silently()  # the client is gone, its connection never closed
        wait_until(lambda: streams_open() == 0)
        more.set()
        call.cancel()
        channel.close()
