"""TLS files renewed while the sidecar runs (cert-manager renewing a certificate, a rotated
Secret): new connections on the gRPC and HTTP ports get the new certificate without a restart,
connections already open keep theirs, the expiry gauge follows, and a pair caught half-written
is not served. The files change the way the kubelet changes a mounted Secret: a new folder of
files and the ``..data`` symlink swapped in one rename."""

from __future__ import annotations

import http.client
import logging
import ssl
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar
from tests.pki import make_pki, mount_secret
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
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    tmp_path: Path,
    old: Path,
    new: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = tmp_path / "tls"
    mount_secret(secret, server_files(old))
    sidecar = start_sidecar(
        model_dir=bert_tiny_dir,
        jobs="off",
        tls_cert=secret / "tls.crt",
        tls_key=secret / "tls.key",
        tls_reload_interval_s=0.1,
    )
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
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    tmp_path: Path,
    old: Path,
    new: Path,
) -> None:
    """Both ports, and a CA dropped from the bundle is no longer trusted: the HTTP port once
    kept trusting it until a restart (files loaded into its old context only added CAs)."""
    both = tmp_path / "both.pem"
    both.write_bytes((old / "ca.pem").read_bytes() + (new / "ca.pem").read_bytes())
    secret = tmp_path / "tls"
    mount_secret(secret, {**server_files(old), "ca.crt": both})
    sidecar = start_sidecar(
        model_dir=bert_tiny_dir,
        jobs="off",
        tls_cert=secret / "tls.crt",
        tls_key=secret / "tls.key",
        tls_client_ca=secret / "ca.crt",
        tls_reload_interval_s=0.1,
    )
    for client in (old, new):  # the bundle trusts both clients' CAs
        assert answers(sidecar.target, old, client=client)
        assert https_answers(sidecar, old, client)

    mount_secret(secret, {**server_files(new), "ca.crt": new / "ca.pem"})
    wait_until(lambda: answers(sidecar.target, new, client=new), timeout=30)
    assert https_answers(sidecar, new, new)
    assert not answers(sidecar.target, new, client=old)
    assert not https_answers(sidecar, new, old)
