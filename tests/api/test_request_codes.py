"""Which status code ``limelight_request_duration_seconds{rpc,code}`` records for calls the
client ended (deadline or cancel) and calls refused before their handler ran; what a corrupt
message is told; and job ownership with auth off."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from limelight.api.servicer import ExplainerServicer
from limelight.metrics import Metrics
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from limelight_client.proto import open_inference_grpc_pb2 as oip
from limelight_client.proto import open_inference_grpc_pb2_grpc as oip_grpc
from tests.conftest import RunningSidecar
from tests.waiting import wait_until

DURATION = "limelight_request_duration_seconds_count"


def counts(side: RunningSidecar) -> dict[tuple[str, str], float]:
    """The request counts by (rpc, code), read from the HTTP /metrics endpoint."""
    import urllib.request

    with urllib.request.urlopen(side.metrics_url, timeout=30) as response:
        text = response.read().decode()
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == DURATION:
                found[(sample.labels["rpc"], sample.labels["code"])] = sample.value
    return found


def count(registry: CollectorRegistry, rpc: str, code: str) -> float:
    return registry.get_sample_value(DURATION, {"rpc": rpc, "code": code}) or 0.0


class Context:
    """What the guard asks of a grpc.aio context; ``remaining`` is what gRPC answers a handler
    it cancelled: 0 once the deadline has passed."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.code: grpc.StatusCode | None = None

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        pass

    def time_remaining(self) -> float | None:
        return self.remaining


# --- the guard, driven as gRPC drives it ----------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("remaining", "code"), [(0.0, "DEADLINE_EXCEEDED"), (25.0, "CANCELLED"), (None, "CANCELLED")]
)
async def test_a_unary_call_gRPC_cancels_counts_why(remaining: float | None, code: str) -> None:
    # gRPC cancels the handler's task both for a passed deadline and for a client's cancel.
    registry = CollectorRegistry()
    servicer = ExplainerServicer(Metrics(registry))
    started = asyncio.Event()

    async def call() -> Any:
        started.set()
        await asyncio.Event().wait()  # the work, never done

    task = asyncio.create_task(servicer._guard("Explain", Context(remaining), call))  # type: ignore[arg-type]
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert count(registry, "Explain", code) == 1
    assert sum(count(registry, "Explain", c) for c in ("OK", "CANCELLED", "DEADLINE_EXCEEDED")) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize(("remaining", "code"), [(0.0, "DEADLINE_EXCEEDED"), (25.0, "CANCELLED")])
async def test_a_stream_gRPC_closes_at_a_yield_counts_why(remaining: float, code: str) -> None:
    # A call that ends while the handler waits for gRPC to send an answer: gRPC closes the
    # handler's generator there (GeneratorExit), which once counted the call OK.
    registry = CollectorRegistry()
    servicer = ExplainerServicer(Metrics(registry))

    async def answers() -> AsyncIterator[Any]:
        for i in range(5):
            yield i

    stream = servicer._guard_stream("ExplainStream", Context(remaining), answers, sized=True)  # type: ignore[arg-type]
    assert await anext(stream) == 0
    await stream.aclose()
    assert count(registry, "ExplainStream", code) == 1
    assert count(registry, "ExplainStream", "OK") == 0


# --- a real sidecar -----------------------------------------------------------------------


def test_a_stream_past_its_deadline_counts_deadline_exceeded(sidecar: RunningSidecar) -> None:
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(sidecar.target))
    ended = threading.Event()

    def requests() -> Iterator[pb.ExplainRequest]:
        yield pb.ExplainRequest(text="a fine film")
        ended.wait()  # then nothing more: the server waits for the next text

    with pytest.raises(grpc.RpcError) as err:
        list(stub.ExplainStream(requests(), timeout=1.0))
    ended.set()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    got = wait_until(lambda: {k: v for k, v in counts(sidecar).items() if k[0] == "ExplainStream"})
    assert got == {("ExplainStream", "DEADLINE_EXCEEDED"): 1.0}, got


def test_a_stream_its_client_cancels_counts_cancelled(sidecar: RunningSidecar) -> None:
    # The cancel ends the server's reads as a half-close would; with every answer sent, the
    # stream then ended as if it had succeeded (counted OK).
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(sidecar.target))
    ended = threading.Event()

    def requests() -> Iterator[pb.ExplainRequest]:
        yield pb.ExplainRequest(text="a fine film")
        ended.wait()

    answers = stub.ExplainStream(requests(), timeout=600)
    assert next(answers).label
    answers.cancel()
    ended.set()
    got = wait_until(lambda: {k: v for k, v in counts(sidecar).items() if k[0] == "ExplainStream"})
    assert got == {("ExplainStream", "CANCELLED"): 1.0}, got


