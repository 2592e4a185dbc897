"""Open Inference Protocol conformance points found by driving the ports with real clients
(tritonclient, kserve): readiness while the model loads, what the open readiness routes say
without a token, raw and typed contents together, trailing binary data, output parameters the
server does not honour, the HTTP port's extensions and ``/v2/``, and error bodies' type."""

from __future__ import annotations

import asyncio
import http.client
import json
import struct
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from limelight.api import oip
from limelight.api.http_server import HttpServer
from limelight.api.oip_grpc import InferenceServicer, add_to_server
from limelight.api.servicer import ExplainerServicer
from limelight.metrics import Metrics
from limelight.settings import Settings
from limelight_client.proto import open_inference_grpc_pb2 as pb
from limelight_client.proto import open_inference_grpc_pb2_grpc as pb_grpc
from tests.conftest import RunningSidecar, cache_dir

# --- helpers ----------------------------------------------------------------------------------


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, Any]]:
    """Status, exact Content-Type and JSON body of a GET (an error status included)."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers["Content-Type"], json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], json.loads(exc.read())


def post_raw(
    port: int, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, str, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.headers["Content-Type"], json.loads(response.read())
    finally:
        connection.close()


def served_name(sidecar: RunningSidecar) -> str:
    assert sidecar.settings.model_dir is not None
    return sidecar.settings.model_dir.name


def text_tensor(texts: list[str]) -> pb.ModelInferRequest.InferInputTensor:
    return pb.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[len(texts)])


class LoopThread:
    """An event loop on a thread of its own, for servers the tests start themselves."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


# --- 1. the open readiness routes do not name the served model without a token -----------------


