"""Health checks and wait_ready against a real grpc.server running the standard health service
(grpcio-health-checking on the server side; the SDK itself does not need it)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from limelight.api.ports import free_port
from limelight_client import AsyncClient, Client
from limelight_client._common import EXPLAINER_SERVICE
from limelight_client.errors import Unavailable
from limelight_client.proto import explainer_pb2_grpc as pb_grpc
from tests.client.llc_scripted import ScriptedExplainer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class RecordingHealth(health.HealthServicer):  # type: ignore[misc]
    """The standard health servicer, noting which connection each check came on."""

    def __init__(self) -> None:
        super().__init__()
        self.peers: list[str] = []

    def Check(self, request: object, context: grpc.ServicerContext) -> object:
        self.peers.append(context.peer())
        return super().Check(request, context)


@pytest.fixture
def healthy() -> Iterator[tuple[str, RecordingHealth]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = RecordingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    pb_grpc.add_ExplainerServicer_to_server(ScriptedExplainer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", NOT_SERVING)
    servicer.set(EXPLAINER_SERVICE, NOT_SERVING)
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def test_health_statuses(healthy: tuple[str, health.HealthServicer]) -> None:
    target, servicer = healthy
    with Client(target) as c:
        assert c.health() == "NOT_SERVING"
        servicer.set(EXPLAINER_SERVICE, SERVING)
        assert c.health() == "SERVING"
        assert c.health("") == "NOT_SERVING"
        assert c.health("no.such.Service") == "SERVICE_UNKNOWN"


def test_wait_ready_returns_once_serving(healthy: tuple[str, health.HealthServicer]) -> None:
    target, servicer = healthy
    timer = threading.Timer(0.3, servicer.set, (EXPLAINER_SERVICE, SERVING))
    timer.start()
    with Client(target) as c:
        c.wait_ready(timeout=30, poll=0.05)
        assert c.health() == "SERVING"
        assert c.model().name == "tiny"
    timer.join()


def test_wait_ready_asks_every_connection(healthy: tuple[str, RecordingHealth]) -> None:
    # With `--workers`, each connection is served by its own worker, each loading its model.
    target, servicer = healthy
    servicer.set(EXPLAINER_SERVICE, SERVING)
    with Client(target, connections=3) as c:
        c.wait_ready(timeout=30, poll=0.05)
    assert len(servicer.peers) == 3 and len(set(servicer.peers)) == 3


@pytest.mark.asyncio
async def test_async_wait_ready_asks_every_connection(
    healthy: tuple[str, RecordingHealth],
) -> None:
    target, servicer = healthy
    servicer.set(EXPLAINER_SERVICE, SERVING)
    async with AsyncClient(target, connections=3) as c:
        await c.wait_ready(timeout=30, poll=0.05)
    assert len(servicer.peers) == 3 and len(set(servicer.peers)) == 3


# The two tests below poll no sooner than the timeout: one check, given the whole timeout to
# answer. (Polled more often, the last check may get only a sliver of it, which a busy
# machine can miss: its status is then DeadlineExceeded instead of the server's answer.)


def test_wait_ready_times_out(healthy: tuple[str, health.HealthServicer]) -> None:
    target, _ = healthy
    with Client(target) as c, pytest.raises(TimeoutError, match="NOT_SERVING"):
        c.wait_ready(timeout=1.0, poll=1.0)


def test_wait_ready_server_not_listening() -> None:
    """The time-out keeps the last error's message, not only its class."""
    port = free_port()  # nothing listens there
    said = rf"last: Unavailable: cannot reach 127\.0\.0\.1:{port}: connection refused"
    with Client(f"127.0.0.1:{port}") as c, pytest.raises(TimeoutError, match=said):
        c.wait_ready(timeout=1.0, poll=1.0)


@pytest.mark.asyncio
async def test_async_wait_ready_server_not_listening() -> None:
    port = free_port()
    said = rf"last: Unavailable: cannot reach 127\.0\.0\.1:{port}: connection refused"
    async with AsyncClient(f"127.0.0.1:{port}") as c:
        with pytest.raises(TimeoutError, match=said):
            await c.wait_ready(timeout=1.0, poll=1.0)


@pytest.fixture
def http_port() -> Iterator[int]:
    """An HTTP/1 server (as the sidecar's metrics port is): it answers, but not gRPC."""
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    yield web.server_address[1]
    web.shutdown()
    web.server_close()


# No sidecar started there would make these ready: ``Unavailable`` (``answered``) from the
# first check, not a ``TimeoutError`` once the time is up (ample for that first check).


def test_wait_ready_where_no_sidecar_can_answer_raises_unavailable(http_port: int) -> None:
    with Client(f"127.0.0.1:{http_port}") as c, pytest.raises(Unavailable) as e:
        c.wait_ready(timeout=30)
    assert e.value.answered and "not a gRPC server" in str(e.value)


@pytest.mark.asyncio
async def test_async_wait_ready_where_no_sidecar_can_answer_raises_unavailable(
    http_port: int,
) -> None:
    async with AsyncClient(f"127.0.0.1:{http_port}") as c:
        with pytest.raises(Unavailable) as e:
            await c.wait_ready(timeout=30)
    assert e.value.answered and "not a gRPC server" in str(e.value)


@pytest.mark.asyncio
async def test_async_health(healthy: tuple[str, health.HealthServicer]) -> None:
    target, servicer = healthy
    async with AsyncClient(target) as c:
        before = await c.health()
        servicer.set(EXPLAINER_SERVICE, SERVING)
        await c.wait_ready(timeout=30, poll=0.05)
        after = await c.health()
    assert (before, after) == ("NOT_SERVING", "SERVING")


@pytest.fixture
def closing_port() -> Iterator[int]:
    """A port that accepts connections and closes them at once, as ``kubectl port-forward``
    does while the pod behind it is not listening yet."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    stop.set()
    listener.close()


def test_wait_ready_waits_through_connections_closed_at_once(closing_port: int) -> None:
    """Such a port may yet lead to a sidecar: ``wait_ready`` waits its time, and says why."""
    with Client(f"127.0.0.1:{closing_port}") as c, pytest.raises(TimeoutError) as e:
        c.wait_ready(timeout=1.0, poll=0.2)
    assert "closed at once" in str(e.value)
