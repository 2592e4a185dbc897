"""A request of more texts than ``max_batch_request_items`` is refused before its texts are
converted one by one: a million empty texts in 4 MiB held the event loop (and every other call
on both ports, and the liveness probe) for 3–10 s before the refusal."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from limelight.api import http_server, oip, oip_grpc, servicer
from limelight.errors import InvalidArgument
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from limelight_client.proto import open_inference_grpc_pb2 as oip_pb
from tests.conftest import RunningSidecar


def test_an_explain_batch_over_the_limit_converts_none_of_its_inputs(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    converted: list[Any] = []
    convert = servicer._input_or_failed

    def counted(*args: Any) -> Any:
        converted.append(args)
        return convert(*args)

    monkeypatch.setattr(servicer, "_input_or_failed", counted)
    running = start_sidecar(model_dir=bert_tiny_dir, max_batch_request_items=4, jobs="off")
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(running.target))
    too_many = pb.ExplainBatchRequest(requests=[pb.ExplainRequest(text="")] * 5000)
    with pytest.raises(grpc.RpcError) as refused:
        stub.ExplainBatch(too_many, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "5000 inputs in one call; at most 4" in (refused.value.details() or "")
    assert converted == []
    ok = stub.ExplainBatch(pb.ExplainBatchRequest(requests=[pb.ExplainRequest(text="fine")]))
    assert ok.responses[0].label and len(converted) == 1


def test_kserve_v1_instances_over_the_limit_are_refused_before_conversion() -> None:
    with pytest.raises(InvalidArgument, match=r"'instances' holds 5 texts; at most 4"):
        http_server.v1_inputs({"instances": [""] * 5}, max_items=4)
    assert len(http_server.v1_inputs({"instances": ["a"] * 4}, max_items=4)) == 4


def bytes_tensor(count: int) -> bytes:
    return b"".join(struct.pack("<I", 1) + b"x" for _ in range(count))


def test_oip_bytes_tensors_over_the_limit_are_refused_before_decoding() -> None:
    # Declared: the shape says it, whatever the data.
    with pytest.raises(InvalidArgument, match=r"input 'text' holds 1,000 texts; at most 4"):
        oip.tensor_from_raw("text", "BYTES", [1000], bytes_tensor(1), max_items=4)
    # Found: a shape that lies is caught as the elements are counted, not after them all.
    with pytest.raises(InvalidArgument, match=r"holds at least 5 texts; at most 4"):
        oip.decode_bytes(bytes_tensor(100_000), max_items=4)
    assert len(oip.decode_bytes(bytes_tensor(4), max_items=4)) == 4
    # HTTP: JSON data, and binary data after the JSON.
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [5], "data": ["a"] * 5}]}
    with pytest.raises(InvalidArgument, match="at most 4"):
        http_server.infer_request("m", "", body, b"", max_items=4)
    body["inputs"][0]["shape"] = [1]  # the data's own length counts too
    with pytest.raises(InvalidArgument, match="holds 5 texts; at most 4"):
        http_server.infer_request("m", "", body, b"", max_items=4)
    # gRPC: typed contents (whatever the shape) and raw contents.
    typed = oip_pb.ModelInferRequest(model_name="m")
    tensor = typed.inputs.add(name="text", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.extend([b"a"] * 5)
    with pytest.raises(InvalidArgument, match="holds 5 texts; at most 4"):
        oip_grpc.infer_request(typed, max_items=4)
    raw = oip_pb.ModelInferRequest(model_name="m", raw_input_contents=[bytes_tensor(6)])
    raw.inputs.add(name="text", datatype="BYTES", shape=[6])
    with pytest.raises(InvalidArgument, match="holds 6 texts; at most 4"):
        oip_grpc.infer_request(raw, max_items=4)
