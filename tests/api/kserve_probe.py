"""Drive a running sidecar with the ``kserve`` package's inference clients; print JSON results.

Run as a separate process by ``test_oip_kserve.py``: kserve and tritonclient both register the
``inference.*`` protobuf names in the default descriptor pool, so they cannot share a process.

    python tests/api/kserve_probe.py GRPC_TARGET HTTP_URL MODEL TEXT...
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import grpc
import httpx
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.infer_type import InferResponse


def _texts_input(texts: list[str], binary: bool, name: str = "text") -> InferInput:
    tensor = InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object), binary)
    return tensor


def _outputs(response: InferResponse) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for output in response.outputs:
        array = output.as_numpy()
        if array.dtype == object:
            array = np.vectorize(lambda x: x.decode() if isinstance(x, bytes) else str(x))(array)
        result[output.name] = array.tolist()
    return result


async def _grpc(target: str, model: str, texts: list[str]) -> dict[str, Any]:
    client = InferenceGRPCClient(target, retries=2)
    report: dict[str, Any] = {
        "live": await client.is_server_live(),
        "ready": await client.is_server_ready(),
        "model_ready": await client.is_model_ready(model),
    }
    request = InferRequest(model, [_texts_input(texts, binary=False)], request_id="kserve-grpc")
    report["infer"] = _outputs(await client.infer(request))
    pair = InferRequest(
        model,
        [
            _texts_input(["a man sleeps"], False),
            _texts_input(["a person rests"], False, "text_pair"),
        ],
        parameters={"target": "rotten"},
    )
    report["pair"] = _outputs(await client.infer(pair))
    errors = {}
    for case, bad in {
        "unknown_model": InferRequest("no-such-model", [_texts_input(["x"], False)]),
        "wrong_datatype": InferRequest(model, [InferInput("text", [1], "INT64", data=[3])]),
        "missing_input": InferRequest(model, [_texts_input(["x"], False, "text_pair")]),
    }.items():
        try:
            await client.infer(bad)
            errors[case] = "OK"
        except grpc.RpcError as exc:
            errors[case] = exc.code().name  # type: ignore[attr-defined]
    report["errors"] = errors
    await client.close()
    return report


async def _rest(url: str, model: str, texts: list[str]) -> dict[str, Any]:
    v2 = InferenceRESTClient(RESTConfig(protocol="v2", retries=1))
    report: dict[str, Any] = {
        "live": await v2.is_server_live(url),
        "ready": await v2.is_server_ready(url),
        "model_ready": await v2.is_model_ready(url, model),
    }
    for binary in (False, True):
        request = InferRequest(model, [_texts_input(texts, binary)], request_id="kserve-rest")
        response = await v2.infer(url, request, model_name=model)
        report[f"infer_{'binary' if binary else 'json'}"] = _outputs(response)
    try:
        await v2.infer(url, InferRequest(model, [_texts_input(["x"], False, "nope")]), model)
        report["bad_status"] = 200
    except httpx.HTTPStatusError as exc:
        report["bad_status"] = exc.response.status_code
        # What the user reads: kserve puts the {"error"} text in only under exactly
        # Content-Type application/json.
        report["bad_message"] = str(exc)
    await v2.close()
    v1 = InferenceRESTClient(RESTConfig(protocol="v1", retries=1))
    report["v1_predict"] = await v1.infer(url, {"instances": texts}, model_name=model)
    report["v1_explain"] = await v1.explain(url, model, {"instances": texts})
    try:
        await v1.explain(url, "no-such-model", {"instances": texts})
        report["v1_unknown_status"] = 200
    except httpx.HTTPStatusError as exc:
        report["v1_unknown_status"] = exc.response.status_code
        report["v1_unknown_message"] = str(exc)
    await v1.close()
    return report


async def main(target: str, url: str, model: str, texts: list[str]) -> None:
    report = {"grpc": await _grpc(target, model, texts), "rest": await _rest(url, model, texts)}
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]))
