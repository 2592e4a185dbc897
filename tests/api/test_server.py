"""The sidecar over a real loopback socket: explain, streams, health, reflection, bad input."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from limelight_client import AsyncClient, Client, Explanation
from limelight_client.errors import InvalidArgument as ClientInvalidArgument
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar
from tests.waiting import wait_until


def stub(target: str) -> explainer_pb2_grpc.ExplainerStub:
    return explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(target))


def test_explain_returns_prediction_tokens_and_scores(sidecar: RunningSidecar) -> None:
    text = "a gorgeous, witty, seductive movie"
    r = stub(sidecar.target).Explain(pb.ExplainRequest(text=text, request_id="r-1"), timeout=30)
    assert r.request_id == "r-1"
    assert list(r.labels) == ["rotten", "fresh"]
    assert r.label == r.labels[r.label_index]
    assert abs(sum(r.probabilities) - 1) < 1e-5
    tokens = r.explanation.tokens
    assert tokens[0].special and tokens[-1].special and not tokens[1].special
    assert len(r.explanation.scores) == len(tokens)
    assert r.explanation.method == "normxlogit"
    assert r.explanation.target_label == r.label
    for tok in tokens:
        if not tok.special:
            assert text[tok.start : tok.end].lower() == tok.text.removeprefix("##")
    assert r.timings.batch_size >= 1 and r.timings.forward_seconds > 0


def test_target_by_name_index_and_all_classes(sidecar: RunningSidecar) -> None:
    s = stub(sidecar.target)
    text = "the plot is thin but the actors are superb"
    full = s.Explain(pb.ExplainRequest(text=text, all_classes=True), timeout=30)
    matrix = [list(row.scores) for row in full.explanation.class_scores]
    assert len(matrix) == len(full.explanation.tokens) and len(matrix[0]) == 2
    by_name = s.Explain(pb.ExplainRequest(text=text, target=pb.Target(label="rotten")), timeout=30)
    by_index = s.Explain(pb.ExplainRequest(text=text, target=pb.Target(index=0)), timeout=30)
    assert by_name.explanation.target_label == "rotten"
    column = [row[0] for row in matrix]
    assert list(by_name.explanation.scores) == pytest.approx(column, rel=1e-5, abs=1e-6)
    assert list(by_index.explanation.scores) == list(by_name.explanation.scores)


def test_text_pair(sidecar: RunningSidecar) -> None:
    r = stub(sidecar.target).Explain(
        pb.ExplainRequest(text="a man sleeps", text_pair="a person rests"), timeout=30
    )
    segments = {t.segment for t in r.explanation.tokens if not t.special}
    assert segments == {0, 1}


def _inputs_timed(metrics_url: str) -> float:
    """How many inputs the per-input latency histogram (stage "total") has seen."""
    body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    series = 'limelight_inline_stage_duration_seconds_count{stage="total"}'
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(series))


def test_stream_keeps_order_and_batches(sidecar: RunningSidecar) -> None:
    texts = [f"review number {i}: {'great ' * (i % 5)}fun" for i in range(40)]
    timed = _inputs_timed(sidecar.metrics_url)
    responses = list(
        stub(sidecar.target).ExplainStream(
            iter(pb.ExplainRequest(text=t, request_id=str(i)) for i, t in enumerate(texts)),
            timeout=120,
        )
    )
    assert [r.request_id for r in responses] == [str(i) for i in range(40)]
    assert max(r.timings.batch_size for r in responses) > 1
    # Each input of the stream is timed on its own, not only the stream as one call.
    assert _inputs_timed(sidecar.metrics_url) == timed + 40


def test_explain_batch_answers_each_input_as_explain_does(sidecar: RunningSidecar) -> None:
    s = stub(sidecar.target)
    texts = [f"review {i}: {'gorgeous ' * (i % 4)}film, {'dull ' * (i % 3)}plot" for i in range(24)]
    requests = [pb.ExplainRequest(text=t, request_id=f"b-{i}") for i, t in enumerate(texts)]
    requests[3].target.label = "rotten"
    requests[5].all_classes = True
    requests[7].text_pair = "was it good?"
    batch = s.ExplainBatch(pb.ExplainBatchRequest(requests=requests), timeout=60).responses
    assert [r.request_id for r in batch] == [f"b-{i}" for i in range(24)]
    # The inputs of one call share forward passes, and each answer is the one Explain gives.
    assert max(r.timings.batch_size for r in batch) > 1
    for request, answer in zip(requests, batch, strict=True):
        alone = s.Explain(request, timeout=30)
        assert answer.label == alone.label
        assert list(answer.probabilities) == pytest.approx(list(alone.probabilities), abs=1e-5)
        assert answer.explanation.target_label == alone.explanation.target_label
        assert [t.text for t in answer.explanation.tokens] == [
            t.text for t in alone.explanation.tokens
        ]
        assert list(answer.explanation.scores) == pytest.approx(
            list(alone.explanation.scores), rel=1e-4, abs=1e-5
        )
        assert len(answer.explanation.class_scores) == len(alone.explanation.class_scores)
    assert batch[3].explanation.target_label == "rotten"
    assert {t.segment for t in batch[7].explanation.tokens if not t.special} == {0, 1}
    empty = s.ExplainBatch(pb.ExplainBatchRequest(), timeout=30)
    assert list(empty.responses) == []


def test_explain_batch_on_an_idle_server_runs_as_one_forward_pass(
    sidecar: RunningSidecar,
) -> None:
    # No input of the call may reach the idle inference thread ahead of the others (it would
    # take a forward pass of its own): the whole call is one batch.
    requests = [pb.ExplainRequest(text=f"a fine film, number {i}") for i in range(12)]
    for _ in range(3):
        batch = stub(sidecar.target).ExplainBatch(
            pb.ExplainBatchRequest(requests=requests), timeout=60
        )
        assert [r.timings.batch_size for r in batch.responses] == [12] * 12


def test_explain_batch_fails_whole_naming_the_input_and_keeps_serving(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    running = start_sidecar(model_dir=bert_tiny_dir, max_batch_request_items=4)
    s = stub(running.target)
    requests = [pb.ExplainRequest(text=f"fine film {i}") for i in range(4)]
    requests[2].target.label = "no such label"
    with pytest.raises(grpc.RpcError) as bad:
        s.ExplainBatch(pb.ExplainBatchRequest(requests=requests), timeout=30)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.value.details().startswith("input 2: ")
    assert "no such label" in bad.value.details()
    too_many = [pb.ExplainRequest(text="fine") for _ in range(5)]
    with pytest.raises(grpc.RpcError) as big:
        s.ExplainBatch(pb.ExplainBatchRequest(requests=too_many), timeout=30)
    assert big.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 4" in big.value.details()
    ok = s.ExplainBatch(pb.ExplainBatchRequest(requests=too_many[:4]), timeout=30)
    assert len(ok.responses) == 4 and all(r.label for r in ok.responses)


def test_sdk_explain_batch_sync_and_async(sidecar: RunningSidecar) -> None:
    items: list[str | tuple[str, str | None]] = [
        "a gorgeous, witty film",
        ("a man sleeps", "a person rests"),
        "an unwatchable, overwrought misfire",
    ]
    with Client(sidecar.target, timeout=60) as client:
        batch = client.explain_batch(items, target="fresh")
        alone = [client.explain("a gorgeous, witty film", target="fresh")]
        with pytest.raises(ClientInvalidArgument, match="input 0: unknown label"):
            client.explain_batch(["fine", "fine too"], target="no such label")
        assert client.explain_batch([]) == []

    async def run_async() -> list[Explanation]:
        async with AsyncClient(sidecar.target, timeout=60) as client:
            return await client.explain_batch(items, target="fresh", all_classes=True)

    async_batch = asyncio.run(run_async())
    for result in (batch, async_batch):
        assert [r.text for r in result] == ["a gorgeous, witty film", "a man sleeps", items[2]]
        assert result[1].text_pair == "a person rests"
        assert all(r.target_label == "fresh" for r in result)
    assert batch[0].scores == pytest.approx(alone[0].scores, rel=1e-4, abs=1e-5)
    assert async_batch[0].class_scores is not None and batch[0].class_scores is None


def test_sdk_explain_many_in_batch_calls_matches_the_stream(sidecar: RunningSidecar) -> None:
    texts = [f"review {i}: {'gorgeous ' * (i % 3)}film, {'dull ' * (i % 4)}plot" for i in range(20)]
    with Client(sidecar.target, timeout=60, connections=2) as client:
        streamed = list(client.explain_many(texts))
        packed = list(client.explain_many(iter(texts), texts_per_call=8))
        with pytest.raises(ClientInvalidArgument, match="input 0: unknown label"):
            list(client.explain_many(texts, target="no such label", texts_per_call=8))

    async def run_async() -> list[Explanation]:
        async with AsyncClient(sidecar.target, timeout=60) as client:
            return [e async for e in client.explain_many(texts, texts_per_call=6)]

    for result in (packed, asyncio.run(run_async())):
        assert [r.text for r in result] == texts
        # Texts of one call share forward passes.
        assert max(r.timings.batch_size for r in result) > 1
        for one, other in zip(result, streamed, strict=True):
            assert one.label == other.label
            assert one.scores == pytest.approx(other.scores, rel=1e-4, abs=1e-5)


def test_concurrent_unary_calls_are_micro_batched(sidecar: RunningSidecar) -> None:
    s = stub(sidecar.target)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [
            pool.submit(s.Explain, pb.ExplainRequest(text=f"film {i} was fine"), timeout=60)
            for i in range(48)
        ]
        sizes = [f.result().timings.batch_size for f in futures]
    assert max(sizes) > 1


def test_health_and_reflection(sidecar: RunningSidecar) -> None:
    channel = grpc.insecure_channel(sidecar.target)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "limelight.v1.Explainer"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = list(
        refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    names = {s.name for s in answers[0].list_services_response.service}
    oip = "inference.GRPCInferenceService"
    assert {"limelight.v1.Explainer", "grpc.health.v1.Health", oip} <= names
    # What grpcurl does next: the file that defines the service, to describe and call it.
    for service in ("limelight.v1.Explainer", oip, "grpc.health.v1.Health"):
        (found,) = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)])
        )
        assert found.file_descriptor_response.file_descriptor_proto, found


def test_get_model(sidecar: RunningSidecar) -> None:
    info = stub(sidecar.target).GetModel(pb.GetModelRequest(), timeout=10)
    assert info.labels == ["rotten", "fresh"] and info.default_method == "normxlogit"
    methods = {m.name: m for m in info.methods}
    assert methods["normxlogit"].cost == "inline"
    assert info.runtime == "torch" and info.num_layers == 2
    # One process: it names itself (the same on every call) and counts one worker.
    again = stub(sidecar.target).GetModel(pb.GetModelRequest(), timeout=10)
    assert len(info.instance) == 16 and again.instance == info.instance and info.workers == 1


BAD_REQUESTS = [
    (pb.ExplainRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT, "text is empty"),
    (pb.ExplainRequest(text="   "), grpc.StatusCode.INVALID_ARGUMENT, "text is empty"),
    # Characters the tokenizer keeps none of: nothing to explain, whatever str.strip says.
    (
        pb.ExplainRequest(text="\u200b\u200b"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "empty to the model",
    ),
    (pb.ExplainRequest(text="\x01\x02 \ufeff"), grpc.StatusCode.INVALID_ARGUMENT, "empty to"),
    (
        pb.ExplainRequest(text="ok", target=pb.Target(label="meh")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "unknown label 'meh'",
    ),
    (
        pb.ExplainRequest(text="ok", target=pb.Target(index=5)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "out of range",
    ),
    (pb.ExplainRequest(text="ok", method="nope"), grpc.StatusCode.INVALID_ARGUMENT, "unknown"),
    (
        pb.ExplainRequest(text="ok", method="integrated_gradients"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "SubmitJob",
    ),
    (pb.ExplainRequest(text="x" * 30_000), grpc.StatusCode.INVALID_ARGUMENT, "limit"),
    (
        pb.ExplainRequest(text="ok", text_pair=""),
        grpc.StatusCode.INVALID_ARGUMENT,
        "text_pair is empty",
    ),
]


def test_bad_requests_get_clear_errors_and_server_keeps_serving(
    sidecar: RunningSidecar,
) -> None:
    channel = grpc.insecure_channel(sidecar.target)
    s = explainer_pb2_grpc.ExplainerStub(channel)
    for _ in range(3):  # a burst
        for request, code, message in BAD_REQUESTS:
            with pytest.raises(grpc.RpcError) as err:
                s.Explain(request, timeout=30)
            assert err.value.code() == code
            assert message in (err.value.details() or "")
    # Invalid UTF-8 inside the pair: hand-made bytes, since protobuf refuses to build them.
    raw = pb.ExplainRequest(text="fine", text_pair="QQ").SerializeToString()
    raw = raw.replace(b"QQ", b"\xc3\x28")
    call = channel.unary_unary(
        "/limelight.v1.Explainer/Explain",
        request_serializer=lambda b: b,
        response_deserializer=pb.ExplainResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        call(raw, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in (err.value.details() or "")
    # A message over the size limit is refused by gRPC itself.
    with pytest.raises(grpc.RpcError) as err:
        s.Explain(pb.ExplainRequest(text="y" * (5 * 1024 * 1024)), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # An already-expired deadline.
    with pytest.raises(grpc.RpcError) as err:
        s.Explain(pb.ExplainRequest(text="ok"), timeout=0.000001)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # And the server still serves.
    ok = s.Explain(pb.ExplainRequest(text="still alive?"), timeout=30)
    assert ok.explanation.scores


@pytest.mark.parametrize(
    ("call", "request_", "message"),
    [
        ("ListJobs", pb.ListJobsRequest(states=[pb.JOB_STATE_UNSPECIFIED]), "is no state"),
        ("ListJobs", pb.ListJobsRequest(states=[99]), "states: unknown (99)"),  # type: ignore[list-item]
        ("ListJobs", pb.ListJobsRequest(limit=-5), "limit is -5"),
        ("GetDrift", pb.GetDriftRequest(top_k=-1), "top_k is -1"),
    ],
)
def test_listing_arguments_out_of_range_are_refused(
    sidecar: RunningSidecar, call: str, request_: Any, message: str
) -> None:
    """A negative page size or report length was read as the default, and the
    UNSPECIFIED state was called "unknown job state 0"."""
    s = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(sidecar.target))
    with pytest.raises(grpc.RpcError) as err:
        getattr(s, call)(request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")


def test_truncation_is_flagged_or_rejected(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    long_text = "great " * 100
    cut = start_sidecar(model_dir=bert_tiny_dir, max_tokens=16, jobs="off")
    r = stub(cut.target).Explain(pb.ExplainRequest(text=long_text), timeout=30)
    assert r.truncated and len(r.explanation.tokens) == 16
    strict = start_sidecar(model_dir=bert_tiny_dir, max_tokens=16, truncation="reject", jobs="off")
    with pytest.raises(grpc.RpcError) as err:
        stub(strict.target).Explain(pb.ExplainRequest(text=long_text), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "limit is 16" in (err.value.details() or "")


def test_metrics_endpoint_counts_requests(sidecar: RunningSidecar) -> None:
    s = stub(sidecar.target)
    s.Explain(pb.ExplainRequest(text="a fine film"), timeout=30)
    with pytest.raises(grpc.RpcError):
        s.Explain(pb.ExplainRequest(text=""), timeout=30)
    body = urllib.request.urlopen(sidecar.metrics_url, timeout=10).read().decode()
    assert 'limelight_request_duration_seconds_count{code="OK",rpc="Explain"}' in body
    assert 'limelight_request_duration_seconds_count{code="INVALID_ARGUMENT",rpc="Explain"}' in body
    assert "limelight_batch_size_bucket" in body
    assert 'limelight_inline_stage_duration_seconds_count{stage="forward"}' in body
    assert "limelight_predictions_total{label=" in body
    assert "limelight_ready 1.0" in body
    # The live exposition passes Prometheus' own linter.
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=body, capture_output=True, text=True, check=False
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_parameters_that_are_not_finite_are_named(sidecar: RunningSidecar) -> None:
    """A Struct can carry NaN and infinity (JSON cannot): the refusal named protobuf's JSON
    printer ("Fail to serialize NaN for Value.number_value, ...") instead of the parameter."""
    s = stub(sidecar.target)
    parameters = struct_pb2.Struct()
    parameters.update({"steps": math.nan, "nested": {"scale": math.inf}, "fine": 1})
    with pytest.raises(grpc.RpcError) as refused:
        s.SubmitJob(
            pb.SubmitJobRequest(text="ok", method="gradient", parameters=parameters), timeout=30
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details() or ""
    assert "nested.scale, steps must be finite numbers" in details, details
    assert "serialize" not in details


def test_a_cancelled_job_says_so_in_its_error(sidecar: RunningSidecar) -> None:
    """The proto: ``error`` is "Set when FAILED or CANCELLED"; a cancelled job had it empty, so
    a client that branches on it took the job for one that went well."""
    s = stub(sidecar.target)
    slow = struct_pb2.Struct()
    slow.update({"permutations": 256, "batch_size": 1})  # thousands of single forwards
    text = " ".join(["a long, slow, winding film that never quite finds its feet"] * 6)
    job = s.SubmitJob(pb.SubmitJobRequest(text=text, method="shapley", parameters=slow), timeout=30)
    s.CancelJob(pb.CancelJobRequest(id=job.id), timeout=30)

    def ended() -> pb.Job | None:
        now = s.GetJob(pb.GetJobRequest(id=job.id), timeout=30)
        return now if now.state in (pb.JOB_STATE_CANCELLED, pb.JOB_STATE_SUCCEEDED) else None

    done = wait_until(ended)
    assert done.state == pb.JOB_STATE_CANCELLED and "cancel" in done.error, done


def test_idempotency_keys_are_bounded(sidecar: RunningSidecar) -> None:
    """A key is stored with its job and indexed: 80 keys of 1 MB grew the journal by 240 MB."""
    s = stub(sidecar.target)
    longest = "k" * 256
    job = s.SubmitJob(
        pb.SubmitJobRequest(text="a film", method="random", idempotency_key=longest), timeout=30
    )
    assert job.idempotency_key == longest
    with pytest.raises(grpc.RpcError) as err:
        s.SubmitJob(
            pb.SubmitJobRequest(text="a film", method="random", idempotency_key=longest + "k"),
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "idempotency_key has 257 characters; at most 256" in (err.value.details() or "")


def test_a_job_page_over_the_answer_limit_says_to_ask_for_fewer_jobs(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    """It said "send a shorter text", to a call that sends none."""
    served = start_sidecar(model_dir=bert_tiny_dir, max_response_bytes=4096)
    s = stub(served.target)
    for i in range(20):
        key = f"{i:03d}" + "k" * 253  # the longest key (a listed job carries no text)
        s.SubmitJob(
            pb.SubmitJobRequest(text="a film", method="random", idempotency_key=key), timeout=30
        )
    with pytest.raises(grpc.RpcError) as err:
        s.ListJobs(pb.ListJobsRequest(), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "ask for fewer jobs per page (limit)" in (err.value.details() or "")
    assert len(s.ListJobs(pb.ListJobsRequest(limit=2), timeout=30).jobs) == 2
