"""``inference.GRPCInferenceService`` (Open Inference Protocol v2) on the sidecar's gRPC port.

Message conversion only: tensors go through ``limelight.api.oip`` to the core service, and the
calls share ``ExplainerServicer``'s guard (metrics per RPC, errors mapped in one place). Outputs
are returned as ``raw_output_contents`` like Triton does; inputs may come either way.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np

from limelight.api import oip
from limelight.api.auth import caller_trusted, principal
from limelight.api.servicer import ExplainerServicer, check_request, request_deadline, safe_parser
from limelight.errors import InvalidArgument
from limelight_client.proto import open_inference_grpc_pb2 as pb

SERVICE_NAME = "inference.GRPCInferenceService"


def _parameter(value: Any) -> Any:
    kind = value.WhichOneof("parameter_choice")
    return getattr(value, kind) if kind is not None else None


def _parameters(values: Any) -> dict[str, Any]:
    return {key: _parameter(value) for key, value in values.items()}


_CONTENT_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _input_tensor(message: Any, raw: bytes | None, max_items: int | None = None) -> oip.Tensor:
    shape = list(message.shape)
    oip.check_items(message.name, shape, max_items)
    if raw is not None:
        # The spec: with raw_input_contents, no input's contents may be specified.
        if message.HasField("contents") and message.contents.ListFields():
            raise InvalidArgument(
                f"input {message.name!r} has typed contents while the request has "
                "raw_input_contents: give the inputs' data one way, not both"
            )
        return oip.tensor_from_raw(message.name, message.datatype, shape, raw, max_items)
    field = _CONTENT_FIELDS.get(message.datatype)
    if field is None:
        raise InvalidArgument(
            f"input {message.name!r}: datatype {message.datatype!r} has no typed contents field"
        )
    contents = getattr(message.contents, field)
    if max_items is not None and len(contents) > max_items:  # whatever the shape declares
        raise oip.too_many_items(len(contents), max_items, f"input {message.name!r}")
    values = list(contents)
    dtype = object if message.datatype == "BYTES" else oip.NUMPY_DTYPES[message.datatype]
    try:
        # Typed contents are wider than the datatype (int_contents carries INT8 as int32).
        data = np.array(values, dtype=dtype)
    except (OverflowError, TypeError, ValueError):
        raise InvalidArgument(
            f"input {message.name!r}: data does not fit {message.datatype}"
        ) from None
    return oip.Tensor(message.name, message.datatype, shape, data)


def infer_request(message: Any, max_items: int | None = None) -> oip.InferRequest:
    """The request; an input of more than ``max_items`` texts is refused before conversion."""
    raw = list(message.raw_input_contents)
    if raw and len(raw) != len(message.inputs):
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries for {len(message.inputs)} inputs"
        )
    for output in message.outputs:
        oip.check_output_parameters(output.name, _parameters(output.parameters))
    return oip.InferRequest(
        model_name=message.model_name,
        model_version=message.model_version,
        id=message.id,
        parameters=_parameters(message.parameters),
        inputs=[
            _input_tensor(t, raw[i] if raw else None, max_items)
            for i, t in enumerate(message.inputs)
        ],
        outputs=[o.name for o in message.outputs] or None,
    )


def infer_response(response: oip.InferResponse) -> pb.ModelInferResponse:
    return pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=response.model_version,
        id=response.id,
        outputs=[
            pb.ModelInferResponse.InferOutputTensor(name=t.name, datatype=t.datatype, shape=t.shape)
            for t in response.outputs
        ],
        raw_output_contents=[oip.tensor_to_raw(t) for t in response.outputs],
    )


def metadata_response(meta: oip.ModelMetadata) -> pb.ModelMetadataResponse:
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=meta.name,
        versions=meta.versions,
        platform=meta.platform,
        inputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.inputs],
        outputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.outputs],
        properties=meta.properties,
    )


class InferenceServicer:
    """The six OIP v2 RPCs, sharing the Explainer servicer's service, guard and metrics.

    ``model_name``: the name the model will be served under (``oip.configured_model_name``),
    known before it loads: ModelReady for it answers ready=false while the model loads (any
    other name is NOT_FOUND). None: ModelReady is UNAVAILABLE while the model loads."""

    def __init__(
        self, explainer: ExplainerServicer, version: str, model_name: str | None = None
    ) -> None:
        self._explainer = explainer
        self._version = version
        self._model_name = model_name

    def _ready(self) -> bool:
        service = self._explainer.service
        return service is not None and service.ready

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.ServerLiveResponse:
            return pb.ServerLiveResponse(live=True)

        return await self._explainer._guard("ServerLive", context, call)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.ServerReadyResponse:
            return pb.ServerReadyResponse(ready=self._ready())

        return await self._explainer._guard("ServerReady", context, call)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.ModelReadyResponse:
            check_request(request)
            # Open to anyone (kubelet probes): names the served model only to a trusted caller.
            reveal = caller_trusted()
            service = self._explainer.service
            if service is None and self._model_name is not None:  # loading
                if request.name != self._model_name:
                    raise oip.unknown_model(request.name, self._model_name if reveal else None)
                return pb.ModelReadyResponse(ready=False)
            service = self._explainer.ready_service()
            oip.check_model(service.model_info(), request.name, request.version, reveal)
            return pb.ModelReadyResponse(ready=self._ready())

        return await self._explainer._guard("ModelReady", context, call)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.ServerMetadataResponse:
            return pb.ServerMetadataResponse(
                name=oip.SERVER_NAME, version=self._version, extensions=oip.SERVER_EXTENSIONS
            )

        return await self._explainer._guard("ServerMetadata", context, call)

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.ModelMetadataResponse:
            check_request(request)
            info = self._explainer.ready_service().model_info()
            oip.check_model(info, request.name, request.version)
            return metadata_response(oip.model_metadata(info))

        return await self._explainer._guard("ModelMetadata", context, call)

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.ModelInferResponse:
            check_request(request)
            service = self._explainer.ready_service()
            # a wrong model is named before the inputs' faults
            oip.check_model(service.model_info(), request.model_name, request.model_version)
            parsed = infer_request(request, service.settings.max_batch_request_items)
            response = await oip.infer(
                service, parsed, request_deadline(context), principal(context)
            )
            return infer_response(response)

        return await self._explainer._guard("ModelInfer", context, call)


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register with parsers that never raise (a malformed message is INVALID_ARGUMENT)."""
    rpcs: dict[str, tuple[Any, Any]] = {
        "ServerLive": (pb.ServerLiveRequest, pb.ServerLiveResponse),
        "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse),
        "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse),
        "ServerMetadata": (pb.ServerMetadataRequest, pb.ServerMetadataResponse),
        "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=safe_parser(req),
            response_serializer=resp.SerializeToString,
        )
        for name, (req, resp) in rpcs.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
