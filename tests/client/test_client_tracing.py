"""The SDK carries its caller's trace context: in each call's metadata, and for streamed single
calls in each input (the pooled stream was opened by another call, so its metadata cannot); a
gRPC instrumentation installed by the application applies and takes precedence. Against the
real sidecar tracing to an OTLP receiver; the callers' spans come from a tracer of the test's
own (the OpenTelemetry SDK, not exported)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Tracer

from limelight import tracing
from limelight_client import AsyncClient, Client, _lanes, _tracing
from limelight_client.proto import explainer_pb2 as pb
from tests.conftest import RunningSidecar
from tests.otlp_receiver import Receiver


@pytest.fixture
def tracer() -> Tracer:
    return TracerProvider().get_tracer("caller")


@pytest.fixture
def sidecar(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path, receiver: Receiver
) -> RunningSidecar:
    """A sidecar tracing to ``receiver`` (started after it: the OTEL_* variables point there)."""
    return start_sidecar(model_dir=bert_tiny_dir, jobs="off")


def test_outside_any_span_nothing_is_sent() -> None:
    assert _tracing.trace_context() == {}
    request = _lanes.lane_request(pb.ExplainRequest(text="x"), None)
    assert dict(request.trace_context) == {}


def test_without_opentelemetry_the_sdk_works_and_sends_nothing() -> None:
    """OpenTelemetry is not a dependency of the SDK: with it absent (every import of it
    failing, in a fresh interpreter) a request is built without a trace context."""
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from limelight_client import Client, _lanes, _tracing\n"
        "from limelight_client.proto import explainer_pb2 as pb\n"
        "assert _tracing.trace_context() == {}\n"
        "request = _lanes.lane_request(pb.ExplainRequest(text='x'), None)\n"
        "assert not request.trace_context\n"
        "Client('127.0.0.1:1').close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_request_carries_the_current_span_as_traceparent(tracer: Tracer) -> None:
    with tracer.start_as_current_span("caller") as span:
        request = _lanes.lane_request(pb.ExplainRequest(text="x"), 5.0)
    context = span.get_span_context()
    _, trace_id, span_id, _ = request.trace_context["traceparent"].split("-")
    assert (int(trace_id, 16), int(span_id, 16)) == (context.trace_id, context.span_id)


def _input_spans_of(receiver: Receiver, callers: Sequence[Span]) -> list[tuple[int, int]]:
    """(trace id, parent span id) of each ``explain input`` the sidecar exported, for the
    callers' ``spans``, in their order; a caller without one is missing."""
    assert tracing.flush()
    exported = {
        (int.from_bytes(s.trace_id, "big"), int.from_bytes(s.parent_span_id, "big"))
        for s in receiver.named("explain input")
    }
    wanted = [(c.trace_id, c.span_id) for c in (s.get_span_context() for s in callers)]
    return [w for w in wanted if w in exported]


def test_sync_calls_on_one_stream_each_join_their_callers_trace(
    sidecar: RunningSidecar, receiver: Receiver, tracer: Tracer
) -> None:
    callers: list[Span] = []
    with Client(sidecar.target, timeout=60, single_calls="stream") as client:
        for text in ["a gorgeous movie", "a dull movie", "fine."]:
            with tracer.start_as_current_span(f"caller {text}") as span:
                client.explain(text)
            callers.append(span)
        (connection,) = client._connections.every_connection()
        assert len(connection.lanes) == 1  # the three calls rode one stream
    assert len(_input_spans_of(receiver, callers)) == 3


def test_async_concurrent_calls_each_join_their_callers_trace(
    sidecar: RunningSidecar, receiver: Receiver, tracer: Tracer
) -> None:

    async def main() -> list[Span]:
        async with AsyncClient(sidecar.target, timeout=60, single_calls="stream") as client:

            async def caller(i: int) -> Span:
                with tracer.start_as_current_span(f"caller {i}") as span:
                    await client.explain(f"review number {i}")
                    await client.explain(f"and another, {i}")
                return span

            return list(await asyncio.gather(*(caller(i) for i in range(6))))

    callers = asyncio.run(main())
    assert len(_input_spans_of(receiver, callers)) == 6
    assert len(receiver.named("explain input")) == 12  # two inputs per caller, none lost


def _server_span(receiver: Receiver, rpc: str, trace_id: int) -> Any:
    assert tracing.flush()
    (span,) = [
        s
        for s in receiver.named(f"limelight.v1.Explainer/{rpc}")
        if int.from_bytes(s.trace_id, "big") == trace_id
    ]
    return span


def test_every_other_call_carries_the_callers_context_in_its_metadata(
    sidecar: RunningSidecar, receiver: Receiver, tracer: Tracer
) -> None:
    """Unary calls and ``explain_many``'s streams (one caller each) in the metadata, without
    any gRPC instrumentation: the sidecar's span of the call is a child of the caller's."""
    with Client(sidecar.target, timeout=60) as client:
        with tracer.start_as_current_span("caller") as unary:
            client.explain("a gorgeous movie")
        with tracer.start_as_current_span("caller") as many:
            assert len(list(client.explain_many(["a dull movie", "fine."]))) == 2
    for rpc, caller in [("Explain", unary), ("ExplainStream", many)]:
        context = caller.get_span_context()
        span = _server_span(receiver, rpc, context.trace_id)
        assert int.from_bytes(span.parent_span_id, "big") == context.span_id

    async def main() -> Span:
        async with AsyncClient(sidecar.target, timeout=60) as client:
            with tracer.start_as_current_span("async caller") as span:
                await client.explain("a gorgeous movie")
            return span

    context = asyncio.run(main()).get_span_context()
    span = _server_span(receiver, "Explain", context.trace_id)
    assert int.from_bytes(span.parent_span_id, "big") == context.span_id


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_grpc_instrumentation_installed_later_applies_and_its_span_is_the_parent(
    sidecar: RunningSidecar, receiver: Receiver, flavour: str
) -> None:
    """OpenTelemetry's gRPC instrumentation (grpc's or grpc.aio's), installed after the SDK was
    imported (it replaces the channel constructors), wraps the channels of a client created
    afterwards; its client span, not the SDK's context, is what the sidecar's span hangs under."""
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcInstrumentorClient,
    )
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    # The instrumentation's client spans come from the global tracer provider (its
    # ``tracer_provider`` argument does not reach the channels it wraps in this version).
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    exported = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracer = provider.get_tracer("app")
    instrumentor = GrpcInstrumentorClient() if flavour == "sync" else GrpcAioInstrumentorClient()
    instrumentor.instrument()
    try:
        if flavour == "sync":
            with (
                Client(sidecar.target, timeout=60) as client,
                tracer.start_as_current_span("caller") as caller,
            ):
                client.explain("a gorgeous movie")
        else:

            async def main() -> Span:
                async with AsyncClient(sidecar.target, timeout=60) as client:
                    with tracer.start_as_current_span("caller") as span:
                        await client.explain("a gorgeous movie")
                    return span

            caller = asyncio.run(main())
    finally:
        instrumentor.uninstrument()
    context = caller.get_span_context()
    (client_span,) = [
        s
        for s in exported.get_finished_spans()
        if s.kind == SpanKind.CLIENT and s.name.endswith("/Explain")
    ]
    exported.shutdown()
    assert client_span.parent is not None and client_span.parent.span_id == context.span_id
    span = _server_span(receiver, "Explain", context.trace_id)
    assert int.from_bytes(span.parent_span_id, "big") == client_span.context.span_id
