"""TLS files renewed while the sidecar runs (cert-manager renewing a certificate, a rotated
Secret): new connections on the gRPC and HTTP ports get the new certificate without a restart,
connections already open keep theirs, the expiry gauge follows, and a pair caught half-written
is not served. The files change the way the kubelet changes a mounted Secret: a new folder of
files and the ``..data`` symlink swapped in one rename."""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from unittest import mock

import grpc
import pytest
from cryptography import x509

from limelight.api.server_tls import ServerTls
from limelight.api.tls_check import TlsConfigError, check_server_tls
from limelight.settings import Settings
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar
from tests.pki import issue_server, make_pki, mount_secret
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def old(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("old-pki"))


@pytest.fixture(scope="module")
def new(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another CA (clients that trust only it refuse the old certificate), and a server
    certificate with another expiry."""
    return make_pki(tmp_path_factory.mktemp("new-pki"), days=3)


def server_files(pki: Path, key_of: Path | None = None) -> dict[str, Path]:
    return {"tls.crt": pki / "server.pem", "tls.key": (key_of or pki) / "server.key"}


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """The folder of the sidecar's mounted TLS Secret (``tls.crt``, ``tls.key``, ``ca.crt``)."""
    return tmp_path / "tls"


@pytest.fixture
def serve_secret(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, secret: Path
) -> Callable[[dict[str, Path]], RunningSidecar]:
    """``serve_secret(files)``: mount ``files`` (name → source) at ``secret`` and start a
    sidecar (no jobs) serving its ``tls.crt`` and ``tls.key``, with its ``ca.crt`` as the
    client CA when ``files`` has one, looking for renewed files every 0.1 s."""

    def serve(files: dict[str, Path]) -> RunningSidecar:
        mount_secret(secret, files)
        client_ca = {"tls_client_ca": secret / "ca.crt"} if "ca.crt" in files else {}
        return start_sidecar(
            model_dir=bert_tiny_dir,
            jobs="off",
            tls_cert=secret / "tls.crt",
            tls_key=secret / "tls.key",
            tls_reload_interval_s=0.1,
            **client_ca,
        )

    return serve


def channel(target: str, pki: Path, client: Path | None = None) -> grpc.Channel:
    """A channel that trusts only ``pki``'s CA (with ``client``'s certificate for mTLS)."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(client / "client.key").read_bytes() if client else None,
        certificate_chain=(client / "client.pem").read_bytes() if client else None,
    )
    return grpc.secure_channel(f"localhost:{target.rsplit(':', 1)[1]}", creds)


def answers(target: str, pki: Path, client: Path | None = None) -> bool:
    """Whether a new connection that trusts ``pki`` gets an explanation."""
    with channel(target, pki, client) as ch:
        try:
            explainer_pb2_grpc.ExplainerStub(ch).Explain(pb.ExplainRequest(text="ok"), timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed
            return False
        return True


def metrics(sidecar: RunningSidecar, pki: Path) -> str | None:
    """/metrics over HTTPS trusting ``pki``; None if the handshake fails."""
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    url = f"https://localhost:{sidecar.server.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, context=context, timeout=10) as reply:
            return str(reply.read().decode())
    except urllib.error.URLError as exc:
        assert isinstance(exc.reason, ssl.SSLError)
        return None


def expiry(metrics_text: str) -> float:
    (line,) = [
        line
        for line in metrics_text.splitlines()
        if line.startswith("limelight_tls_certificate_expiry_timestamp_seconds{")
    ]
    return float(line.split()[-1])


def not_after(pki: Path) -> float:
    cert = x509.load_pem_x509_certificate((pki / "server.pem").read_bytes())
    return cert.not_valid_after_utc.timestamp()


def test_a_renewed_certificate_is_served_to_new_connections(
    serve_secret: Callable[[dict[str, Path]], RunningSidecar],
    secret: Path,
    old: Path,
    new: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sidecar = serve_secret(server_files(old))
    assert answers(sidecar.target, old) and not answers(sidecar.target, new)
    before = metrics(sidecar, old)
    assert before is not None and expiry(before) == not_after(old)
    opened = channel(sidecar.target, old)
    stub = explainer_pb2_grpc.ExplainerStub(opened)
    stub.Explain(pb.ExplainRequest(text="connected before"), timeout=10)

    # Half-written: the new certificate with the old key. Not served; one warning.
    with caplog.at_level(logging.WARNING, logger="limelight.api.server_tls"):
        mount_secret(secret, server_files(new, key_of=old))
        wait_until(lambda: "cannot be served" in caplog.text, timeout=30)
    assert answers(sidecar.target, old) and not answers(sidecar.target, new)
    assert caplog.text.count("cannot be served") == 1

    mount_secret(secret, server_files(new))
    wait_until(lambda: answers(sidecar.target, new), timeout=30)
    assert not answers(sidecar.target, old)
    after = metrics(sidecar, new)  # the HTTP port too
    assert after is not None and expiry(after) == not_after(new)
    assert metrics(sidecar, old) is None
    # A connection opened before keeps its session.
    assert stub.Explain(pb.ExplainRequest(text="still here"), timeout=10).label
    opened.close()


def https_answers(sidecar: RunningSidecar, pki: Path, client: Path) -> bool:
    """Whether a new HTTPS connection that trusts ``pki`` and shows ``client``'s certificate
    gets /metrics. Under TLS 1.3 a refused client certificate surfaces after the handshake, as
    an alert or a closed connection on the first read."""
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    context.load_cert_chain(client / "client.pem", client / "client.key")
    url = f"https://localhost:{sidecar.server.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, context=context, timeout=10) as reply:
            return bool(reply.status == 200)
    except urllib.error.URLError as exc:
        assert isinstance(exc.reason, (ssl.SSLError, ConnectionError)), exc
    except (ssl.SSLError, ConnectionError, http.client.RemoteDisconnected):
        pass
    return False


def test_a_rotated_client_ca_is_required_of_new_connections(
    serve_secret: Callable[[dict[str, Path]], RunningSidecar],
    secret: Path,
    tmp_path: Path,
    old: Path,
    new: Path,
) -> None:
    """Both ports, and a CA dropped from the bundle is no longer trusted: the HTTP port once
    kept trusting it until a restart (files loaded into its old context only added CAs)."""
    both = tmp_path / "both.pem"
    both.write_bytes((old / "ca.pem").read_bytes() + (new / "ca.pem").read_bytes())
    sidecar = serve_secret({**server_files(old), "ca.crt": both})
    for client in (old, new):  # the bundle trusts both clients' CAs
        assert answers(sidecar.target, old, client=client)
        assert https_answers(sidecar, old, client)

    mount_secret(secret, {**server_files(new), "ca.crt": new / "ca.pem"})
    wait_until(lambda: answers(sidecar.target, new, client=new), timeout=30)
    assert https_answers(sidecar, new, new)
    assert not answers(sidecar.target, new, client=old)
    assert not https_answers(sidecar, new, old)


def _https_get(
    port: int, context: ssl.SSLContext, session: ssl.SSLSession | None = None
) -> tuple[str, ssl.SSLSession | None, bool]:
    """GET /metrics on a new connection (resuming ``session`` if given): the status line, or
    "refused" (the handshake failed, or, under TLS 1.3, the server closed the connection after
    it), the connection's session and whether it was resumed."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        conn = context.wrap_socket(sock, server_hostname="localhost", session=session)
    except (ssl.SSLError, ConnectionError):
        sock.close()
        return "refused", None, False
    with conn:
        try:
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := conn.recv(65536):  # to the end: the TLS 1.3 tickets come with it
                data += chunk
        except (ssl.SSLError, ConnectionError):
            return "refused", None, False
        status = data.split(b"\r\n", 1)[0].decode() or "refused"
        return status, conn.session, bool(conn.session_reused)


def client_context(trusted: Path, client: Path, version: ssl.TLSVersion) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(trusted / "ca.pem"))
    context.load_cert_chain(client / "client.pem", client / "client.key")
    context.minimum_version = context.maximum_version = version
    return context


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_a_session_from_before_a_client_ca_rotation_does_not_resume(
    serve_secret: Callable[[dict[str, Path]], RunningSidecar],
    secret: Path,
    old: Path,
    new: Path,
    version: ssl.TLSVersion,
) -> None:
    """A client refused by the new client CA bundle does not get in on the HTTP port by
    resuming a TLS session it made before (OpenSSL does not verify the client certificate of a
    resumed session again): no session tickets, and a TLS 1.2 session-ID resumption of an
    older session is refused."""
    sidecar = serve_secret({**server_files(old), "ca.crt": old / "ca.pem"})
    port = sidecar.server.metrics_port
    refused_later = client_context(old, old, version)  # its CA is rotated out below
    status, session, _ = _https_get(port, refused_later)
    assert status == "HTTP/1.1 200 OK" and session is not None
    if version == ssl.TLSVersion.TLSv1_2:  # resumption works (the session is cached)
        status, session, reused = _https_get(port, refused_later, session)
        assert status == "HTTP/1.1 200 OK" and reused and session is not None

    mount_secret(secret, {**server_files(old), "ca.crt": new / "ca.pem"})
    trusted_now = client_context(old, new, version)
    wait_until(lambda: _https_get(port, trusted_now)[0] == "HTTP/1.1 200 OK", timeout=30)
    assert _https_get(port, refused_later)[0] == "refused"  # a full handshake
    status, _, reused = _https_get(port, refused_later, session)
    assert status == "refused", f"resumed a session from before the rotation (reused={reused})"