def test_open_ready_routes_name_the_served_model_only_to_an_authenticated_caller(
    start_sidecar: Any, bert_tiny_dir: Path
) -> None:
    running = start_sidecar(model_dir=bert_tiny_dir, auth_token="s3cret", jobs="off")
    name = bert_tiny_dir.name
    root = f"http://127.0.0.1:{running.server.metrics_port}"
    token = {"Authorization": "Bearer s3cret"}
    for path in ("/v2/models/guess/ready", "/v1/models/guess"):
        for headers in (None, {"Authorization": "Bearer nope"}):
            status, _, body = get(root + path, headers)
            assert (status, body) == (404, {"error": "unknown model 'guess'"}), path
        status, _, body = get(root + path, token)
        assert status == 404 and name in body["error"], path
    # A wrong version of the right model: nor the served version.
    status, _, body = get(f"{root}/v2/models/{name}/versions/9/ready")
    assert status == 404 and "served version" not in body["error"]
    assert get(f"{root}/v2/models/{name}/ready")[0] == 200  # still open

    channel = grpc.insecure_channel(running.target)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    for metadata in (None, [("authorization", "Bearer nope")]):
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelReady(pb.ModelReadyRequest(name="guess"), metadata=metadata, timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert info.value.details() == "unknown model 'guess'"
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelReady(
            pb.ModelReadyRequest(name="guess"),
            metadata=[("authorization", "Bearer s3cret")],
            timeout=30,
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and name in info.value.details()
    assert stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=30).ready
    channel.close()


def test_without_auth_a_wrong_model_is_told_the_served_name(sidecar: RunningSidecar) -> None:
    name = served_name(sidecar)
    status, _, body = get(f"http://127.0.0.1:{sidecar.server.metrics_port}/v2/models/guess/ready")
    assert status == 404 and f"this server serves {name!r}" in body["error"]
    channel = grpc.insecure_channel(sidecar.target)
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelReady(
            pb.ModelReadyRequest(name="guess"), timeout=30
        )
    assert f"this server serves {name!r}" in (info.value.details() or "")
    channel.close()


# --- 2. ModelReady while the model loads -------------------------------------------------------


def test_the_configured_name_is_the_served_name(
    sidecar: RunningSidecar, bert_tiny_dir: Path, tmp_path: Path
) -> None:
    from limelight.demo.recipes import demo_model_dir

    assert oip.configured_model_name(sidecar.settings) == served_name(sidecar)
    assert oip.configured_model_name(Settings(model_dir=bert_tiny_dir, model_name="c")) == "c"
    demo = Settings(demo_model="bert-tiny", cache_dir=cache_dir())
    assert oip.configured_model_name(demo) == demo_model_dir("bert-tiny", cache_dir()).name
    # A relative path names its directory, as loading it does.
    assert oip.configured_model_name(Settings(model_dir=Path("."))) == Path.cwd().name
    # A Hugging Face model id: its last part.
    assert oip.configured_model_name(Settings(model_dir=Path("org/some-model"))) == "some-model"


@pytest.fixture
def loading_http(loop_thread: LoopThread, bert_tiny_dir: Path) -> Iterator[int]:
    """The HTTP port of a sidecar whose model (``bert_tiny_dir``) is still loading."""
    server = HttpServer(Settings(model_dir=bert_tiny_dir), Metrics(), lambda: None)
    port = loop_thread.run(server.start("127.0.0.1", 0))
    yield port
    loop_thread.run(server.stop())


def test_http_model_ready_while_loading_is_not_ready_not_an_error(
    loading_http: int, bert_tiny_dir: Path
) -> None:
    name = bert_tiny_dir.name
    root = f"http://127.0.0.1:{loading_http}"
    for path in (f"/v2/models/{name}/ready", f"/v1/models/{name}"):
        assert get(root + path)[::2] == (503, {"name": name, "ready": False}), path
    status, _, body = get(f"{root}/v2/models/other/ready")
    assert status == 404 and body["error"].startswith("unknown model 'other'")
    client = thttp.InferenceServerClient(f"127.0.0.1:{loading_http}")
    assert client.is_model_ready(name) is False
    client.close()


def test_grpc_model_ready_while_loading_is_ready_false(loop_thread: LoopThread) -> None:
    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        add_to_server(InferenceServicer(ExplainerServicer(Metrics()), "0", "classifier"), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop_thread.run(start())
    try:
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_model_ready("classifier") is False
        with pytest.raises(InferenceServerException) as info:
            client.is_model_ready("other")
        assert str(info.value.status()) == "StatusCode.NOT_FOUND"
        assert "unknown model 'other'" in (info.value.message() or "")
        client.close()
    finally:
        loop_thread.run(server.stop(None))


# --- 3. error bodies are application/json like the answers ----------------------------------


def test_errors_have_the_answers_content_type(sidecar: RunningSidecar) -> None:
    root = f"http://127.0.0.1:{sidecar.server.metrics_port}"
    status, kind, _ = get(f"{root}/v2/models/{served_name(sidecar)}/ready")
    assert (status, kind) == (200, "application/json")
    for path in ("/v2/models/guess/ready", "/v2/no/such/route", "/v2/models/guess"):
        status, kind, body = get(root + path)
        assert (status, kind) == (404, "application/json") and body["error"], path
    status, kind, body = post_raw(
        sidecar.server.metrics_port,
        f"/v2/models/{served_name(sidecar)}/infer",
        b'{"inputs": []}',
        {"Content-Type": "application/json"},
    )
    assert (status, kind) == (400, "application/json") and body["error"]


# --- 4. raw_input_contents and typed contents together ---------------------------------------


def test_raw_input_contents_with_typed_contents_is_invalid(sidecar: RunningSidecar) -> None:
    channel = grpc.insecure_channel(sidecar.target)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    tensor = text_tensor(["x"])
    tensor.contents.bytes_contents.append(b"a dull, boring, lifeless mess")
    request = pb.ModelInferRequest(
        model_name=served_name(sidecar),
        inputs=[tensor],
        raw_input_contents=[oip.encode_bytes([b"a gorgeous movie"])],
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents" in (info.value.details() or "")
    channel.close()


# --- 5. binary data after the last binary input --------------------------------------------------


def test_binary_data_after_the_last_input_is_refused(sidecar: RunningSidecar) -> None:
    name = served_name(sidecar)
    blob = oip.encode_bytes([b"a gorgeous movie"])
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "shape": [1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(blob)},
                }
            ],
            "outputs": [{"name": "label"}],
        }
    ).encode()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    path = f"/v2/models/{name}/infer"
    port = sidecar.server.metrics_port
    trailing = header + blob + struct.pack("<I", 9) + b"forgotten"
    status, _, body = post_raw(port, path, trailing, headers)
    assert status == 400 and "unexpected additional input data" in body["error"]
    # Bytes after a JSON-only request's header, too.
    json_only = json.dumps(
        {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["fine"]}]}
    ).encode()
    status, _, body = post_raw(
        port,
        path,
        json_only + b"junk",
        {**headers, "Inference-Header-Content-Length": str(len(json_only))},
    )
    assert status == 400 and "unexpected additional input data" in body["error"]
    status, _, body = post_raw(port, path, header + blob, headers)
    assert status == 200 and body["outputs"][0]["name"] == "label"


