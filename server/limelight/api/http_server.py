"""The sidecar's HTTP port: Prometheus ``/metrics``, the Open Inference Protocol v2 over REST and
KServe's v1 ``:predict`` / ``:explain`` routes, on one aiohttp server.

Message conversion only: v2 tensors go through ``limelight.api.oip`` (the same path as the gRPC
``ModelInfer``), v1 instances through ``ExplanationService.explain_batch``; both end in
``ExplanationService.explain``. Errors are ``{"error": message}`` with the HTTP status of their
kind (``limelight.api.errors``). With bearer tokens configured every inference and metadata
route needs ``Authorization: Bearer <token>``; ``/metrics`` and the health routes stay open.

Triton's binary tensor extension is supported both ways: a request whose JSON header length is
in ``Inference-Header-Content-Length`` carries its inputs (``binary_data_size``) after the JSON;
outputs are returned in binary when asked for (``binary_data`` per output or
``binary_data_output`` for the request).

The web explanation viewer (``limelight.api.viewer``) adds its page and JSON routes under
``/viewer`` unless ``viewer_enabled`` is false.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from limelight import tracing
from limelight.api import oip
from limelight.api.auth import TokenStore, bearer_allowed
from limelight.api.errors import INTERNAL_MESSAGE, http_status_for
from limelight.api.http_body import close_if_unread, parse_json, read_body
from limelight.api.viewer import Viewer
from limelight.core.service import ExplanationService
from limelight.core.types import ExplainInput, Explanation, scored_tokens
from limelight.errors import (
    InvalidArgument,
    LimelightError,
    Unauthenticated,
    Unavailable,
    ends_the_caller,
)
from limelight.metrics import Metrics
from limelight.settings import Settings

log = logging.getLogger(__name__)

HEADER_LENGTH = "Inference-Header-Content-Length"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (unknown route, wrong method, body too large) as JSON too."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # Its headers too: a 405 must say which methods the route takes (Allow).
        allow = exc.headers.get("Allow")
        response = _error(exc.status, exc.text or exc.reason, {"Allow": allow} if allow else None)
    close_if_unread(request, response)
    return response


# --- v2 JSON <-> tensors ----------------------------------------------------------------------


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        return [x for item in data for x in _flatten(item)]
    return [data]


def _json_input(item: Any, binary: memoryview, offset: int) -> tuple[oip.Tensor, int]:
    if not isinstance(item, Mapping):
        raise InvalidArgument("each input must be an object with name, shape, datatype, data")
    name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise InvalidArgument("each input needs a string 'name' and 'datatype'")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        raise InvalidArgument(f"input {name!r} needs 'shape', a list of integers")
    parameters = item.get("parameters") or {}
    size = parameters.get("binary_data_size") if isinstance(parameters, Mapping) else None
    if size is not None:
        if not isinstance(size, int) or size < 0 or offset + size > len(binary):
            raise InvalidArgument(f"input {name!r}: binary_data_size is out of range")
        raw = bytes(binary[offset : offset + size])
        return oip.tensor_from_raw(name, datatype, shape, raw), offset + size
    if "data" not in item:
        raise InvalidArgument(f"input {name!r} has no 'data'")
    values = _flatten(item["data"])
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise InvalidArgument(f"input {name!r}: BYTES data must be strings")
        try:
            data = np.array([v.encode() for v in values], dtype=object)
        except UnicodeEncodeError:  # a lone surrogate escaped in the JSON ("\\ud800")
            raise InvalidArgument(f"input {name!r}: BYTES data is not valid Unicode") from None
    elif datatype in oip.NUMPY_DTYPES:
        try:
            data = np.array(values, dtype=oip.NUMPY_DTYPES[datatype])
        except (TypeError, ValueError, OverflowError):
            raise InvalidArgument(f"input {name!r}: data does not fit {datatype}") from None
    else:
        raise InvalidArgument(f"input {name!r}: unknown datatype {datatype!r}")
    return oip.Tensor(name, datatype, shape, data), offset


def infer_request(
    model_name: str, version: str, body: Any, binary: bytes
) -> tuple[oip.InferRequest, dict[str, bool], bool]:
    """The request, the outputs asked for in binary, and whether binary is the default."""
    if not isinstance(body, Mapping):
        raise InvalidArgument("the request body must be a JSON object")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidArgument("the request needs 'inputs', a non-empty list")
    parameters = body.get("parameters")
    if parameters is None:  # absent or null; [] or "" are mistakes, not "no parameters"
        parameters = {}
    if not isinstance(parameters, Mapping):
        raise InvalidArgument("'parameters' must be an object")
    view = memoryview(binary)
    tensors: list[oip.Tensor] = []
    offset = 0
    for item in inputs:
        tensor, offset = _json_input(item, view, offset)
        tensors.append(tensor)
    requested = body.get("outputs")
    names: list[str] | None = None
    binary_outputs: dict[str, bool] = {}  # an output's own binary_data, where it says
    if requested is not None:
        if not isinstance(requested, list) or not all(
            isinstance(o, Mapping) and isinstance(o.get("name"), str) for o in requested
        ):
            raise InvalidArgument("'outputs' must be a list of objects with a 'name'")
        names = [o["name"] for o in requested]
        if not all(isinstance(o.get("parameters") or {}, Mapping) for o in requested):
            raise InvalidArgument("an output's 'parameters' must be an object")
        binary_outputs = {
            o["name"]: choice
            for o in requested
            if isinstance(choice := (o.get("parameters") or {}).get("binary_data"), bool)
        }
    request_id = body.get("id", "")
    request = oip.InferRequest(
        model_name=model_name,
        model_version=version,
        id=request_id if isinstance(request_id, str) else str(request_id),
        parameters=dict(parameters),
        inputs=tensors,
        outputs=names,
    )
    return request, binary_outputs, parameters.get("binary_data_output") is True


def _json_data(tensor: oip.Tensor) -> list[Any]:
    flat = tensor.data.reshape(-1)
    if tensor.datatype == "BYTES":
        return [bytes(x).decode("utf-8", errors="replace") for x in flat]
    return [x.item() for x in flat]


def infer_response(
    response: oip.InferResponse, binary_outputs: Mapping[str, bool], binary_default: bool
) -> web.Response:
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for tensor in response.outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": tensor.shape,
        }
        # An output's own binary_data wins over the request's binary_data_output (Triton's
        # binary tensor extension).
        if binary_outputs.get(tensor.name, binary_default):
            raw = oip.tensor_to_raw(tensor)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = _json_data(tensor)
        outputs.append(entry)
    body: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "outputs": outputs,
    }
    if response.id:
        body["id"] = response.id
    header = json.dumps(body).encode()
    if not blobs:
        return web.Response(body=header, content_type="application/json")
    return web.Response(
        body=header + b"".join(blobs),
        content_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(header))},
    )


def metadata_json(meta: oip.ModelMetadata) -> dict[str, Any]:
    def tensors(items: Sequence[oip.TensorMetadata]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": t.shape} for t in items]

    return {
        "name": meta.name,
        "versions": meta.versions,
        "platform": meta.platform,
        "inputs": tensors(meta.inputs),
        "outputs": tensors(meta.outputs),
        "properties": meta.properties,
    }


# --- KServe v1 --------------------------------------------------------------------------------


def v1_inputs(body: Any) -> list[ExplainInput]:
    """``{"instances": ["text" | {"text": ..., "text_pair": ...}, ...], "parameters": {...}}``."""
    if not isinstance(body, Mapping) or not isinstance(body.get("instances"), list):
        raise InvalidArgument("the request body must be {'instances': [...]}")
    instances = body["instances"]
    if not instances:
        raise InvalidArgument("'instances' is empty")
    parameters = body.get("parameters")
    if parameters is None:  # absent or null; [] or "" are mistakes, not "no parameters"
        parameters = {}
    if not isinstance(parameters, Mapping):
        raise InvalidArgument("'parameters' must be an object")
    method, target = oip.method_and_target(parameters)  # the same parameters as v2
    inputs = []
    for instance in instances:
        if isinstance(instance, str):
            text, pair = instance, None
        elif isinstance(instance, Mapping) and isinstance(instance.get("text"), str):
            text, pair = instance["text"], instance.get("text_pair")
            if pair is not None and not isinstance(pair, str):
                raise InvalidArgument("'text_pair' must be a string")
        else:
            raise InvalidArgument("each instance is a string or {'text': ..., 'text_pair': ...}")
        inputs.append(ExplainInput(text=text, text_pair=pair, target=target, method=method))
    return inputs


def v1_prediction(e: Explanation) -> dict[str, Any]:
    return {
        "label": e.label,
        "label_index": e.label_index,
        "probabilities": dict(zip(e.labels, e.probabilities, strict=True)),
        # Multi-label: every label over its threshold (probabilities are then sigmoids).
        "predicted_labels": list(e.predicted_labels),
        # Cut at the token limit (the rest unread), or read whole in this many windows.
        "truncated": e.truncated,
        "windows": e.windows,
    }


def v1_explanation(e: Explanation) -> dict[str, Any]:
    a = e.attribution
    answer = {
        **v1_prediction(e),
        "method": a.method,
        "target_label": a.target_label,
        "target_index": a.target_index,
        "tokens": scored_tokens(e.tokens, a.scores.tolist()),
    }
    if e.multi_label:
        # The predicted labels after the first, as Explain's label_explanations and the CLI's
        # JSON carry them; their scores follow "tokens" (the same tokens, not repeated).
        answer["label_explanations"] = [
            {
                "method": other.method,
                "target_label": other.target_label,
                "target_index": other.target_index,
                "scores": other.scores.tolist(),
            }
            for other in e.label_attributions
        ]
    return answer


# --- the server -------------------------------------------------------------------------------


class HttpServer:
    """Routes and lifecycle of the HTTP port; ``service`` returns None until the model loads."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        service: Callable[[], ExplanationService | None],
        tokens: Iterable[bytes] = (),
        version: str = "",
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._service = service
        # A TokenStore stays live (the tokens file re-read when it changes, auth on whenever a
        # file is configured, even one without tokens yet); anything else is a fixed list.
        self._tokens = tokens if isinstance(tokens, TokenStore) else list(tokens)
        self._version = version
        self._runner: web.AppRunner | None = None
        # When each keep-alive connection is to be closed (max_connection_age_s).
        self._connection_limits: weakref.WeakKeyDictionary[asyncio.BaseTransport, float] = (
            weakref.WeakKeyDictionary()
        )
        self.port = 0

    def ready_service(self) -> ExplanationService:
        service = self._service()
        if service is None:
            raise Unavailable("the model is still loading")
        return service

    def _ready(self) -> bool:
        service = self._service()
        return service is not None and service.ready

    # --- plumbing: auth, metrics and errors in one place ---------------------------------------

    def _route(self, rpc: str, handler: Handler, protected: bool = True) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            start = time.monotonic()
            code = "OK"
            in_flight = self.metrics.requests_in_flight.labels(rpc)
            in_flight.inc()
            attributes = {"http.request.method": request.method, "url.path": request.path}
            with tracing.server_span(f"HTTP {rpc}", request.headers, attributes) as span:
                try:
                    if (
                        protected
                        and bool(self._tokens)
                        and not bearer_allowed(self._tokens, request.headers.get("Authorization"))
                    ):
                        raise Unauthenticated(
                            "missing or invalid bearer token (send 'Authorization: Bearer <token>')"
                        )
                    return await handler(request)
                except LimelightError as exc:
                    code = exc.kind.name
                    return _error(http_status_for(exc.kind), exc.message)
                except web.HTTPException as exc:  # e.g. 413 from aiohttp: a body over the limit
                    code = "RESOURCE_EXHAUSTED" if exc.status == 413 else "INVALID_ARGUMENT"
                    raise
                except ConnectionResetError:
                    # The client closed its connection before its body was read: its hang-up,
                    # not a fault (re-raised, aiohttp would log it as one). No one reads this.
                    code = "CANCELLED"
                    return _error(400, "the connection closed before the request was read")
                except BaseException as exc:
                    if ends_the_caller(exc):
                        raise
                    log.exception("unexpected error in HTTP %s", rpc)
                    code = "INTERNAL"
                    return _error(500, INTERNAL_MESSAGE)
                finally:
                    in_flight.dec()
                    tracing.set_status(span, code)
                    elapsed = time.monotonic() - start
                    self.metrics.request_duration.labels(rpc, code).observe(elapsed)

        return wrapped

    async def _json(self, request: web.Request) -> tuple[Any, bytes]:
        """The JSON body, and the binary data after it (Triton's binary tensor extension)."""
        body = await read_body(request)
        length = request.headers.get(HEADER_LENGTH)
        if length is not None:
            # isascii: str.isdigit() also takes "²", which int() refuses.
            if not (length.isascii() and length.isdigit()) or int(length) > len(body):
                raise InvalidArgument(f"{HEADER_LENGTH} is not a valid length")
            body, binary = body[: int(length)], body[int(length) :]
        else:
            binary = b""
        return parse_json(body), binary

    # --- handlers -------------------------------------------------------------------------------

    async def metrics_page(self, request: web.Request) -> web.StreamResponse:
        body = self.metrics.exposition()
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def live(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"live": True})

    async def ready(self, request: web.Request) -> web.StreamResponse:
        ready = self._ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def server_metadata(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "name": oip.SERVER_NAME,
                "version": self._version,
                "extensions": oip.SERVER_EXTENSIONS,
            }
        )

    def _model(self, request: web.Request) -> ExplanationService:
        service = self.ready_service()
        info = service.model_info()
        oip.check_model(info, request.match_info["name"], request.match_info.get("version", ""))
        return service

    async def model_ready(self, request: web.Request) -> web.StreamResponse:
        self._model(request)
        ready = self._ready()
        body = {"name": request.match_info["name"], "ready": ready}
        return web.json_response(body, status=200 if ready else 503)

    async def model_metadata(self, request: web.Request) -> web.StreamResponse:
        info = self._model(request).model_info()
        return web.json_response(metadata_json(oip.model_metadata(info)))

    async def infer(self, request: web.Request) -> web.StreamResponse:
        service = self._model(request)  # a wrong model is named before a bad body
        body, binary = await self._json(request)
        parsed, binary_outputs, binary_default = infer_request(
            request.match_info["name"], request.match_info.get("version", ""), body, binary
        )
        response = await oip.infer(service, parsed, None)
        return infer_response(response, binary_outputs, binary_default)

    async def v1_models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"models": [self.ready_service().model_info().name]})

    async def v1_model(self, request: web.Request) -> web.StreamResponse:
        self._model(request)
        ready = self._ready()
        body = {"name": request.match_info["name"], "ready": ready}
        return web.json_response(body, status=200 if ready else 503)

    async def v1_predict(self, request: web.Request) -> web.StreamResponse:
        service = self._model(request)
        body, _ = await self._json(request)
        results = await service.explain_batch(v1_inputs(body))
        return web.json_response({"predictions": [v1_prediction(e) for e in results]})

    async def v1_explain(self, request: web.Request) -> web.StreamResponse:
        service = self._model(request)
        body, _ = await self._json(request)
        results = await service.explain_batch(v1_inputs(body))
        return web.json_response({"explanations": [v1_explanation(e) for e in results]})

    @web.middleware
    async def _connection_age(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """``Connection: close`` on a keep-alive connection older than ``max_connection_age_s``
        (from its first request, ±10 %) and on every answer while the sidecar is not ready
        (loading or draining): the client's next request opens a new connection, which the
        load balancer may give to another replica (HTTP's counterpart of gRPC's GOAWAY)."""
        response = await handler(request)
        transport = request.transport
        if response.prepared or transport is None:
            return response
        if not self._ready():
            response.force_close()
        elif self.settings.max_connection_age_s is not None:
            limit = self._connection_limits.get(transport)
            now = time.monotonic()
            if limit is None:
                age = self.settings.max_connection_age_s * random.uniform(0.9, 1.1)
                self._connection_limits[transport] = limit = now + age
            if now >= limit:
                response.force_close()
        return response

    def application(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_message_bytes,
            middlewares=[_json_errors, self._connection_age],
        )
        r = self._route
        model = "/v2/models/{name}"
        version = "/v2/models/{name}/versions/{version}"
        v1 = "/v1/models/{name:[^/:]+}"
        app.add_routes(
            [
                web.get("/metrics", self.metrics_page),
                web.get("/v2/health/live", r("v2.ServerLive", self.live, protected=False)),
                web.get("/v2/health/ready", r("v2.ServerReady", self.ready, protected=False)),
                web.get("/v2", r("v2.ServerMetadata", self.server_metadata)),
                web.get(model, r("v2.ModelMetadata", self.model_metadata)),
                web.get(version, r("v2.ModelMetadata", self.model_metadata)),
                web.get(f"{model}/ready", r("v2.ModelReady", self.model_ready, protected=False)),
                web.get(f"{version}/ready", r("v2.ModelReady", self.model_ready, protected=False)),
                web.post(f"{model}/infer", r("v2.ModelInfer", self.infer)),
                web.post(f"{version}/infer", r("v2.ModelInfer", self.infer)),
                web.get("/v1/models", r("v1.models", self.v1_models)),
                web.get(v1, r("v1.model", self.v1_model, protected=False)),
                web.post(f"{v1}:predict", r("v1.predict", self.v1_predict)),
                web.post(f"{v1}:explain", r("v1.explain", self.v1_explain)),
            ]
        )
        if self.settings.viewer_enabled:
            viewer = Viewer(self.settings, self._service, self._version, bool(self._tokens))
            viewer.add_to(app, r)
        return app

    async def start(self, host: str, port: int, context: ssl.SSLContext | None = None) -> int:
        runner = web.AppRunner(self.application(), access_log=None, handle_signals=False)
        await runner.setup()
        # Several workers (``reuse_port``) share the HTTP port as they share the gRPC port.
        site = web.TCPSite(
            runner,
            host,
            port,
            ssl_context=context,
            reuse_address=True,
            reuse_port=self.settings.reuse_port,
        )
        await site.start()
        self._runner = runner
        addresses = runner.addresses
        self.port = int(addresses[0][1]) if addresses else port
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
