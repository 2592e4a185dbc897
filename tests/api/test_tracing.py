"""OpenTelemetry: off by default; with OTEL_* set, RPC and HTTP spans reach an OTLP/gRPC receiver
(built from the published OTLP protos) as children of the caller's ``traceparent``."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from limelight import tracing
from limelight.jobs.runner import JobRunner
from limelight.methods.base import JobCancelled
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import ALICE_TOKEN, two_token_sidecar
from tests.otlp_receiver import Receiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_a_job_run_is_a_child_of_the_request_that_submitted_it(
    start_sidecar: Any, bert_tiny_dir: Any, receiver: Receiver
) -> None:
    running = start_sidecar(model_dir=bert_tiny_dir, jobs="sqlite")
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(running.target))
    job = stub.SubmitJob(
        pb.SubmitJobRequest(method="random", text="a gorgeous movie"),
        metadata=(("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),),
        timeout=30,
    )
    done = [
        pb.JOB_STATE_SUCCEEDED,
        pb.JOB_STATE_FAILED,
        pb.JOB_STATE_CANCELLED,
    ]
    for update in stub.WatchJob(pb.GetJobRequest(id=job.id), timeout=120):
        if update.state in done:
            assert update.state == pb.JOB_STATE_SUCCEEDED
            break
    assert tracing.flush()
    spans = [s for _, s in receiver.spans if s.trace_id.hex() == TRACE_ID]
    (submit,) = [s for s in spans if s.name == "limelight.v1.Explainer/SubmitJob"]
    (run,) = [s for s in spans if s.name == "job random"]
    assert submit.parent_span_id.hex() == PARENT_ID
    assert run.parent_span_id == submit.span_id  # stored with the job, read back by the runner
    assert run.kind == run.SPAN_KIND_CONSUMER
    attributes = {a.key: a.value.string_value for a in run.attributes}
    assert attributes["limelight.job.id"] == job.id


def test_tracing_is_off_without_otel_variables() -> None:
    assert not tracing.tracing_requested({})
    assert not tracing.tracing_requested({"OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.tracing_requested(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"}
    )
    assert tracing.tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"})
    assert tracing.tracing_requested({"OTEL_TRACES_EXPORTER": "otlp"})


def test_rpc_and_http_spans_reach_an_otlp_receiver(
    start_sidecar: Any, bert_tiny_dir: Any, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "limelight-under-test")
    running = start_sidecar(model_dir=bert_tiny_dir, jobs="off")
    traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(running.target))
    stub.Explain(
        pb.ExplainRequest(text="a gorgeous movie"),
        metadata=(("traceparent", traceparent),),
        timeout=30,
    )
    with pytest.raises(grpc.RpcError):
        stub.Explain(pb.ExplainRequest(text=""), timeout=30)
    url = f"http://127.0.0.1:{running.server.metrics_port}/v2/health/ready"
    request = urllib.request.Request(url, headers={"traceparent": traceparent})
    urllib.request.urlopen(request, timeout=30).read()
    assert tracing.flush()
    explains = [(r, s) for r, s in receiver.spans if s.name == "limelight.v1.Explainer/Explain"]
    (resource, explain), *_ = [(r, s) for r, s in explains if s.trace_id.hex() == TRACE_ID]
    assert explain.parent_span_id.hex() == PARENT_ID
    assert explain.kind == explain.SPAN_KIND_SERVER
    names = {a.key: a.value.string_value for a in resource.attributes}
    assert names["service.name"] == "limelight-under-test"
    codes = {
        a.value.string_value
        for _, s in explains
        for a in s.attributes
        if a.key == "rpc.grpc.status_code_name"
    }
    assert codes == {"OK", "INVALID_ARGUMENT"}
    # The micro-batch that served the traced request links to it; the forward pass is its child.
    batches = [
        s
        for _, s in receiver.spans
        if s.name == "inline batch"
        and any(
            link.trace_id == explain.trace_id and link.span_id == explain.span_id
            for link in s.links
        )
    ]
    assert len(batches) == 1
    (forward,) = [
        s
        for _, s in receiver.spans
        if s.name == "forward" and s.parent_span_id == batches[0].span_id
    ]
    assert forward.trace_id == batches[0].trace_id
    (http,) = [s for _, s in receiver.spans if s.name == "HTTP v2.ServerReady"]
    assert http.trace_id.hex() == TRACE_ID and http.parent_span_id.hex() == PARENT_ID


def test_each_traced_input_of_a_stream_is_a_span_of_its_callers_trace(
    start_sidecar: Any, bert_tiny_dir: Any, receiver: Receiver
) -> None:
    """One stream, inputs of two other callers (``trace_context``) and one without: each traced
    input is an ``explain input`` span in its caller's trace, linked to the stream's span, with
    its own status; the micro-batch that served it links to it."""
    running = start_sidecar(model_dir=bert_tiny_dir, jobs="off")
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(running.target))
    callers = {"a": ("1" * 32, "2" * 16), "c": ("3" * 32, "4" * 16)}
    requests = [
        pb.ExplainRequest(
            text="a gorgeous movie",
            request_id="a",
            trace_context={"traceparent": f"00-{callers['a'][0]}-{callers['a'][1]}-01"},
        ),
        pb.ExplainRequest(text="an untraced input", request_id="b"),
        pb.ExplainRequest(
            text="a dull movie",
            request_id="c",
            target=pb.Target(label="no such label"),
            continue_on_error=True,
            trace_context={"traceparent": f"00-{callers['c'][0]}-{callers['c'][1]}-01"},
        ),
    ]
    answers = list(
        stub.ExplainStream(
            iter(requests),
            metadata=(("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),),
            timeout=30,
        )
    )
    assert [a.request_id for a in answers] == ["a", "b", "c"]
    assert answers[2].HasField("error") and not answers[0].HasField("error")
    assert tracing.flush()
    (stream,) = [
        s
        for s in receiver.named("limelight.v1.Explainer/ExplainStream")
        if s.trace_id.hex() == TRACE_ID
    ]
    inputs = {s.trace_id.hex(): s for s in receiver.named("explain input")}
    assert set(inputs) == {trace for trace, _ in callers.values()}  # not the untraced one
    for request_id, (trace_id, parent_id) in callers.items():
        span = inputs[trace_id]
        assert span.parent_span_id.hex() == parent_id
        assert span.kind == span.SPAN_KIND_SERVER
        assert [(link.trace_id, link.span_id) for link in span.links] == [
            (stream.trace_id, stream.span_id)
        ]
        assert _attributes(span)["limelight.request_id"] == request_id
    served, refused = inputs[callers["a"][0]], inputs[callers["c"][0]]
    assert _attributes(served)["rpc.grpc.status_code_name"] == "OK"
    assert _attributes(refused)["rpc.grpc.status_code_name"] == "INVALID_ARGUMENT"
    assert [
        s
        for s in receiver.named("inline batch")
        if any(link.span_id == served.span_id for link in s.links)
    ]

    # An ExplainBatch input the same way.
    batched = ("5" * 32, "6" * 16)
    stub.ExplainBatch(
        pb.ExplainBatchRequest(
            requests=[
                pb.ExplainRequest(text="an untraced input"),
                pb.ExplainRequest(
                    text="a gorgeous movie",
                    trace_context={"traceparent": f"00-{batched[0]}-{batched[1]}-01"},
                ),
            ]
        ),
        timeout=30,
    )
    assert tracing.flush()
    (span,) = [s for s in receiver.named("explain input") if s.trace_id.hex() == batched[0]]
    assert span.parent_span_id.hex() == batched[1]


def _attributes(span: Any) -> dict[str, str]:
    return {a.key: a.value.string_value for a in span.attributes}


def test_a_collector_that_does_not_answer_holds_the_stop_only_as_long_as_asked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK's own shutdown retried an unreachable collector for up to 30 s, past a pod's
    grace period (a stop took 32 s). The spans left then are dropped, and the log says so."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there once this closes
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    assert tracing.setup_tracing()
    try:
        with tracing.tracer().start_as_current_span("left for the stop"):
            pass
    finally:
        with caplog.at_level("WARNING", logger="limelight.tracing"):
            tracing.shutdown_tracing(0.2)
    assert not tracing.enabled()
    assert any("were dropped" in r.getMessage() for r in caplog.records), caplog.records


def test_otel_settings_this_sidecar_does_not_honour_are_named() -> None:
    assert tracing.unsupported_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == []
    assert tracing.unsupported_settings({"OTEL_TRACES_EXPORTER": "otlp"}) == []
    (console,) = tracing.unsupported_settings({"OTEL_TRACES_EXPORTER": "console"})
    assert console.startswith("OTEL_TRACES_EXPORTER=console (only otlp and none")
    (http,) = tracing.unsupported_settings(
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}
    )
    assert http.startswith("OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf (spans go over OTLP/gRPC")
    assert tracing.unsupported_settings({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == []
    # Only the first of the two that is set is read: the traces-specific one wins.
    both = {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    assert tracing.unsupported_settings(both) == []
    (traces,) = tracing.unsupported_settings(
        {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    )
    assert traces.startswith("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json")
    assert tracing.unsupported_settings({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": ""}) == []


def test_a_stream_its_client_stops_reading_ends_its_span_cancelled(
    start_sidecar: Any,
    bert_tiny_dir: Any,
    receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that stops watching a job (the SDK's ``Job.result()`` does, after the final
    state) or reading an ExplainStream cancels the call: gRPC then closes the handler's
    generator from another task. A trace context attached across its ``yield`` could not be
    detached there ("Failed to detach context" and a traceback in the log), and the span said
    OK where the call was CANCELLED."""

    def run_until_stopped(
        self: Any, spec: Any, job_id: str, report: Any, should_stop: Any, queue_seconds: float = 0.0
    ) -> Any:
        while not should_stop():  # the job runs until the server stops
            threading.Event().wait(0.05)
        raise JobCancelled

    monkeypatch.setattr(JobRunner, "run", run_until_stopped)
    running = start_sidecar(model_dir=bert_tiny_dir, jobs="sqlite")
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(running.target))
    watched, streamed = "7" * 32, "8" * 32
    job = stub.SubmitJob(pb.SubmitJobRequest(method="random", text="a movie"), timeout=30)
    with caplog.at_level("WARNING"):
        watch = stub.WatchJob(
            pb.GetJobRequest(id=job.id),
            metadata=(("traceparent", f"00-{watched}-{PARENT_ID}-01"),),
            timeout=120,
        )
        assert next(watch).state not in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED)
        watch.cancel()
        watch_span = receiver.arrived("limelight.v1.Explainer/WatchJob", watched, tracing.flush)

        more = threading.Event()

        def requests() -> Iterator[pb.ExplainRequest]:
            yield pb.ExplainRequest(text="a gorgeous movie")
            more.wait()  # the client stops reading before it sends more

        stream = stub.ExplainStream(
            requests(), metadata=(("traceparent", f"00-{streamed}-{PARENT_ID}-01"),), timeout=120
        )
        assert not next(stream).HasField("error")
        stream.cancel()
        more.set()
        name = "limelight.v1.Explainer/ExplainStream"
        stream_span = receiver.arrived(name, streamed, tracing.flush)
    for span in (watch_span, stream_span):
        assert _attributes(span)["rpc.grpc.status_code_name"] == "CANCELLED"
        assert span.status.code != span.status.STATUS_CODE_ERROR
    detached = [r for r in caplog.records if "detach" in r.getMessage()]
    assert not detached, [r.getMessage() for r in detached]


