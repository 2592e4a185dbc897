"""The sidecar's HTTP port: Prometheus ``/metrics``, the Open Inference Protocol v2 over REST and
KServe's v1 ``:predict`` / ``:explain`` routes, on one aiohttp server.

Message conversion only: v2 tensors go through ``limelight.api.oip`` (the same path as the gRPC
``ModelInfer``), v1 instances through ``ExplanationService.explain_batch``; both end in
``ExplanationService.explain``. Errors are ``{"error": message}`` with the HTTP status of their
kind (``limelight.api.errors``), ``Content-Type: application/json`` like the answers (kserve's
REST client reads the message under exactly that type). With bearer tokens configured every
inference and metadata route needs ``Authorization: Bearer <token>``; ``/metrics`` and the
health and readiness routes stay open (a model readiness call without an accepted token is not
told the served model's name). While the model loads, the readiness of the name it will be
served under (``oip.configured_model_name``) is 503 ``{"name", "ready": false}``.

Triton's binary tensor extension is supported both ways: a request whose JSON header length is
in ``Inference-Header-Content-Length`` carries its inputs (``binary_data_size``) after the JSON;
outputs are returned in binary when asked for (``binary_data`` per output or
``binary_data_output`` for the request). Bytes after the last binary input are refused, as is an
input with both ``data`` and ``binary_data_size``.

The web explanation viewer (``limelight.api.viewer``) adds its page and JSON routes under
``/viewer`` unless ``viewer_enabled`` is false.

Browsers reach this port too (the viewer; any page a developer opens while a sidecar runs on
their machine), so it guards against other sites:

- DNS rebinding: bound to a loopback address (the default), it answers only requests whose
  ``Host`` is ``localhost``, an IP address (``127.0.0.1``, ``[::1]``; any port) or a name listed
  in ``http_allowed_hosts``; others get 403. Bound to another address (``0.0.0.0`` in a
  container, behind Services whose names are arbitrary) any ``Host`` is served unless
  ``http_allowed_hosts`` lists some names.
- Cross-site posts: a POST body must be declared JSON (``application/json``; the v2 ``infer``
  route also takes ``application/octet-stream``, what Triton's aio client sends) or get 415, so
  that no page can post here without the CORS preflight the port never grants. A body that
  declares no type, or curl's and urllib's default ``application/x-www-form-urlencoded``, is
  taken from non-browser clients (Triton's HTTP client sends none): only a request without an
  ``Origin`` header, which every browser sends with a POST. The viewer's routes take JSON only.
- A malformed request (a header line over 8,190 bytes, a bad ``Content-Length``) is answered
  400 by aiohttp, which would log it as an ERROR with a traceback quoting the request's bytes (a
  bearer token among them): ``MalformedRequests`` turns that into one WARNING line without them,
  at most one a minute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import random
import ssl
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST

from limelight import tracing
from limelight.api import oip
from limelight.api.auth import TokenStore, bearer_allowed
from limelight.api.errors import INTERNAL_MESSAGE, http_status_for
from limelight.api.http_body import (
    BODY_LIMITS,
    BodyLimits,
    close_if_unread,
    parse_json,
    read_body,
)
from limelight.api.log_filters import LibraryLogFilter
from limelight.api.viewer import Viewer
from limelight.api.viewer.routes import principal
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


def json_answer(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """``data`` as JSON, ``Content-Type: application/json`` exactly (no charset parameter: JSON
    is UTF-8), answers and errors alike: kserve's REST client reads an error's ``{"error"}``
    only under exactly that type."""
    return web.Response(
        body=json.dumps(data).encode(),
        status=status,
        headers=headers,
        content_type="application/json",
    )


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return json_answer({"error": message}, status=status, headers=headers)


class MalformedRequests(LibraryLogFilter):
    """aiohttp answers a request it cannot parse (a header line over 8,190 bytes, too many
    headers, a bad ``Content-Length``) with a 400, and logs it as an ERROR with a traceback whose
    message quotes the request's bytes — the start of an over-long ``Authorization`` header is a
    bearer token. Any client can send one, before any auth: that is the client's mistake, not a
    fault of the server. One WARNING line instead (a DEBUG one stays DEBUG) naming the client's
    address and the kind of mistake, never the bytes; at most one line every ``INTERVAL_S``,
    each saying how many were left out since the previous one."""

    LOGGER = "aiohttp.server"
    INTERVAL_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._lock = threading.Lock()  # several servers (threads, loops) share the logger
        self._next: float | None = None
        self._left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = self._clock()
        with self._lock:
            if self._next is not None and now < self._next:
                self._left_out += 1
                return False
            left_out, self._left_out = self._left_out, 0
            self._next = now + self.INTERVAL_S
        args = record.args if isinstance(record.args, tuple) else ()
        client = str(args[0]) if len(args) == 1 else "a client"
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg = "malformed HTTP request from %s refused (%s %s)%s"
        record.args = (
            client,
            exc.code or 400,
            type(exc).__name__,
            f"; {left_out} more since the last such line" if left_out else "",
        )
        record.exc_info = record.exc_text = record.stack_info = None
        return True


# --- which requests are served: Host and body types -------------------------------------------

#: The names of the local machine a browser never asks DNS for (besides loopback IP literals).
LOOPBACK_NAMES = frozenset({"localhost"})


def host_name(value: str) -> str:
    """The host of a ``Host`` header (or a configured name), lower case, without its port or
    an IPv6 literal's brackets: ``[::1]:9464`` is ``::1``, ``Example.com:80`` ``example.com``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        name, _, port = value.partition(":")
        if port.isdigit() or not port:
            return name
    return value


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name from ``host_name`` or a bind address) is the local machine
    only: ``localhost`` or a loopback IP literal (``127.0.0.0/8``, ``::1``)."""
    address = _ip(host)
    return host in LOOPBACK_NAMES or (address is not None and address.is_loopback)


def host_allowed(header: str | None, bind_host: str, allowed: Sequence[str]) -> bool:
    """Whether a request with ``Host: header`` is served by a port bound to ``bind_host``.

    DNS rebinding: a page whose name an attacker re-points at 127.0.0.1 is, to the browser,
    the same origin as the sidecar, but its requests still say ``Host: <its name>``. So with
    ``allowed`` (``http_allowed_hosts``) empty, a port bound to a loopback address serves
    ``localhost`` and IP literals only (a page whose origin is an IP address was loaded from
    that address: no name to re-point) and one bound to another address any host. With names
    listed, those are served too, wherever the port is bound, and no others (``*``: any). No
    ``Host`` at all (an HTTP/1.0 client) is not a browser's request: served."""
    if header is None:
        return True
    host = host_name(header)
    names = {host_name(a) for a in allowed}
    if "*" in names or host in names or host in LOOPBACK_NAMES or _ip(host) is not None:
        return True
    return not names and not is_loopback(host_name(bind_host))