def logged(caplog: pytest.LogCaptureFixture, text: str, times: int) -> Callable[[], bool]:
    """Whether ``text`` has been logged ``times`` times (for ``wait_until``)."""
    return lambda: caplog.text.count(text) == times


def served_expiry(sidecar: RunningSidecar) -> float | None:
    """What the expiry gauge says of the served certificate."""
    value = sidecar.server.metrics.registry.get_sample_value(
        "limelight_tls_certificate_expiry_timestamp_seconds",
        {"cert": str(sidecar.settings.tls_cert)},
    )
    return None if value is None else float(value)


def test_a_client_ca_bundle_cut_short_or_empty_is_not_served(
    serve_secret: Callable[[dict[str, Path]], RunningSidecar],
    secret: Path,
    tmp_path: Path,
    old: Path,
    new: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Like a half-written certificate and key: one warning, and the previous set stays
    served on both ports (gRPC once took the bundle, failed every handshake and fell back on
    an older configuration than the HTTP port and the expiry gauge showed; an empty bundle
    raised in the reload task)."""
    sidecar = serve_secret({**server_files(old), "ca.crt": old / "ca.pem"})
    ca = (old / "ca.pem").read_bytes()
    broken = tmp_path / "broken-ca.pem"
    for seen, content in enumerate((ca[: len(ca) // 2], b"", ca + ca[: len(ca) // 2]), 1):
        broken.write_bytes(content)
        with caplog.at_level(logging.WARNING, logger="limelight.api.server_tls"):
            # A renewed certificate with it: not served either (the set is not whole).
            mount_secret(secret, {**server_files(new), "ca.crt": broken})
            wait_until(logged(caplog, "cannot be served", seen), timeout=30)
        assert "--tls-client-ca" in caplog.text
        assert answers(sidecar.target, old, client=old)  # gRPC: the old certificate and CA
        assert not answers(sidecar.target, new, client=old)
        assert https_answers(sidecar, old, old)  # HTTP: the same
        assert served_expiry(sidecar) == not_after(old)
    assert caplog.text.count("cannot be served") == 3
    assert "Traceback" not in caplog.text

    mount_secret(secret, {**server_files(new), "ca.crt": new / "ca.pem"})
    wait_until(lambda: answers(sidecar.target, new, client=new), timeout=30)
    assert https_answers(sidecar, new, new) and served_expiry(sidecar) == not_after(new)


@pytest.mark.parametrize("content", ["cut", "empty"])
def test_a_broken_client_ca_bundle_at_start_names_the_setting(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    tmp_path: Path,
    old: Path,
    content: str,
) -> None:
    """Not "cannot listen on ...: the port is in use" (gRPC failing to bind)."""
    ca = (old / "ca.pem").read_bytes()
    broken = tmp_path / "ca.pem"
    broken.write_bytes(ca[: len(ca) // 2] if content == "cut" else b"")
    with pytest.raises(TlsConfigError, match=f"--tls-client-ca {broken}"):
        start_sidecar(
            model_dir=bert_tiny_dir,
            jobs="off",
            tls_cert=old / "server.pem",
            tls_key=old / "server.key",
            tls_client_ca=broken,
        )


@pytest.fixture(scope="module")
def out_of_window(old: Path) -> Path:
    """In ``old``: ``expired`` (its validity ended an hour ago) and ``future`` (starts in a
    day), both signed by its CA."""
    now = datetime.now(UTC)
    issue_server(old, "expired", now - timedelta(days=2), now - timedelta(hours=1))
    issue_server(old, "future", now + timedelta(days=1), now + timedelta(days=3))
    return old


def test_a_renewal_outside_its_validity_does_not_replace_a_valid_certificate(
    serve_secret: Callable[[dict[str, Path]], RunningSidecar],
    secret: Path,
    out_of_window: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    old = out_of_window
    sidecar = serve_secret(server_files(old))
    for seen, name in enumerate(("expired", "future"), 1):
        with caplog.at_level(logging.WARNING, logger="limelight.api.server_tls"):
            mount_secret(secret, {"tls.crt": old / f"{name}.pem", "tls.key": old / f"{name}.key"})
            wait_until(logged(caplog, "are not served", seen), timeout=30)
        assert answers(sidecar.target, old)  # the valid certificate, still served
        assert served_expiry(sidecar) == not_after(old)
        assert "TLS files reloaded" not in caplog.text
    assert "expired at" in caplog.text and "not valid before" in caplog.text


def test_a_renewal_not_valid_yet_is_served_once_it_is(
    secret: Path, out_of_window: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Looked at again at every look (one warning), served once its validity starts; at
    start a certificate outside its validity is served (with a warning: nothing else to
    serve)."""
    old = out_of_window
    mount_secret(secret, server_files(old))
    tls = ServerTls(Settings(tls_cert=secret / "tls.crt", tls_key=secret / "tls.key"))
    mount_secret(secret, {"tls.crt": old / "future.pem", "tls.key": old / "future.key"})
    future = x509.load_pem_x509_certificate((old / "future.pem").read_bytes())
    starts = future.not_valid_before_utc.timestamp()
    with caplog.at_level(logging.WARNING, logger="limelight.api.server_tls"):
        assert tls.changed() is None and tls.changed() is None
    assert caplog.text.count("are not served") == 1
    with mock.patch("limelight.api.server_tls.time.time", return_value=starts + 1):
        files = tls.changed()
    assert files is not None and files.cert == (old / "future.pem").read_bytes()

    started = ServerTls(Settings(tls_cert=secret / "tls.crt", tls_key=secret / "tls.key"))
    assert started.changed() is None  # nothing changed since it started with them


def test_tls_check_writes_not_valid_before_as_a_date(
    out_of_window: Path, caplog: pytest.LogCaptureFixture
) -> None:
    future = x509.load_pem_x509_certificate((out_of_window / "future.pem").read_bytes())
    with caplog.at_level(logging.WARNING, logger="limelight.api.tls_check"):
        check_server_tls(out_of_window / "future.pem", out_of_window / "future.key")
    assert f"not valid before {future.not_valid_before_utc.isoformat()}" in caplog.text