def test_a_request_not_sampled_has_no_batch_span(
    start_sidecar: Any, bert_tiny_dir: Any, receiver: Receiver
) -> None:
    """The caller's "not sampled" (``traceparent`` flags 00, the default parent-based
    sampler) holds for the micro-batch that serves its request: no ``inline batch`` or
    ``forward`` span, no link to a span no one exports. A sampled request's batch is traced."""
    running = start_sidecar(model_dir=bert_tiny_dir, jobs="off")
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(running.target))
    unsampled, sampled = "9" * 32, "a" * 32
    stub.Explain(
        pb.ExplainRequest(text="a gorgeous movie"),
        metadata=(("traceparent", f"00-{unsampled}-{PARENT_ID}-00"),),
        timeout=30,
    )
    assert tracing.flush()
    assert receiver.named("inline batch") == []
    assert receiver.named("forward") == []
    assert [s for _, s in receiver.spans if s.trace_id.hex() == unsampled] == []

    stub.Explain(
        pb.ExplainRequest(text="a gorgeous movie"),
        metadata=(("traceparent", f"00-{sampled}-{PARENT_ID}-01"),),
        timeout=30,
    )
    explain = receiver.arrived("limelight.v1.Explainer/Explain", sampled, tracing.flush)
    (batch,) = receiver.named("inline batch")
    assert [(link.trace_id, link.span_id) for link in batch.links] == [
        (explain.trace_id, explain.span_id)
    ]
    (forward,) = receiver.named("forward")
    assert forward.parent_span_id == batch.span_id


