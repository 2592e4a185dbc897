"""One mapping from a status to the client's error classes, for failed calls and for inputs
answered in their place by an error (``ItemError``: the code as a number)."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from limelight_client import errors

#: Each status code with the error class it becomes (shared with the network tests).
CLASSES = [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
    (grpc.StatusCode.OUT_OF_RANGE, errors.InvalidArgument),
    (grpc.StatusCode.NOT_FOUND, errors.NotFound),
    (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
    (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
    (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
    (grpc.StatusCode.UNIMPLEMENTED, errors.Unimplemented),
    (grpc.StatusCode.CANCELLED, errors.Cancelled),
    (grpc.StatusCode.INTERNAL, errors.Internal),
    (grpc.StatusCode.DATA_LOSS, errors.DataLoss),  # an Internal too
    (grpc.StatusCode.ABORTED, errors.LimelightError),  # no class of its own
]


@pytest.mark.parametrize(("code", "cls"), CLASSES, ids=[c.name for c, _ in CLASSES])
def test_a_code_and_its_number_give_the_same_error(
    code: grpc.StatusCode, cls: type[errors.LimelightError]
) -> None:
    by_code = errors.from_status(code, "why")
    by_number = errors.from_status(code.value[0], "why")
    for error in (by_code, by_number):
        assert type(error) is cls
        assert error.code == code and error.message == "why"
        assert str(error) == f"{code.name}: why"


def test_unknown_codes_and_empty_messages() -> None:
    unknown = errors.from_status(99, "")
    assert isinstance(unknown, errors.Internal) and unknown.code == grpc.StatusCode.UNKNOWN
    assert unknown.message == "unknown"
    assert errors.from_status(None, None).code == grpc.StatusCode.UNKNOWN
    assert errors.from_status(True, "x").code == grpc.StatusCode.UNKNOWN  # a bool is no code
    assert errors.from_status(grpc.StatusCode.OK, "").message == "ok"


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def test_nothing_listening_reads_as_where_and_why(tmp_path: Path) -> None:
    """Real connection attempts: gRPC's text ("failed to connect to all addresses; last
    error: UNKNOWN: ipv6:%5B::1%5D:…: Failed to connect to remote host: …") becomes the
    address tried and the reason, kept apart in ``reason`` for callers that word it
    themselves (the CLI)."""
    import asyncio

    from limelight_client import AsyncClient, Client

    port = _closed_port()
    cases = {
        f"localhost:{port}": (f"127.0.0.1:{port}", "connection refused"),
        f"[::1]:{port}": (f"[::1]:{port}", "connection refused"),
        f"unix:{tmp_path}/none.sock": (f"unix:{tmp_path}/none.sock", "no such file or directory"),
        "nothing.invalid:50051": ("nothing.invalid:50051", "the host name does not resolve"),
    }
    for target, (where, reason) in cases.items():
        with (
            Client(target, retries=0, timeout=10) as client,
            pytest.raises(errors.Unavailable) as e,
        ):
            client.explain("x")
        if target.startswith("[::1]") and "Address family not supported" in e.value.message:
            continue  # a machine without IPv6
        assert e.value.reason == reason, e.value.message
        assert str(e.value) == f"UNAVAILABLE: cannot reach {where}: {reason}"

    async def refused() -> errors.Unavailable:
        async with AsyncClient(f"localhost:{port}", retries=0, timeout=10) as client:
            try:
                await client.explain("x")
            except errors.Unavailable as exc:
                return exc
        raise AssertionError("the call went through")

    assert asyncio.run(refused()).reason == "connection refused"


def test_a_port_that_is_not_grpc_says_so(tmp_path: Path) -> None:
    """Real servers that are not gRPC: an HTTP/1 server (the sidecar's own metrics port is
    one) and a listener that closes every connection (a TLS-only port, a wrong service)."""
    import http.server
    import socket
    import threading

    from limelight_client import Client

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    closer = socket.create_server(("127.0.0.1", 0))

    def close_each() -> None:
        while True:
            try:
                conn, _ = closer.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=close_each, daemon=True).start()
    try:
        for port, said in (
            (web.server_address[1], "not a gRPC server (an HTTP/1 port"),
            (closer.getsockname()[1], "the connection was closed at once"),
        ):
            with (
                Client(f"127.0.0.1:{port}", retries=0, timeout=10) as client,
                pytest.raises(errors.Unavailable) as e,
            ):
                client.explain("x")
            assert e.value.reason is not None and said in e.value.reason, e.value.message
            assert str(e.value).startswith(f"UNAVAILABLE: cannot reach 127.0.0.1:{port}: ")
    finally:
        web.shutdown()
        closer.close()


def test_an_unavailable_answer_of_a_server_keeps_its_message() -> None:
    """UNAVAILABLE from a server that was reached (draining, not ready) is not a failure to
    connect: its message stays as it came and ``reason`` is None."""
    draining = errors.from_status(grpc.StatusCode.UNAVAILABLE, "the sidecar is draining")
    assert isinstance(draining, errors.Unavailable) and draining.reason is None
    assert draining.message == "the sidecar is draining"


@pytest.mark.parametrize(
    ("target", "said"),
    [
        (
            "http://localhost:50051",
            "is a URL; the client dials a gRPC address: use 'localhost:50051'",
        ),
        ("https://limelight.example:443/", "use 'limelight.example:443' with tls=True"),
        ("grpc://10.0.0.7:50051", "use '10.0.0.7:50051'"),
        ("localhost:50051/", "is not an address host:port (e.g. localhost:50051)"),
        (":50051", "is not an address host:port"),
        ("localhost:", "is not an address host:port"),
        ("localhost:99999", "the port must be a number from 1 to 65535"),  # gRPC: port 34463
        ("localhost:0", "the port must be a number from 1 to 65535"),
        ("localhost:http", "the port must be a number from 1 to 65535"),
        ("", "target must be an address host:port"),
    ],
)
def test_a_target_grpc_would_dial_otherwise_than_meant_is_refused_at_once(
    target: str, said: str
) -> None:
    """A URL or a path would fail later as "the host name does not resolve", and a port over
    65535 would dial another port: both clients refuse such targets when they are made."""
    from limelight_client import AsyncClient, Client

    for kind in (Client, AsyncClient):
        with pytest.raises(ValueError, match=re.escape(said)):
            kind(target)


@pytest.mark.parametrize(
    "target",
    [
        "localhost:50051",
        "10.0.0.7:50051",
        "[::1]:50051",
        "limelight.ns.svc.cluster.local:50051",
        "localhost",  # gRPC's default port (443)
        "unix:/run/limelight.sock",
        "unix:///run/limelight.sock",
        "dns:///limelight:50051",
        "ipv4:10.0.0.7:50051,10.0.0.8:50051",
    ],
)
def test_targets_grpc_understands_are_taken_as_given(target: str) -> None:
    from limelight_client import Client

    with Client(target) as client:  # nothing is dialled before the first call
        assert client.target == target


def test_one_string_where_many_texts_belong_is_refused_not_spelled_out() -> None:
    """``explain_many("a review")`` would iterate the letters and explain each; both clients
    refuse one str (or bytes) for the many-text calls before anything is sent."""
    import asyncio

    from limelight_client import AsyncClient, Client

    with Client("127.0.0.1:1") as client:
        for call in (client.explain_many, client.explain_batch):
            with pytest.raises(TypeError, match=r"not one str: use explain\(text\) for one"):
                call("a gorgeous film")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not one bytes"):
            client.explain_many(b"a gorgeous film")  # type: ignore[arg-type]

    async def calls() -> None:
        async with AsyncClient("127.0.0.1:1") as client:
            with pytest.raises(TypeError, match=r"explain_many\(\[text\]\)"):
                client.explain_many("a gorgeous film")  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=r"explain_batch\(\[text\]\)"):
                await client.explain_batch("a gorgeous film")  # type: ignore[arg-type]

    asyncio.run(calls())


def test_a_text_with_undecodable_bytes_is_refused_before_anything_is_sent() -> None:
    """Bytes that are not UTF-8, read with errors="surrogateescape" (Python's way with
    arguments and standard input), leave lone surrogates that protobuf cannot encode: a
    ValueError that says so, not a UnicodeEncodeError from deep inside the stub."""
    from limelight_client import Client

    broken = b"caf\xe9 good".decode("utf-8", "surrogateescape")
    with Client("127.0.0.1:1") as client:
        with pytest.raises(ValueError, match=r"text is not valid Unicode: .*U\+DCE9.* 3"):
            client.explain(broken)
        with pytest.raises(ValueError, match="text_pair is not valid Unicode"):
            client.explain("fine", text_pair=broken)
        with pytest.raises(ValueError, match="not valid Unicode"):
            client.submit(broken, "lrp")


def test_a_closed_client_says_so_on_every_call() -> None:
    """grpc's "ValueError: Cannot invoke RPC on closed channel!" came out of a closed client;
    every failed call raises a LimelightError."""
    import asyncio

    from limelight_client import AsyncClient, Client

    client = Client("127.0.0.1:1")
    client.close()
    calls = {
        "explain": lambda: client.explain("x"),
        "health": lambda: client.health(),
        "model": lambda: client.model(),
        "explain_many": lambda: list(client.explain_many(["a", "b"])),
        "explain_many packed": lambda: list(client.explain_many(["a", "b"], texts_per_call=2)),
        "explain_batch": lambda: client.explain_batch(["a", "b"]),
        "submit": lambda: client.submit("x", "lrp"),
        "jobs": lambda: client.jobs(),
    }
    for name, call in calls.items():
        with pytest.raises(errors.Cancelled, match="client is closed"):
            call()
        assert name

    async def closed_async() -> None:
        aio = AsyncClient("127.0.0.1:1")
        await aio.close()
        with pytest.raises(errors.Cancelled, match="client is closed"):
            await aio.explain("x")
        with pytest.raises(errors.Cancelled, match="client is closed"):
            await aio.health()
        with pytest.raises(errors.Cancelled, match="client is closed"):
            [e async for e in aio.explain_many(["a", "b"])]

    asyncio.run(closed_async())


def test_a_call_an_older_sidecar_lacks_says_so() -> None:
    """A sidecar older than ExplainBatch answered gRPC's bare "Method not found!"."""
    from concurrent import futures

    from limelight_client import Client
    from limelight_client.errors import Unimplemented

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # implements nothing
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}") as client, pytest.raises(Unimplemented) as raised:
            client.explain_batch(["a fine film"])
        assert raised.value.message == (
            "this sidecar does not have the call (it is older than this SDK): upgrade it"
        )
    finally:
        server.stop(None)
