"""The HTTP port: OIP v2 REST (Triton's HTTP client, binary and JSON tensors), KServe v1
``:predict``/``:explain``, JSON errors, bearer tokens and /metrics, against a real sidecar."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from limelight_client import Client
from tests.conftest import RunningSidecar

TEXTS = ["a gorgeous, witty, seductive movie", "the plot is thin and the acting is worse"]


def base_url(sidecar: RunningSidecar) -> str:
    return f"127.0.0.1:{sidecar.server.metrics_port}"


def model_name(sidecar: RunningSidecar) -> str:
    assert sidecar.settings.model_dir is not None
    return sidecar.settings.model_dir.name


@pytest.fixture
def triton(sidecar: RunningSidecar) -> Iterator[thttp.InferenceServerClient]:
    client = thttp.InferenceServerClient(url=base_url(sidecar))
    yield client
    client.close()


def call(
    url: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def text_input(texts: list[str], binary: bool, name: str = "text") -> thttp.InferInput:
    tensor = thttp.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object), binary)
    return tensor


def test_health_and_metadata(sidecar: RunningSidecar, triton: thttp.InferenceServerClient) -> None:
    name = model_name(sidecar)
    assert triton.is_server_live() and triton.is_server_ready() and triton.is_model_ready(name)
    assert not triton.is_model_ready("no-such-model")
    assert triton.get_server_metadata()["name"] == "limelight"
    meta = triton.get_model_metadata(name)
    assert meta["platform"] == "limelight"
    assert {o["name"] for o in meta["outputs"]} >= {"probabilities", "tokens", "attributions"}
    assert meta["properties"]["labels"] == "rotten,fresh"
    # The gRPC port's ServerMetadata extensions (both serve the properties), and the binary
    # tensor extension, which only this port has.
    from tritonclient import grpc as tgrpc

    grpc_client = tgrpc.InferenceServerClient(sidecar.target)
    assert triton.get_server_metadata()["extensions"] == [
        *grpc_client.get_server_metadata().extensions,
        "binary_tensor_data",
    ]
    grpc_client.close()


def test_an_outputs_own_binary_data_wins_over_the_requests_default(sidecar: RunningSidecar) -> None:
    # Triton's binary tensor extension: binary_data_output sets the default, an output's own
    # binary_data (true or false) decides for it.
    body = {
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["fine"]}],
        "parameters": {"binary_data_output": True},
        "outputs": [
            {"name": "label", "parameters": {"binary_data": False}},
            {"name": "probabilities"},
        ],
    }
    request = urllib.request.Request(
        f"http://{base_url(sidecar)}/v2/models/{model_name(sidecar)}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        length = int(response.headers["Inference-Header-Content-Length"])
        header = json.loads(response.read()[:length])
    outputs = {o["name"]: o for o in header["outputs"]}
    assert outputs["label"]["data"] == ["rotten"] or outputs["label"]["data"] == ["fresh"]
    assert "data" not in outputs["probabilities"]
    assert outputs["probabilities"]["parameters"]["binary_data_size"] == 8


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_equals_explain(
    sidecar: RunningSidecar, triton: thttp.InferenceServerClient, binary: bool
) -> None:
    outputs = [
        thttp.InferRequestedOutput(n, binary_data=binary)
        for n in ("probabilities", "label", "tokens", "token_offsets", "attributions", "num_tokens")
    ]
    result = triton.infer(
        model_name(sidecar), [text_input(TEXTS, binary)], outputs=outputs, request_id="r-7"
    )
    assert result.get_response()["id"] == "r-7"
    with Client(sidecar.target, timeout=30) as client:
        for row, text in enumerate(TEXTS):
            expected = client.explain(text)
            n = int(result.as_numpy("num_tokens")[row])
            label = result.as_numpy("label")[row]
            assert (label.decode() if isinstance(label, bytes) else label) == expected.label
            assert list(result.as_numpy("probabilities")[row]) == pytest.approx(
                [expected.probabilities[k] for k in expected.labels], abs=1e-5
            )
            tokens = [
                t.decode() if isinstance(t, bytes) else t
                for t in result.as_numpy("tokens")[row, :n]
            ]
            assert tokens == [t.text for t in expected.tokens]
            offsets = result.as_numpy("token_offsets")[row, :n]
            assert [tuple(int(x) for x in o) for o in offsets] == [
                (t.start, t.end) for t in expected.tokens
            ]
            assert list(result.as_numpy("attributions")[row, :n]) == pytest.approx(
                expected.scores, rel=1e-4, abs=1e-5
            )


def test_default_outputs_and_parameters(
    sidecar: RunningSidecar, triton: thttp.InferenceServerClient
) -> None:
    # No outputs requested: tritonclient asks for all of them in binary.
    result = triton.infer(
        model_name(sidecar),
        [text_input(["the plot is thin"], True)],
        parameters={"target": "fresh"},
    )
    assert result.as_numpy("target_label")[0] == b"fresh"
    assert result.as_numpy("attributions").dtype == np.float32


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, "BYTES"),
        (
            {
                "inputs": [
                    {"name": "text", "shape": [1, 2], "datatype": "BYTES", "data": ["a", "b"]}
                ]
            },
            "shape",
        ),
        (
            {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a"]}]},
            "elements",
        ),
        (
            {"inputs": [{"name": "text_pair", "shape": [1], "datatype": "BYTES", "data": ["a"]}]},
            "missing input",
        ),
        ({"inputs": []}, "inputs"),
        (
            {
                "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}],
                "parameters": {"target_index": 9},
            },
            "out of range",
        ),
        ([1, 2], "JSON object"),
        (
            {
                "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}],
                "parameters": [],
            },
            "'parameters' must be an object",
        ),
    ],
    ids=["datatype", "shape", "count", "missing", "empty", "target", "not-object", "parameters"],
)
def test_bad_v2_requests_are_400(sidecar: RunningSidecar, body: Any, fragment: str) -> None:
    status, error = call(f"http://{base_url(sidecar)}/v2/models/{model_name(sidecar)}/infer", body)
    assert status == 400 and fragment in error["error"]
    # Still serving.
    ok = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["fine"]}]}
    status, body_ok = call(f"http://{base_url(sidecar)}/v2/models/{model_name(sidecar)}/infer", ok)
    assert status == 200 and body_ok["outputs"][0]["name"] == "probabilities"


def test_errors_through_tritonclient(
    sidecar: RunningSidecar, triton: thttp.InferenceServerClient
) -> None:
    with pytest.raises(InferenceServerException) as info:
        triton.infer("no-such-model", [text_input(["fine"], True)])
    assert info.value.status() == "404" and "unknown model" in info.value.message()
    bad = thttp.InferInput("text", [1], "INT32")
    bad.set_data_from_numpy(np.array([3], dtype=np.int32))
    with pytest.raises(InferenceServerException) as info:
        triton.infer(model_name(sidecar), [bad])
    assert info.value.status() == "400"


def test_a_wrong_model_is_named_before_a_bad_body(sidecar: RunningSidecar) -> None:
    """The model in the path is the first mistake to report: a body written for another
    server would otherwise be answered with its own faults, not that it went to the wrong one."""
    for body in ({}, {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES"}]}):
        status, error = call(f"http://{base_url(sidecar)}/v2/models/no-such-model/infer", body)
        assert status == 404 and "unknown model 'no-such-model'" in error["error"]
        status, error = call(
            f"http://{base_url(sidecar)}/v2/models/{model_name(sidecar)}/versions/0/infer", body
        )
        assert status == 404 and "unknown version '0'" in error["error"]


def test_malformed_json_and_unknown_route(sidecar: RunningSidecar) -> None:
    url = f"http://{base_url(sidecar)}/v2/models/{model_name(sidecar)}/infer"
    request = urllib.request.Request(url, data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400 and "not valid JSON" in json.loads(info.value.read())["error"]
    status, _ = call(f"http://{base_url(sidecar)}/v2/models/no-such-model")
    assert status == 404


def test_kserve_v1_predict_and_explain(sidecar: RunningSidecar) -> None:
    root = f"http://{base_url(sidecar)}/v1/models/{model_name(sidecar)}"
    status, ready = call(root)
    assert status == 200 and ready["ready"] is True
    status, predicted = call(f"{root}:predict", {"instances": TEXTS})
    assert status == 200 and len(predicted["predictions"]) == 2
    status, explained = call(
        f"{root}:explain",
        {
            "instances": [{"text": "a man sleeps", "text_pair": "a person rests"}, TEXTS[0]],
            "parameters": {"target": "rotten"},
        },
    )
    assert status == 200
    with Client(sidecar.target, timeout=30) as client:
        first = client.explain("a man sleeps", text_pair="a person rests", target="rotten")
        second = client.explain(TEXTS[0])
    e = explained["explanations"][0]
    assert e["label"] == first.label and e["target_label"] == "rotten"
    assert [t["text"] for t in e["tokens"]] == [t.text for t in first.tokens]
    assert [t["score"] for t in e["tokens"]] == pytest.approx(first.scores, rel=1e-4, abs=1e-5)
    assert predicted["predictions"][0]["label"] == second.label
    assert predicted["predictions"][0]["probabilities"] == pytest.approx(second.probabilities)
    for body, code in (
        ({"instances": []}, 400),
        ({"instances": [3]}, 400),
        ({"rows": ["x"]}, 400),
        ({"instances": ["x"], "parameters": {"method": "slalom"}}, 400),
        ({"instances": ["x"], "parameters": []}, 400),
        ({"instances": ["x"], "parameters": None}, 200),
    ):
        assert call(f"{root}:predict", body)[0] == code
    assert (
        call(f"http://{base_url(sidecar)}/v1/models/other:explain", {"instances": ["x"]})[0] == 404
    )


def test_metrics_on_the_same_port_pass_promtool(sidecar: RunningSidecar) -> None:
    call(
        f"http://{base_url(sidecar)}/v2/models/{model_name(sidecar)}/infer",
        {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["fine"]}]},
    )
    with urllib.request.urlopen(sidecar.metrics_url, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        body = response.read().decode()
    assert 'limelight_request_duration_seconds_count{code="OK",rpc="v2.ModelInfer"}' in body
    if shutil.which("promtool"):
        lint = subprocess.run(
            ["promtool", "check", "metrics"], input=body, capture_output=True, text=True
        )
        assert lint.returncode == 0, lint.stdout + lint.stderr


def test_bearer_tokens_guard_inference_not_health_or_metrics(
    start_sidecar: Any, bert_tiny_dir: Any
) -> None:
    running = start_sidecar(model_dir=bert_tiny_dir, auth_token="s3cret", jobs="off")
    root = f"http://127.0.0.1:{running.server.metrics_port}"
    name = bert_tiny_dir.name
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["fine"]}]}
    assert call(f"{root}/v2/health/ready")[0] == 200
    assert call(f"{root}/v2/models/{name}/ready")[0] == 200
    status, error = call(f"{root}/v2/models/{name}/infer", body)
    assert status == 401 and "bearer token" in error["error"]
    assert call(f"{root}/v2/models/{name}", headers={"Authorization": "Bearer nope"})[0] == 401
    assert call(f"{root}/v1/models/{name}:predict", {"instances": ["fine"]})[0] == 401
    auth = {"Authorization": "Bearer s3cret"}
    assert call(f"{root}/v2/models/{name}/infer", body, headers=auth)[0] == 200
    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as response:
        assert response.status == 200


def test_model_name_setting_names_the_served_model(start_sidecar: Any, bert_tiny_dir: Any) -> None:
    running = start_sidecar(model_dir=bert_tiny_dir, model_name="classifier", jobs="off")
    root = f"http://127.0.0.1:{running.server.metrics_port}"
    assert call(f"{root}/v1/models")[1] == {"models": ["classifier"]}
    assert call(f"{root}/v2/models/classifier/ready")[0] == 200
    assert call(f"{root}/v2/models/{bert_tiny_dir.name}/ready")[0] == 404


def test_aiohttp_errors_are_json_too(sidecar: RunningSidecar) -> None:
    root = f"http://{base_url(sidecar)}"
    status, error = call(f"{root}/v2/no/such/route")
    assert status == 404 and error["error"]
    too_big = {
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x" * 5_000_000]}]
    }
    status, error = call(f"{root}/v2/models/{model_name(sidecar)}/infer", too_big)
    assert status == 413 and error["error"]
    assert call(f"{root}/v2/health/ready")[0] == 200