@dataclasses.dataclass(frozen=True)
class BodyTypes:
    """The media types a POST route takes (``Content-Type``, parameters aside).
    ``undeclared``: also a body without a type or with curl's and urllib's default form type,
    from a request without an ``Origin`` header (no browser: every browser sends one with a
    POST)."""

    accepted: tuple[str, ...]
    undeclared: bool = True

    def refusal(self, request: web.Request) -> str | None:
        """Why the request's body is refused (a 415), or None."""
        declared = request.headers.get("Content-Type", "").strip()
        media = request.content_type if declared else ""
        if media in self.accepted:
            return None
        browser = "Origin" in request.headers
        if self.undeclared and not browser and media in ("", "application/x-www-form-urlencoded"):
            return None
        said = f"Content-Type {media!r}" if media else "a body without a Content-Type"
        return (
            f"{said} is not accepted here: send the body as {' or '.join(self.accepted)} "
            "(the only types a web page on another site cannot post without a CORS preflight)"
        )


JSON_BODIES = BodyTypes(("application/json",))
#: Triton's binary tensor extension: its aio client sends application/octet-stream.
V2_BODIES = BodyTypes(("application/json", "application/octet-stream"))
#: The viewer's own page always sends application/json.
VIEWER_BODIES = BodyTypes(("application/json",), undeclared=False)


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


