"""OpenTelemetry tracing, off by default and configured only by the standard ``OTEL_*`` variables.

Tracing turns on when ``OTEL_TRACES_EXPORTER`` is ``otlp`` or an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), unless
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``. Spans go over OTLP/gRPC; the exporter
reads its endpoint, headers, TLS and timeout from the same variables, the resource from
``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (service name default ``limelight``). The
incoming W3C ``traceparent`` (gRPC metadata or HTTP header) becomes the parent of the server span.
Without tracing the helpers here cost a dictionary lookup.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagate import extract, inject
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from limelight.errors import LimelightError

log = logging.getLogger(__name__)

TRACER_NAME = "limelight"
_provider: Any = None
_exporter: Any = None

#: The OTEL_* values this sidecar honours; others of these variables are reported at start.
_EXPORTERS = {"otlp", "none", ""}
_PROTOCOLS = {"grpc", ""}


def tracing_requested(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")}
    if "none" in exporters:
        return False
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return "otlp" in exporters or bool(endpoint)


def unsupported_settings(environ: Mapping[str, str] | None = None) -> list[str]:
    """The standard ``OTEL_*`` values that ask for something this sidecar does not do (another
    exporter, OTLP over HTTP): without a word they looked like a collector that received
    nothing."""
    env = os.environ if environ is None else environ
    found = []
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")}
    if exporters - _EXPORTERS:
        found.append(
            f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']} (only otlp and none are "
            "supported; other exporters export nothing)"
        )
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(name, "").strip().lower()
        if not protocol:
            continue
        if protocol not in _PROTOCOLS:
            found.append(
                f"{name}={env[name]} (spans go over OTLP/gRPC only: point the endpoint "
                "at the collector's gRPC port, usually 4317)"
            )
        break  # the traces-specific one, when set, wins: the other is not read
    return found


def setup_tracing(environ: Mapping[str, str] | None = None) -> bool:
    """Install the OTLP/gRPC exporter when the environment asks for it; idempotent."""
    global _provider, _exporter
    if _provider is not None:
        return True
    for unsupported in unsupported_settings(environ):
        log.warning("tracing: %s", unsupported)
    if not tracing_requested(environ):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": "limelight"}).merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    # Our own provider, not the process-global one: a restarted server (or an embedding
    # application with its own tracing) gets a fresh exporter.
    _provider, _exporter = provider, exporter
    log.info("OpenTelemetry tracing on (OTLP/gRPC)")
    return True


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Flush and stop the exporter (at server stop), within ``timeout_s``: the SDK's own
    shutdown waits up to 30 s on a collector that does not answer, retrying, which overran a
    pod's grace period. Spans still unsent then are dropped, with a warning."""
    global _provider, _exporter
    provider, exporter = _provider, _exporter
    _provider = _exporter = None
    if provider is None:
        return
    stopping = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
    stopping.start()
    stopping.join(timeout_s)
    if stopping.is_alive():
        exporter.shutdown(timeout_millis=0)  # ends the export's retries, and the thread
        log.warning(
            "tracing: spans not exported within %.1f s of the stop were dropped (the OTLP "
            "collector does not answer)",
            timeout_s,
        )


def current_context() -> dict[str, str]:
    """The current trace context as W3C headers (``traceparent``), to store with a job."""
    if _provider is None:
        return {}
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier


