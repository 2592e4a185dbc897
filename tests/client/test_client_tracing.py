"""Streamed single calls carry each caller's own trace context: the pooled stream was opened
by another call, so its metadata cannot; the sidecar traces each input in its caller's trace.
Against the real sidecar tracing to an OTLP receiver; the callers' spans come from a tracer of
the test's own (the OpenTelemetry SDK, not exported)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, Tracer

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


def test_without_opentelemetry_nothing_is_sent(
    tracer: Tracer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_tracing, "_injector", lambda: None)
    with tracer.start_as_current_span("caller"):
        assert _tracing.trace_context() == {}


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