def test_spans_carry_no_stack_traces_and_their_status_is_the_calls(
    start_sidecar: Any, bert_tiny_dir: Any, receiver: Receiver, tmp_path: Any
) -> None:
    """An exception leaving a span is not recorded with its stack trace and raw message (which
    may name server paths a client reads redacted); a refused call's span has the call's status
    code, not "AbortError: Locally aborted."."""
    running = two_token_sidecar(start_sidecar, tmp_path, model_dir=bert_tiny_dir, jobs="off")
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(running.target))
    refused, invalid, streamed = "b" * 32, "c" * 32, "d" * 32
    with pytest.raises(grpc.RpcError) as unauthenticated:
        stub.Explain(
            pb.ExplainRequest(text="a gorgeous movie"),
            metadata=(("traceparent", f"00-{refused}-{PARENT_ID}-01"),),
            timeout=30,
        )
    assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED
    token = ("authorization", f"Bearer {ALICE_TOKEN}")
    with pytest.raises(grpc.RpcError):
        stub.Explain(
            pb.ExplainRequest(text=""),
            metadata=(("traceparent", f"00-{invalid}-{PARENT_ID}-01"), token),
            timeout=30,
        )
    (answer,) = stub.ExplainStream(
        iter(
            [
                pb.ExplainRequest(
                    text="a dull movie",
                    target=pb.Target(label="no such label"),
                    continue_on_error=True,
                    trace_context={"traceparent": f"00-{streamed}-{PARENT_ID}-01"},
                )
            ]
        ),
        metadata=(token,),
        timeout=30,
    )
    assert answer.HasField("error")
    name = "limelight.v1.Explainer/Explain"
    denied = receiver.arrived(name, refused, tracing.flush)
    assert _attributes(denied)["rpc.grpc.status_code_name"] == "UNAUTHENTICATED"
    assert denied.status.message == "UNAUTHENTICATED"
    spans = [
        denied,
        receiver.arrived(name, invalid, tracing.flush),
        receiver.arrived("explain input", streamed, tracing.flush),
    ]
    for span in spans:
        for event in span.events:
            keys = {a.key for a in event.attributes}
            assert "exception.stacktrace" not in keys, (span.name, event)
            assert "AbortError" not in _attributes(event).get("exception.type", "")