def test_an_input_with_data_and_binary_data_size_says_so(sidecar: RunningSidecar) -> None:
    body = {
        "inputs": [
            {
                "name": "text",
                "shape": [1],
                "datatype": "BYTES",
                "data": ["fine"],
                "parameters": {"binary_data_size": 8},
            }
        ]
    }
    status, _, answer = post_raw(
        sidecar.server.metrics_port,
        f"/v2/models/{served_name(sidecar)}/infer",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 400
    assert "both 'data' and the parameter binary_data_size" in answer["error"]


# --- 6. the HTTP port's extensions and /v2/ ------------------------------------------------------


def test_server_metadata_at_v2_and_v2_slash_lists_binary_tensor_data(
    sidecar: RunningSidecar,
) -> None:
    root = f"http://127.0.0.1:{sidecar.server.metrics_port}"
    for path in ("/v2", "/v2/"):
        status, _, body = get(root + path)
        assert status == 200 and body["name"] == "limelight", path
        assert "binary_tensor_data" in body["extensions"], path
    client = tgrpc.InferenceServerClient(sidecar.target)
    extensions = list(client.get_server_metadata().extensions)
    client.close()
    assert "binary_tensor_data" not in extensions  # gRPC has raw_*_contents instead
    assert body["extensions"] == [*extensions, "binary_tensor_data"]


# --- 7. output parameters the server does not honour; outputs asked for twice ------------------


def _texts(module: Any, texts: list[str]) -> Any:
    tensor = module.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return tensor


@pytest.mark.parametrize("module", [thttp, tgrpc], ids=["http", "grpc"])
def test_class_count_is_refused_not_ignored(sidecar: RunningSidecar, module: Any) -> None:
    url = sidecar.target if module is tgrpc else f"127.0.0.1:{sidecar.server.metrics_port}"
    client = module.InferenceServerClient(url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.infer(
                served_name(sidecar),
                [_texts(module, ["a gorgeous movie", "dull"])],
                outputs=[module.InferRequestedOutput("probabilities", class_count=1)],
            )
        assert str(info.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
        assert "'classification'" in (info.value.message() or "")
        # Asked for twice: refused on both ports alike.
        with pytest.raises(InferenceServerException) as info:
            client.infer(
                served_name(sidecar),
                [_texts(module, ["fine"])],
                outputs=[module.InferRequestedOutput("label") for _ in range(2)],
            )
        assert str(info.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
        assert "output 'label' is requested twice" in (info.value.message() or "")
        # binary_data (tritonclient's HTTP outputs always carry it) is still taken.
        result = client.infer(
            served_name(sidecar),
            [_texts(module, ["fine"])],
            outputs=[module.InferRequestedOutput("label")],
        )
        assert result.as_numpy("label")[0] in (b"rotten", b"fresh")
    finally:
        client.close()


def test_shared_memory_output_parameters_are_refused(sidecar: RunningSidecar) -> None:
    body = {
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["fine"]}],
        "outputs": [{"name": "label", "parameters": {"shared_memory_region": "r0"}}],
    }
    status, _, answer = post_raw(
        sidecar.server.metrics_port,
        f"/v2/models/{served_name(sidecar)}/infer",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 400 and "'shared_memory_region'" in answer["error"]