def _json_input(
    item: Any, binary: memoryview, offset: int, max_items: int | None = None
) -> tuple[oip.Tensor, int]:
    if not isinstance(item, Mapping):
        raise InvalidArgument("each input must be an object with name, shape, datatype, data")
    name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise InvalidArgument("each input needs a string 'name' and 'datatype'")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        raise InvalidArgument(f"input {name!r} needs 'shape', a list of integers")
    oip.check_items(name, shape, max_items)
    parameters = item.get("parameters") or {}
    size = parameters.get("binary_data_size") if isinstance(parameters, Mapping) else None
    if size is not None:
        if "data" in item:
            raise InvalidArgument(
                f"input {name!r} has both 'data' and the parameter binary_data_size: give its "
                "data one way, in the JSON or after it, not both"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidArgument(f"input {name!r}: binary_data_size must be a byte count")
        if offset + size > len(binary):
            raise InvalidArgument(
                f"input {name!r}: binary_data_size is out of range ({size} bytes from byte "
                f"{offset} of {len(binary)} bytes of binary data after the JSON)"
            )
        raw = bytes(binary[offset : offset + size])
        return oip.tensor_from_raw(name, datatype, shape, raw, max_items), offset + size
    if "data" not in item:
        raise InvalidArgument(f"input {name!r} has no 'data'")
    if isinstance(item["data"], list) and max_items is not None and len(item["data"]) > max_items:
        raise oip.too_many_items(len(item["data"]), max_items, f"input {name!r}")
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
    model_name: str, version: str, body: Any, binary: bytes, max_items: int | None = None
) -> tuple[oip.InferRequest, dict[str, bool], bool]:
    """The request, the outputs asked for in binary, and whether binary is the default; an
    input of more than ``max_items`` texts is refused before its texts are converted."""
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
        tensor, offset = _json_input(item, view, offset, max_items)
        tensors.append(tensor)
    if offset != len(binary):
        raise InvalidArgument(
            f"unexpected additional input data for model {model_name!r}: {len(binary) - offset} "
            "bytes after the last input's binary_data_size"
        )
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
        for o in requested:
            oip.check_output_parameters(o["name"], o.get("parameters") or {})
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


