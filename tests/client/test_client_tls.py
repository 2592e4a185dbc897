"""TLS and mutual TLS against a real grpc.server with certificates made in the test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from limelight_client import Client, errors
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.client.llc_scripted import ScriptedExplainer, ScriptedServer, start_server
from tests.conftest import RunningSidecar
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", *EC, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
        "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _make_leaf(d: Path, name: str, ca: str, ext: str) -> None:
    _openssl("req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
             cwd=d)  # fmt: skip
    (d / f"{name}.ext").write_text(ext)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext",
        cwd=d,
    )  # fmt: skip


@dataclass
class Pki:
    dir: Path

    def pem(self, name: str) -> bytes:
        return (self.dir / f"{name}.pem").read_bytes()

    def key(self, name: str) -> bytes:
        return (self.dir / f"{name}.key").read_bytes()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    _make_leaf(
        d,
        "server",
        "ca",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    _make_leaf(
        d, "elsewhere", "ca", "subjectAltName=DNS:elsewhere.example\nextendedKeyUsage=serverAuth\n"
    )
    _make_leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _make_leaf(d, "stranger", "other-ca", "extendedKeyUsage=clientAuth\n")
    return Pki(d)


def _mtls_server(pki: Pki, servicer: ScriptedExplainer) -> ScriptedServer:
    """A server that requires a client certificate signed by ``ca``."""
    creds = grpc.ssl_server_credentials(
        [(pki.key("server"), pki.pem("server"))],
        root_certificates=pki.pem("ca"),
        require_client_auth=True,
    )
    return start_server(servicer, creds)


def test_mutual_tls_with_token(pki: Pki) -> None:
    servicer = ScriptedExplainer(required_token="t0k")
    running = _mtls_server(pki, servicer)
    try:
        # Paths and PEM bytes are both accepted.
        with Client(
            running.target,
            ca_cert=pki.dir / "ca.pem",
            client_cert=pki.pem("client"),
            client_key=str(pki.dir / "client.key"),
            token="t0k",
        ) as c:
            assert c.explain("secure hello").label in ("negative", "positive")
        assert servicer.calls_to("Explain")[0].metadata["authorization"] == "Bearer t0k"
    finally:
        running.server.stop(None)


@pytest.mark.parametrize(
    "client_kw",
    [
        pytest.param({"ca_cert": "ca"}, id="no-client-cert"),
        pytest.param({"ca_cert": "ca", "client": "stranger"}, id="client-cert-from-other-ca"),
        pytest.param({"ca_cert": "other-ca", "client": "client"}, id="server-not-trusted"),
        pytest.param({}, id="plaintext-client"),
    ],
)
def test_mutual_tls_rejects(pki: Pki, client_kw: dict[str, str]) -> None:
    running = _mtls_server(pki, ScriptedExplainer())
    kw: dict[str, object] = {}
    if "ca_cert" in client_kw:
        kw["ca_cert"] = pki.pem(client_kw["ca_cert"])
    if "client" in client_kw:
        kw["client_cert"] = pki.pem(client_kw["client"])
        kw["client_key"] = pki.key(client_kw["client"])
    try:
        client = Client(running.target, retries=0, timeout=5, **kw)  # type: ignore[arg-type]
        with client as c, pytest.raises(errors.Unavailable):
            c.model()
    finally:
        running.server.stop(None)
    assert running.servicer.calls == []


def test_server_tls_only(pki: Pki) -> None:
    running = start_server(
        ScriptedExplainer(),
        grpc.ssl_server_credentials([(pki.key("server"), pki.pem("server"))]),
    )
    try:
        with Client(running.target, ca_cert=pki.pem("ca")) as c:
            assert c.model().name == "tiny"
    finally:
        running.server.stop(None)


@pytest.mark.parametrize(
    ("served", "trusted", "said"),
    [
        pytest.param("server", "other-ca", "its TLS certificate is not trusted (", id="wrong-ca"),
        pytest.param("elsewhere", "ca", "does not name the host in the target", id="wrong-name"),
        pytest.param(None, "ca", "does not speak TLS (a plaintext port?)", id="plaintext-server"),
    ],
)
def test_a_failed_tls_handshake_says_why_in_the_sdk_and_the_cli(
    pki: Pki, served: str | None, trusted: str, said: str
) -> None:
    """The three ways a TLS client commonly meets the wrong server: gRPC's raw handshake text
    becomes a reason the user can act on, and the CLI prints that one line — not gRPC's own
    log line above it, nor advice to start a sidecar where one already answers."""
    credentials = (
        None
        if served is None
        else grpc.ssl_server_credentials([(pki.key(served), pki.pem(served))])
    )
    running = start_server(ScriptedExplainer(), credentials)
    try:
        with (
            Client(running.target, ca_cert=pki.pem(trusted), retries=0, timeout=10) as client,
            pytest.raises(errors.Unavailable) as refused,
        ):
            client.model()
        assert refused.value.reason is not None and said in refused.value.reason
        assert refused.value.answered
        cli = subprocess.run(
            [
                sys.executable, "-m", "limelight.cli.main", "explain", "--target",
                running.target, "--tls", "--ca-cert", str(pki.dir / f"{trusted}.pem"),
                "--timeout", "10", "a text",
            ],
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"},
        )  # fmt: skip
    finally:
        running.server.stop(None)
    assert cli.returncode == 1
    assert cli.stderr.splitlines() == [
        f"limelight explain: error: cannot reach a sidecar at {running.target}: "
        f"{refused.value.reason}"
    ]
    assert running.servicer.calls == []


def test_client_cert_needs_key(pki: Pki) -> None:
    with pytest.raises(ValueError, match="together"):
        Client("127.0.0.1:1", ca_cert=pki.pem("ca"), client_cert=pki.pem("client"))
    with pytest.raises(ValueError, match="cannot read"):
        Client("127.0.0.1:1", ca_cert="/nonexistent/ca.pem")


def test_renewed_client_certificate_files_are_presented_on_new_connections(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """Both sides rotate under a running client: the sidecar's client CA moves to a new CA
    (served without a restart) and the client's certificate files to one that CA signed. The
    client's connection, closed by the sidecar's connection ageing, dials again with the old
    certificate, is refused, and the SDK's retry dials with the files as they are now: every
    call succeeds and nobody restarts."""
    from tests.pki import make_pki, mount_secret

    old = make_pki(tmp_path / "old")
    new = make_pki(tmp_path / "new")
    server_tls = tmp_path / "server-tls"
    serving = {"tls.crt": old / "server.pem", "tls.key": old / "server.key"}
    mount_secret(server_tls, {**serving, "ca.crt": old / "ca.pem"})
    sidecar = start_sidecar(
        model_dir=bert_tiny_dir,
        jobs="off",
        tls_cert=server_tls / "tls.crt",
        tls_key=server_tls / "tls.key",
        tls_client_ca=server_tls / "ca.crt",
        tls_reload_interval_s=0.1,
        max_connection_age_s=0.5,
    )
    mine = tmp_path / "client-tls"
    mount_secret(mine, {"tls.crt": old / "client.pem", "tls.key": old / "client.key"})
    target = f"localhost:{sidecar.target.rsplit(':', 1)[1]}"
    with Client(
        target,
        ca_cert=old / "ca.pem",
        client_cert=mine / "tls.crt",
        client_key=mine / "tls.key",
        timeout=30,
    ) as client:
        assert client.explain("before the renewal").label
        mount_secret(mine, {"tls.crt": new / "client.pem", "tls.key": new / "client.key"})
        mount_secret(server_tls, {**serving, "ca.crt": new / "ca.pem"})
        refused = old_client_refused(target, old)
        wait_until(refused)  # the sidecar serves the new client CA
        for _ in range(20):  # several connection lifetimes
            assert client.explain("after the renewal").label
            time.sleep(0.1)
        assert refused()  # so the calls above came in on the new certificate


def old_client_refused(target: str, old: Path) -> Callable[[], bool]:
    def refused() -> bool:
        creds = grpc.ssl_channel_credentials(
            (old / "ca.pem").read_bytes(),
            (old / "client.key").read_bytes(),
            (old / "client.pem").read_bytes(),
        )
        with grpc.secure_channel(target, creds) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=2)
            except grpc.FutureTimeoutError:
                return True
            stub = explainer_pb2_grpc.ExplainerStub(channel)
            try:
                stub.GetModel(pb.GetModelRequest(), timeout=5)
            except grpc.RpcError:
                return True
            return False

    return refused