def test_a_stream_closed_from_another_task_detaches_nothing_there(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    """What gRPC does when a client cancels a stream whose handler waits at a ``yield`` (its
    answer not yet written): the task serving the call is cancelled and the generator is
    closed later by asyncio's finalizer, in another task. The trace context must not stay
    attached across the ``yield``: the old wrapper's detach failed there ("Failed to detach
    context", ValueError: Token created in a different Context) and its span said OK."""
    from limelight.api.tracing import TracingInterceptor

    closed = []

    async def answers(request: Any, context: Any) -> AsyncIterator[str]:
        try:
            yield "first"
            yield "second"
        finally:
            closed.append(True)

    class Details:
        method = "/limelight.v1.Explainer/WatchJob"
        invocation_metadata = (("traceparent", f"00-{'e' * 32}-{PARENT_ID}-01"),)

    class Context:
        def code(self) -> None:
            return None

    async def continuation(details: Any) -> Any:
        return grpc.unary_stream_rpc_method_handler(answers)

    async def scenario() -> None:
        handler = await TracingInterceptor().intercept_service(continuation, Details())  # type: ignore[arg-type]
        call = handler.unary_stream(None, Context())
        assert await asyncio.create_task(call.__anext__()) == "first"
        await asyncio.create_task(call.aclose())  # another task: another context

    assert tracing.setup_tracing()
    try:
        with caplog.at_level("WARNING"):
            asyncio.run(scenario())
        span = receiver.arrived("limelight.v1.Explainer/WatchJob", "e" * 32, tracing.flush)
    finally:
        tracing.shutdown_tracing()
    assert closed == [True]  # the handler's own generator was closed too
    detached = [r for r in caplog.records if "detach" in r.getMessage()]
    assert not detached, [r.getMessage() for r in detached]
    assert _attributes(span)["rpc.grpc.status_code_name"] == "CANCELLED"