def v1_inputs(body: Any, max_items: int | None = None) -> list[ExplainInput]:
    """``{"instances": ["text" | {"text": ..., "text_pair": ...}, ...], "parameters": {...}}``;
    more than ``max_items`` instances are refused before any is converted."""
    if not isinstance(body, Mapping) or not isinstance(body.get("instances"), list):
        raise InvalidArgument("the request body must be {'instances': [...]}")
    instances = body["instances"]
    if not instances:
        raise InvalidArgument("'instances' is empty")
    if max_items is not None and len(instances) > max_items:
        raise oip.too_many_items(len(instances), max_items, "'instances'")
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
        # Where the port is bound (``start`` says): which Host headers it serves.
        self._bind_host = settings.host
        # The name the model will be served under (worked out on first need).
        self._expected_name: str | None = None
        self._expected_known = False

    def ready_service(self) -> ExplanationService:
        service = self._service()
        if service is None:
            raise Unavailable("the model is still loading")
        return service

    def _ready(self) -> bool:
        service = self._service()
        return service is not None and service.ready

    # --- plumbing: auth, metrics and errors in one place ---------------------------------------

    def _route(
        self,
        rpc: str,
        handler: Handler,
        protected: bool = True,
        bodies: BodyTypes | None = None,
    ) -> Handler:
        """``handler`` behind bearer-token auth (``protected``), with its metrics, trace span
        and errors; a POST whose body is not one of ``bodies`` is refused (415)."""

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
                    if bodies is not None and request.method == "POST":
                        refusal = bodies.refusal(request)
                        if refusal is not None:
                            raise web.HTTPUnsupportedMediaType(text=refusal)
                    return await handler(request)
                except LimelightError as exc:
                    code = exc.kind.name
                    service = self._service()
                    message = service.redact(exc.message) if service is not None else exc.message
                    return _error(http_status_for(exc.kind), message)
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
            length = length.strip()
            # isascii: str.isdigit() also takes "²", which int() refuses.
            if not (length.isascii() and length.isdigit()):
                raise InvalidArgument(
                    f"{HEADER_LENGTH} is not a valid length (the JSON header's size in bytes)"
                )
            # Compared by its digits first: int() refuses over 4,300 of them (ValueError).
            digits = length.lstrip("0") or "0"
            if len(digits) > len(str(len(body))) or int(digits) > len(body):
                raise InvalidArgument(
                    f"{HEADER_LENGTH} is larger than the request body ({len(body)} bytes)"
                )
            body, binary = body[: int(digits)], body[int(digits) :]
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
        return json_answer({"live": True})

    async def ready(self, request: web.Request) -> web.StreamResponse:
        ready = self._ready()
        return json_answer({"ready": ready}, status=200 if ready else 503)

    async def server_metadata(self, request: web.Request) -> web.StreamResponse:
        return json_answer(
            {
                "name": oip.SERVER_NAME,
                "version": self._version,
                "extensions": oip.HTTP_SERVER_EXTENSIONS,
            }
        )

    def _model(self, request: web.Request) -> ExplanationService:
        service = self.ready_service()
        info = service.model_info()
        oip.check_model(info, request.match_info["name"], request.match_info.get("version", ""))
        return service

    def _configured_name(self) -> str | None:
        """The name the model will be served under, known before it loads."""
        if not self._expected_known:
            self._expected_name = oip.configured_model_name(self.settings)
            self._expected_known = True
        return self._expected_name

    def _model_readiness(self, request: web.Request) -> web.StreamResponse:
        """``{"name", "ready"}``: 200 when ready, else 503 (the model still loading, under the
        name it will be served under; not ready to serve). The route is open to anyone (kubelet
        probes): while auth is on, a caller without an accepted token is not told the served
        model's name in a 404."""
        name = request.match_info["name"]
        reveal = not self._tokens or bearer_allowed(
            self._tokens, request.headers.get("Authorization")
        )
        service = self._service()
        expected = self._configured_name() if service is None else None
        if service is None and expected is not None:  # loading
            if name != expected:
                raise oip.unknown_model(name, expected if reveal else None)
            return json_answer({"name": name, "ready": False}, status=503)
        info = self.ready_service().model_info()
        oip.check_model(info, name, request.match_info.get("version", ""), reveal)
        ready = self._ready()
        return json_answer({"name": name, "ready": ready}, status=200 if ready else 503)

    async def model_ready(self, request: web.Request) -> web.StreamResponse:
        return self._model_readiness(request)

    async def model_metadata(self, request: web.Request) -> web.StreamResponse:
        info = self._model(request).model_info()
        return json_answer(metadata_json(oip.model_metadata(info)))

    def _caller(self, request: web.Request) -> str:
        """Who is calling, for its share of the inline backlog: as for gRPC and job ownership."""
        return principal(request, bool(self._tokens))

    async def infer(self, request: web.Request) -> web.StreamResponse:
        service = self._model(request)  # a wrong model is named before a bad body
        body, binary = await self._json(request)
        parsed, binary_outputs, binary_default = infer_request(
            request.match_info["name"],
            request.match_info.get("version", ""),
            body,
            binary,
            self.settings.max_batch_request_items,
        )
        response = await oip.infer(service, parsed, None, self._caller(request))
        return infer_response(response, binary_outputs, binary_default)

    async def v1_models(self, request: web.Request) -> web.StreamResponse:
        return json_answer({"models": [self.ready_service().model_info().name]})

    async def v1_model(self, request: web.Request) -> web.StreamResponse:
        return self._model_readiness(request)

    async def v1_predict(self, request: web.Request) -> web.StreamResponse:
        service = self._model(request)
        body, _ = await self._json(request)
        limit = self.settings.max_batch_request_items
        results = await service.explain_batch(v1_inputs(body, limit), self._caller(request))
        return json_answer({"predictions": [v1_prediction(e) for e in results]})

    async def v1_explain(self, request: web.Request) -> web.StreamResponse:
        service = self._model(request)
        body, _ = await self._json(request)
        limit = self.settings.max_batch_request_items
        results = await service.explain_batch(v1_inputs(body, limit), self._caller(request))
        return json_answer({"explanations": [v1_explanation(e) for e in results]})

    @web.middleware
    async def _hosts(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """403 for a request whose ``Host`` this port does not serve (``host_allowed``)."""
        header = request.headers.get("Host")
        allowed = self.settings.http_allowed_hosts
        if host_allowed(header, self._bind_host, allowed):
            return await handler(request)
        names = ", ".join(["localhost", *allowed, "an IP address (127.0.0.1, [::1], ...)"])
        return _error(
            403,
            f"this port does not serve the host name {host_name(header or '')[:100]!r} (a "
            f"guard against DNS rebinding): it is bound to {self._bind_host} and answers "
            f"requests for {names} only; list the name you use in LIMELIGHT_HTTP_ALLOWED_HOSTS "
            "(a JSON list, e.g. '[\"viewer.example.com\"]'), or bind another address "
            "(LIMELIGHT_HOST)",
        )

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
            middlewares=[self._hosts, _json_errors, self._connection_age],
        )
        app[BODY_LIMITS] = BodyLimits(
            self.settings.http_body_timeout_s, asyncio.Semaphore(self.settings.http_max_body_reads)
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
                # The REST spec's path is /v2/ (its table says v2): both are served.
                web.get("/v2", r("v2.ServerMetadata", self.server_metadata)),
                web.get("/v2/", r("v2.ServerMetadata", self.server_metadata)),
                web.get(model, r("v2.ModelMetadata", self.model_metadata)),
                web.get(version, r("v2.ModelMetadata", self.model_metadata)),
                web.get(f"{model}/ready", r("v2.ModelReady", self.model_ready, protected=False)),
                web.get(f"{version}/ready", r("v2.ModelReady", self.model_ready, protected=False)),
                web.post(f"{model}/infer", r("v2.ModelInfer", self.infer, bodies=V2_BODIES)),
                web.post(f"{version}/infer", r("v2.ModelInfer", self.infer, bodies=V2_BODIES)),
                web.get("/v1/models", r("v1.models", self.v1_models)),
                web.get(v1, r("v1.model", self.v1_model, protected=False)),
                web.post(f"{v1}:predict", r("v1.predict", self.v1_predict, bodies=JSON_BODIES)),
                web.post(f"{v1}:explain", r("v1.explain", self.v1_explain, bodies=JSON_BODIES)),
            ]
        )
        if self.settings.viewer_enabled:
            viewer = Viewer(self.settings, self._service, self._version, bool(self._tokens))
            # Its POST routes take JSON only (what its page sends); its GET routes no body.
            viewer.add_to(
                app, lambda rpc, handler, protected: r(rpc, handler, protected, VIEWER_BODIES)
            )
        return app

    async def start(self, host: str, port: int, context: ssl.SSLContext | None = None) -> int:
        MalformedRequests.install()  # once per process: the logger is aiohttp's, shared
        self._bind_host = host
        runner = web.AppRunner(
            self.application(),
            access_log=None,
            handle_signals=False,
            keepalive_timeout=self.settings.http_keepalive_timeout_s,
        )
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
