"""TLS and mutual TLS on both ports: OIP over gRPC (tritonclient) and the HTTP port (REST and
/metrics), with the same certificate settings; ``http_tls=false`` keeps the HTTP port plain."""

from __future__ import annotations

import json
import shutil
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from tests.pki import make_pki

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("oip-pki"))


def _context(certs: Path, with_client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if with_client_cert:
        context.load_cert_chain(certs / "client.pem", certs / "client.key")
    return context


def _infer_body() -> bytes:
    tensor = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a gorgeous movie"]}
    return json.dumps({"inputs": [tensor]}).encode()


def test_mutual_tls_on_grpc_and_http(start_sidecar: Any, bert_tiny_dir: Path, certs: Path) -> None:
    running = start_sidecar(
        model_dir=bert_tiny_dir,
        jobs="off",
        tls_cert=certs / "server.pem",
        tls_key=certs / "server.key",
        tls_client_ca=certs / "ca.pem",
    )
    name = bert_tiny_dir.name
    root = f"https://127.0.0.1:{running.server.metrics_port}"
    trusted = _context(certs, with_client_cert=True)
    request = urllib.request.Request(f"{root}/v2/models/{name}/infer", data=_infer_body())
    with urllib.request.urlopen(request, context=trusted, timeout=60) as response:
        outputs = {o["name"]: o for o in json.loads(response.read())["outputs"]}
    assert outputs["label"]["data"][0] in ("rotten", "fresh")
    with urllib.request.urlopen(f"{root}/metrics", context=trusted, timeout=30) as response:
        assert b"limelight_ready" in response.read()
    # No client certificate, or plain HTTP: refused.
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(
            f"{root}/v2/health/ready", context=_context(certs, with_client_cert=False), timeout=30
        ).read()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(
            f"http://127.0.0.1:{running.server.metrics_port}/v2/health/ready", timeout=30
        ).read()

    client = tgrpc.InferenceServerClient(
        url=running.target,
        ssl=True,
        root_certificates=str(certs / "ca.pem"),
        private_key=str(certs / "client.key"),
        certificate_chain=str(certs / "client.pem"),
    )
    text = tgrpc.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"a gorgeous movie"], dtype=object))
    result = client.infer(name, [text])
    assert result.as_numpy("label")[0].decode() == outputs["label"]["data"][0]
    client.close()
    anonymous = tgrpc.InferenceServerClient(
        url=running.target, ssl=True, root_certificates=str(certs / "ca.pem")
    )
    with pytest.raises(InferenceServerException):
        anonymous.is_server_live()
    anonymous.close()


def test_http_tls_off_keeps_the_http_port_plain(
    start_sidecar: Any, bert_tiny_dir: Path, certs: Path
) -> None:
    running = start_sidecar(
        model_dir=bert_tiny_dir,
        jobs="off",
        tls_cert=certs / "server.pem",
        tls_key=certs / "server.key",
        http_tls=False,
    )
    url = f"http://127.0.0.1:{running.server.metrics_port}/v2/health/ready"
    with urllib.request.urlopen(url, timeout=30) as response:
        assert json.loads(response.read()) == {"ready": True}