@contextmanager
def job_span(method: str, job_id: str, carrier: Mapping[str, str]) -> Iterator[Span]:
    """A CONSUMER span for one job run, child of the request that submitted it (the context
    travels with the job through the SQLite journal or the Redis stream). Its outcome is set by
    the caller (``job_outcome``): no exception is recorded here, since its message may name
    server paths and its stack trace is the server log's business."""
    if _provider is None:
        yield trace.INVALID_SPAN
        return
    attributes = {"limelight.job.id": job_id, "limelight.job.method": method}
    with tracer().start_as_current_span(
        f"job {method}",
        context=extract(dict(carrier)),
        kind=SpanKind.CONSUMER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield span


#: The final job states a job span reports as an error (a user's cancel, a hand-back: not).
_JOB_ERRORS = {"failed", "timed_out"}


def job_outcome(span: Span, state: str, error: str = "") -> None:
    """Record a job run's outcome on its span: ``limelight.job.outcome`` is the final state
    (``succeeded``, ``failed``, ``timed_out``, ``cancelled``, ``requeued``, ``lost``); failed
    and timed-out runs are errors, with ``error`` (already redacted for clients) as the
    description and an event without a stack trace."""
    if not span.is_recording():
        return
    span.set_attribute("limelight.job.outcome", state)
    if state in _JOB_ERRORS:
        span.set_status(Status(StatusCode.ERROR, error or state))
        if error:
            span.add_event("job failed", {"limelight.job.error": error})
    else:
        span.set_status(Status(StatusCode.OK))


def span_context() -> Any:
    """The current span's context (to link a batch to its requests); None when tracing is off."""
    if _provider is None:
        return None
    context = trace.get_current_span().get_span_context()
    # An unsampled span is exported by no one: a link to it points nowhere, and a batch that
    # serves only unsampled requests is not to be traced either (see ``inline_batch``).
    return context if context.is_valid and context.trace_flags.sampled else None


@contextmanager
def inline_batch(request_contexts: Sequence[Any], tokens: int) -> Iterator[Span]:
    """An ``inline batch`` span linked to the requests it serves, with a ``forward`` child.

    A micro-batch serves many requests from many traces, so it starts its own trace and links
    to each request's span (the OpenTelemetry pattern for batches). Only sampled requests are
    linked, and a batch that serves none has no span: the caller's or the sampler's "not
    sampled" holds for the work done for it too."""
    links = [Link(c) for c in request_contexts if c is not None and c.trace_flags.sampled]
    if _provider is None or not links:
        yield trace.INVALID_SPAN
        return
    attributes = {"limelight.batch.size": len(request_contexts), "limelight.batch.tokens": tokens}
    with (
        tracer().start_as_current_span(
            "inline batch", context=Context(), links=links, attributes=attributes
        ),
        tracer().start_as_current_span("forward") as forward,
    ):
        yield forward


@contextmanager
def input_span(
    carrier: Mapping[str, str],
    request_id: str = "",
    redact: Callable[[str], str] | None = None,
) -> Iterator[Span]:
    """A SERVER span ``explain input`` for one input of a stream or batch that carries its
    caller's trace context (``carrier``, W3C headers): a child of that caller, linked to the
    span of the call that carried it (one stream may carry the inputs of many callers). The
    span is current inside, so the micro-batch that serves the input links to it; an error
    leaving it is recorded as the gRPC status code its own call would have had, and its message
    (through ``redact``, as its caller is told it) as an event without a stack trace."""
    if _provider is None or not carrier:
        yield trace.INVALID_SPAN
        return
    call = span_context()
    attributes = {"limelight.request_id": request_id} if request_id else {}
    token = otel_context.attach(extract({k.lower(): v for k, v in carrier.items()}))
    try:
        with tracer().start_as_current_span(
            "explain input",
            kind=SpanKind.SERVER,
            links=[Link(call)] if call is not None else [],
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield span
            except BaseException as exc:
                set_status(span, status_name(exc))
                error_event(span, exc, redact)
                raise
            set_status(span, "OK")
    finally:
        otel_context.detach(token)


def error_event(span: Span, exc: BaseException, redact: Callable[[str], str] | None = None) -> None:
    """An ``exception`` event without a stack trace or a message a client would not read: a
    Limelight error's message through ``redact`` (none given: the type only), anything else by
    its type (its message and traceback are in the server log)."""
    if not span.is_recording():
        return
    attributes = {"exception.type": type(exc).__name__}
    if isinstance(exc, LimelightError) and redact is not None:
        attributes["exception.message"] = redact(exc.message)
    span.add_event("exception", attributes)


def status_name(exc: BaseException) -> str:
    """The gRPC status code name a call failing with ``exc`` gets (``limelight.api.errors``
    maps the same kinds); anything outside the error hierarchy is INTERNAL."""
    if isinstance(exc, LimelightError):
        return exc.kind.name
    return "CANCELLED" if isinstance(exc, asyncio.CancelledError) else "INTERNAL"


def flush(timeout_s: float = 30.0) -> bool:
    """Export the spans ended so far (tests, and before a worker exits)."""
    return True if _provider is None else bool(_provider.force_flush(int(timeout_s * 1000)))


def enabled() -> bool:
    return _provider is not None


def tracer() -> trace.Tracer:
    if _provider is None:
        return trace.NoOpTracer()
    tracer: trace.Tracer = _provider.get_tracer(TRACER_NAME)
    return tracer


@contextmanager
def server_span(
    name: str, carrier: Mapping[str, str], attributes: Mapping[str, Any] | None = None
) -> Iterator[Span]:
    """A SERVER span for one request, child of the caller's ``traceparent`` if it sent one."""
    if _provider is None:
        yield trace.INVALID_SPAN
        return
    parent = extract({k.lower(): v for k, v in carrier.items()})
    token = otel_context.attach(parent)
    try:
        # The status comes from the call's status code (``set_status``), not from whatever
        # exception left (an abort is "AbortError: Locally aborted."); no exception event.
        with tracer().start_as_current_span(
            name,
            kind=SpanKind.SERVER,
            attributes=dict(attributes or {}),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            yield span
    finally:
        otel_context.detach(token)


def start_server_span(
    name: str, carrier: Mapping[str, str], attributes: Mapping[str, Any] | None = None
) -> Span:
    """A started SERVER span like ``server_span``'s, not made current: for a streaming call,
    whose generator may be closed from another task (a client that stops reading), where a
    context attached across a ``yield`` could not be detached. Make it current around each
    step with ``current(span)``; the caller ends it."""
    if _provider is None:
        return trace.INVALID_SPAN
    parent = extract({k.lower(): v for k, v in carrier.items()})
    return tracer().start_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=dict(attributes or {})
    )


@contextmanager
def current(span: Span) -> Iterator[Span]:
    """``span`` is the current span inside (attached and detached in the same context)."""
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield span
    finally:
        otel_context.detach(token)


def set_status(span: Span, code: str) -> None:
    """Record the outcome (a gRPC status code name) on a span."""
    if not span.is_recording():
        return
    span.set_attribute("rpc.grpc.status_code_name", code)
    if code not in ("OK", "CANCELLED", "NOT_FOUND", "INVALID_ARGUMENT"):
        span.set_status(Status(StatusCode.ERROR, code))