def test_a_watch_ended_by_its_deadline_or_its_client_counts_which(
    sidecar: RunningSidecar,
) -> None:
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(sidecar.target))
    # A job that runs long enough to be watched (cancelled at the end).
    submit = pb.SubmitJobRequest(text="a long review " * 60, method="shapley")
    submit.parameters.update({"permutations": 256})
    job = stub.SubmitJob(submit, timeout=30)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.WatchJob(pb.GetJobRequest(id=job.id), timeout=1.0))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        watch = stub.WatchJob(pb.GetJobRequest(id=job.id), timeout=600)
        next(watch)
        watch.cancel()
    finally:
        stub.CancelJob(pb.CancelJobRequest(id=job.id), timeout=30)
    expected = {("WatchJob", "DEADLINE_EXCEEDED"): 1.0, ("WatchJob", "CANCELLED"): 1.0}

    def watches() -> dict[tuple[str, str], float] | None:
        got = {k: v for k, v in counts(sidecar).items() if k[0] == "WatchJob"}
        return got if sum(got.values()) >= 2 else None

    assert wait_until(watches) == expected


def test_refused_calls_count_unauthenticated(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    side = start_sidecar(model_dir=bert_tiny_dir, jobs="off", auth_token="delta-token")
    channel = grpc.insecure_channel(side.target)
    stub = explainer_pb2_grpc.ExplainerStub(channel)
    for metadata in [None, (("authorization", "Bearer wrong"),)]:
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModel(pb.GetModelRequest(), timeout=30, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        list(stub.ExplainStream(iter([pb.ExplainRequest(text="x")]), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        oip_grpc.GRPCInferenceServiceStub(channel).ServerMetadata(
            oip.ServerMetadataRequest(), timeout=30
        )
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Unknown methods make no label values of their own (gRPC answers UNIMPLEMENTED).
    for method in ("/limelight.v1.Explainer/Nope", "/x.Y/Z"):
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(method)(b"", timeout=30)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    good = (("authorization", "Bearer delta-token"),)
    stub.GetModel(pb.GetModelRequest(), timeout=30, metadata=good)
    expected = {
        ("GetModel", "UNAUTHENTICATED"): 2.0,
        ("ExplainStream", "UNAUTHENTICATED"): 1.0,
        ("ServerMetadata", "UNAUTHENTICATED"): 1.0,
        ("GetModel", "OK"): 1.0,
    }
    assert wait_until(lambda: counts(side) if len(counts(side)) >= len(expected) else None) == (
        expected
    )


# --- corrupt messages ---------------------------------------------------------------------


def test_corrupt_bytes_are_not_called_a_utf8_problem(sidecar: RunningSidecar) -> None:
    channel = grpc.insecure_channel(sidecar.target)
    explain = channel.unary_unary(
        "/limelight.v1.Explainer/Explain",
        request_serializer=lambda b: b,
        response_deserializer=pb.ExplainResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        explain(b"\xff\xff\xff", timeout=30)
    details = err.value.details() or ""
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" not in details and "not a valid limelight.v1.ExplainRequest" in details
    # A well-formed message whose string is not UTF-8 (a nested map key here) says so.
    submit = channel.unary_unary(
        "/limelight.v1.Explainer/SubmitJob",
        request_serializer=lambda b: b,
        response_deserializer=pb.Job.FromString,
    )
    request = pb.SubmitJobRequest(text="fine", method="random")
    request.parameters.update({"QQ": 1})
    with pytest.raises(grpc.RpcError) as err:
        submit(request.SerializeToString().replace(b"QQ", b"\xc3\x28"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in (err.value.details() or "")


# --- job ownership with auth off ------------------------------------------------------------


def test_with_auth_off_a_header_does_not_change_who_owns_a_job(sidecar: RunningSidecar) -> None:
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(sidecar.target))
    header = (("authorization", "Bearer x"),)
    submit = pb.SubmitJobRequest(text="a review", method="random", idempotency_key="k")
    job = stub.SubmitJob(submit, timeout=30)
    assert stub.GetJob(pb.GetJobRequest(id=job.id), timeout=30, metadata=header).id == job.id
    listed = stub.ListJobs(pb.ListJobsRequest(), timeout=30, metadata=header).jobs
    assert [j.id for j in listed] == [job.id]
    # Idempotency keys are scoped by owner: the same caller, the same job.
    assert stub.SubmitJob(submit, timeout=30, metadata=header).id == job.id
    watched = list(stub.WatchJob(pb.GetJobRequest(id=job.id), timeout=120, metadata=header))
    assert watched and watched[-1].id == job.id
    assert stub.CancelJob(pb.CancelJobRequest(id=job.id), timeout=30, metadata=header).id == job.id
