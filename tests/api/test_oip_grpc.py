"""Open Inference Protocol v2 over gRPC, driven by Triton's own client against a real sidecar."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from limelight_client import Client
from limelight_client.proto import open_inference_grpc_pb2 as pb
from limelight_client.proto import open_inference_grpc_pb2_grpc as pb_grpc
from tests.conftest import RunningSidecar

TEXTS = [
    "a gorgeous, witty, seductive movie",
    "the plot is thin and the acting is worse",
    "fine",
]


@pytest.fixture
def triton(sidecar: RunningSidecar) -> Iterator[tgrpc.InferenceServerClient]:
    client = tgrpc.InferenceServerClient(url=sidecar.target)
    yield client
    client.close()


def model_name(sidecar: RunningSidecar) -> str:
    assert sidecar.settings.model_dir is not None
    return sidecar.settings.model_dir.name


def text_input(texts: list[str], name: str = "text", shape: list[int] | None = None) -> Any:
    data = np.array([t.encode() for t in texts], dtype=object)
    if shape is not None:
        data = data.reshape(shape)
    tensor = tgrpc.InferInput(name, list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    return tensor


def status_of(exc: InferenceServerException) -> str:
    return str(exc.status())


def test_health_and_metadata(sidecar: RunningSidecar, triton: tgrpc.InferenceServerClient) -> None:
    name = model_name(sidecar)
    assert triton.is_server_live()
    assert triton.is_server_ready()
    assert triton.is_model_ready(name)
    server = triton.get_server_metadata(as_json=True)
    assert server["name"] == "limelight" and server["version"]
    meta = triton.get_model_metadata(name, as_json=True)
    assert meta["name"] == name and meta["platform"] == "limelight"
    assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == [
        ("text", "BYTES"),
        ("text_pair", "BYTES"),
    ]
    outputs = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in meta["outputs"]}
    assert outputs["probabilities"] == ("FP32", [-1, 2])
    assert outputs["attributions"] == ("FP32", [-1, -1])
    assert outputs["token_offsets"] == ("INT64", [-1, -1, 2])
    assert outputs["label"][0] == "BYTES"


def test_a_text_cut_at_the_token_limit_says_so(
    sidecar: RunningSidecar, triton: tgrpc.InferenceServerClient
) -> None:
    long = " ".join(["gorgeous"] * (sidecar.settings.max_tokens + 50))
    result = triton.infer(model_name(sidecar), [text_input([long, TEXTS[0]])])
    assert result.as_numpy("truncated").tolist() == [True, False]
    assert result.as_numpy("windows").tolist() == [0, 0]  # truncation=truncate: no windows
    assert int(result.as_numpy("num_tokens")[0]) == sidecar.settings.max_tokens


def test_metadata_properties_document_the_parameters(sidecar: RunningSidecar) -> None:
    # Triton's proto has no ``properties`` field; the OIP one does.
    channel = grpc.insecure_channel(sidecar.target)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    meta = stub.ModelMetadata(pb.ModelMetadataRequest(name=model_name(sidecar)), timeout=10)
    assert meta.properties["labels"] == "rotten,fresh"
    assert "normxlogit" in meta.properties["parameter.method"]
    assert {"parameter.target", "parameter.target_index"} <= set(meta.properties)
    channel.close()


def test_infer_equals_explain(sidecar: RunningSidecar, triton: tgrpc.InferenceServerClient) -> None:
    result = triton.infer(model_name(sidecar), [text_input(TEXTS)], request_id="batch-1")
    assert result.get_response().id == "batch-1"
    probabilities = result.as_numpy("probabilities")
    labels = result.as_numpy("label")
    tokens = result.as_numpy("tokens")
    offsets = result.as_numpy("token_offsets")
    scores = result.as_numpy("attributions")
    counts = result.as_numpy("num_tokens")
    assert probabilities.dtype == np.float32 and probabilities.shape == (3, 2)
    assert scores.dtype == np.float32 and scores.shape == tokens.shape == offsets.shape[:2]
    with Client(sidecar.target, timeout=30) as client:
        for row, text in enumerate(TEXTS):
            expected = client.explain(text)
            n = int(counts[row])
            assert labels[row].decode() == expected.label
            assert result.as_numpy("label_index")[row] == expected.label_index
            assert result.as_numpy("target_label")[row].decode() == expected.target_label
            assert list(probabilities[row]) == pytest.approx(
                [expected.probabilities[k] for k in expected.labels], abs=1e-5
            )
            assert n == len(expected.tokens)
            assert [t.decode() for t in tokens[row, :n]] == [t.text for t in expected.tokens]
            assert [tuple(o) for o in offsets[row, :n]] == [
                (t.start, t.end) for t in expected.tokens
            ]
            assert list(scores[row, :n]) == pytest.approx(expected.scores, rel=1e-4, abs=1e-5)
            # Padding past the row's tokens.
            assert all(t == b"" for t in tokens[row, n:])
            assert (offsets[row, n:] == -1).all() and (scores[row, n:] == 0).all()


def test_shape_n_by_1_text_pairs_and_requested_outputs(
    sidecar: RunningSidecar, triton: tgrpc.InferenceServerClient
) -> None:
    inputs = [
        text_input(["a man sleeps", "a dog barks"], shape=[2, 1]),
        text_input(["a person rests", "a cat meows"], name="text_pair", shape=[2, 1]),
    ]
    outputs = [tgrpc.InferRequestedOutput("label"), tgrpc.InferRequestedOutput("attributions")]
    result = triton.infer(model_name(sidecar), inputs, outputs=outputs)
    assert [o.name for o in result.get_response().outputs] == ["label", "attributions"]
    assert result.as_numpy("probabilities") is None
    with Client(sidecar.target, timeout=30) as client:
        expected = client.explain("a man sleeps", text_pair="a person rests")
    n = len(expected.tokens)
    assert result.as_numpy("label")[0].decode() == expected.label
    assert list(result.as_numpy("attributions")[0, :n]) == pytest.approx(
        expected.scores, rel=1e-4, abs=1e-5
    )


def test_parameters_choose_method_and_target(
    sidecar: RunningSidecar, triton: tgrpc.InferenceServerClient
) -> None:
    text = "the plot is thin but the actors are superb"
    name = model_name(sidecar)
    with Client(sidecar.target, timeout=30) as client:
        expected = client.explain(text, target="rotten", method="normxlogit")
    by_label = triton.infer(
        name, [text_input([text])], parameters={"method": "normxlogit", "target": "rotten"}
    )
    by_index = triton.infer(name, [text_input([text])], parameters={"target_index": 0})
    for result in (by_label, by_index):
        assert result.as_numpy("target_label")[0] == b"rotten"
        assert list(result.as_numpy("attributions")[0]) == pytest.approx(
            expected.scores, rel=1e-4, abs=1e-5
        )


BAD = [
    # (inputs builder, parameters, model, expected status, message fragment)
    ("wrong datatype", "FP32", None, "StatusCode.INVALID_ARGUMENT", "must have datatype BYTES"),
    ("wrong shape", "shape", None, "StatusCode.INVALID_ARGUMENT", "must have shape"),
    ("missing input", "pair-only", None, "StatusCode.INVALID_ARGUMENT", "missing input 'text'"),
    ("unknown input", "extra", None, "StatusCode.INVALID_ARGUMENT", "unknown input 'extra'"),
    ("unknown label", "ok", {"target": "meh"}, "StatusCode.INVALID_ARGUMENT", "unknown label"),
    ("job method", "ok", {"method": "lrp"}, "StatusCode.INVALID_ARGUMENT", "job method"),
    ("empty text", "empty", None, "StatusCode.INVALID_ARGUMENT", "text is empty"),
]


def _bad_inputs(kind: str) -> list[Any]:
    if kind == "FP32":
        tensor = tgrpc.InferInput("text", [2], "FP32")
        tensor.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
        return [tensor]
    if kind == "shape":
        return [text_input(["a", "b", "c", "d"], shape=[2, 2])]
    if kind == "pair-only":
        return [text_input(["a person rests"], name="text_pair")]
    if kind == "extra":
        return [text_input(["fine"]), text_input(["x"], name="extra")]
    if kind == "empty":
        return [text_input(["fine", "  "])]
    return [text_input(["fine"])]


@pytest.mark.parametrize(
    ("case", "kind", "params", "code", "fragment"), BAD, ids=[b[0] for b in BAD]
)
def test_bad_requests_get_protocol_errors(
    sidecar: RunningSidecar,
    triton: tgrpc.InferenceServerClient,
    case: str,
    kind: str,
    params: dict[str, Any] | None,
    code: str,
    fragment: str,
) -> None:
    with pytest.raises(InferenceServerException) as info:
        triton.infer(model_name(sidecar), _bad_inputs(kind), parameters=params)
    assert status_of(info.value) == code
    assert fragment in info.value.message()
    # The server keeps serving.
    assert triton.infer(model_name(sidecar), [text_input(["fine"])]).as_numpy("label") is not None


def test_unknown_model_and_version_are_not_found(
    sidecar: RunningSidecar, triton: tgrpc.InferenceServerClient
) -> None:
    for call in (
        lambda: triton.infer("no-such-model", [text_input(["fine"])]),
        lambda: triton.get_model_metadata("no-such-model"),
        lambda: triton.is_model_ready("no-such-model"),
        lambda: triton.infer(model_name(sidecar), [text_input(["fine"])], model_version="999"),
    ):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert status_of(info.value) == "StatusCode.NOT_FOUND", info.value.message()
    assert triton.is_model_ready(model_name(sidecar))

    # A wrong model is named before the inputs' own faults (here: two raw entries for one).
    stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(sidecar.target))
    tensor = pb.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[1])
    for name, code in (("no-such-model", grpc.StatusCode.NOT_FOUND), (model_name(sidecar), None)):
        request = pb.ModelInferRequest(
            model_name=name, inputs=[tensor], raw_input_contents=[b"", b""]
        )
        with pytest.raises(grpc.RpcError) as failed:
            stub.ModelInfer(request, timeout=30)
        assert failed.value.code() == (code or grpc.StatusCode.INVALID_ARGUMENT)


def test_raw_messages_typed_contents_and_malformed_raw(sidecar: RunningSidecar) -> None:
    """Typed ``bytes_contents`` work like raw inputs; inconsistent raw data is refused."""
    channel = grpc.insecure_channel(sidecar.target)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    name = model_name(sidecar)
    tensor = pb.ModelInferRequest.InferInputTensor
    typed = pb.ModelInferRequest(
        model_name=name,
        inputs=[
            tensor(
                name="text",
                datatype="BYTES",
                shape=[1],
                contents=pb.InferTensorContents(bytes_contents=[b"fine"]),
            )
        ],
    )
    response = stub.ModelInfer(typed, timeout=30)
    assert [o.name for o in response.outputs][:2] == ["probabilities", "label"]
    assert len(response.raw_output_contents) == len(response.outputs)
    bad = [
        pb.ModelInferRequest(  # one raw entry for two inputs
            model_name=name,
            inputs=[
                tensor(name="text", datatype="BYTES", shape=[1]),
                tensor(name="text_pair", datatype="BYTES", shape=[1]),
            ],
            raw_input_contents=[b"\x04\x00\x00\x00fine"],
        ),
        pb.ModelInferRequest(  # length prefix longer than the data
            model_name=name,
            inputs=[tensor(name="text", datatype="BYTES", shape=[1])],
            raw_input_contents=[b"\xff\x00\x00\x00fine"],
        ),
        pb.ModelInferRequest(  # two elements for shape [1]
            model_name=name,
            inputs=[tensor(name="text", datatype="BYTES", shape=[1])],
            raw_input_contents=[b"\x01\x00\x00\x00a\x01\x00\x00\x00b"],
        ),
        pb.ModelInferRequest(  # invalid UTF-8
            model_name=name,
            inputs=[tensor(name="text", datatype="BYTES", shape=[1])],
            raw_input_contents=[b"\x02\x00\x00\x00\xff\xfe"],
        ),
    ]
    # Typed contents wider than their datatype (int_contents carries INT8 and INT16 as int32).
    bad += [
        pb.ModelInferRequest(
            model_name=name,
            inputs=[
                tensor(
                    name="text",
                    datatype=datatype,
                    shape=[1],
                    contents=contents,
                )
            ],
        )
        for datatype, contents in (
            ("INT8", pb.InferTensorContents(int_contents=[-300])),
            ("INT16", pb.InferTensorContents(int_contents=[70_000])),
            ("UINT8", pb.InferTensorContents(uint_contents=[300])),
        )
    ]
    for request in bad:
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    channel.close()


def test_bearer_tokens_guard_infer_but_not_health(start_sidecar: Any, bert_tiny_dir: Any) -> None:
    running = start_sidecar(model_dir=bert_tiny_dir, auth_token="s3cret", jobs="off")
    client = tgrpc.InferenceServerClient(url=running.target)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(bert_tiny_dir.name)
    with pytest.raises(InferenceServerException) as info:
        client.infer(bert_tiny_dir.name, [text_input(["fine"])])
    assert status_of(info.value) == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException):
        client.get_model_metadata(bert_tiny_dir.name)
    ok = client.infer(
        bert_tiny_dir.name, [text_input(["fine"])], headers={"authorization": "Bearer s3cret"}
    )
    assert ok.as_numpy("label")[0] in (b"rotten", b"fresh")
    client.close()
