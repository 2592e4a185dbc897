"""Inputs of a stream or batch that fail and asked for ``continue_on_error``: answered in their
place by their error, the others answered as usual, the call kept open; over a real socket,
raw gRPC and the SDK (sync and asyncio, streamed and packed). ``limelight explain --lines
--keep-going``: tests/cli/test_explain_cli.py."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from limelight_client import AsyncClient, Client, Explanation
from limelight_client.errors import (
    DeadlineExceeded,
    InvalidArgument,
    LimelightError,
    ResourceExhausted,
)
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar

#: Inputs the server refuses one by one, with what a call of their own would have failed with.
REFUSED = {
    2: (pb.ExplainRequest(text=""), "text is empty"),
    5: (pb.ExplainRequest(text="ok", target=pb.Target(label="meh")), "unknown label 'meh'"),
    6: (pb.ExplainRequest(text="x" * 30_000), "limit"),
    9: (pb.ExplainRequest(text="ok", method="nope"), "unknown"),
}


def requests(n: int, continue_on_error: bool = True) -> list[pb.ExplainRequest]:
    """``n`` requests, the ones of ``REFUSED`` at their places, each with its index as id."""
    out = []
    for i in range(n):
        request = pb.ExplainRequest()
        request.CopyFrom(REFUSED[i][0] if i in REFUSED else pb.ExplainRequest(text=f"film {i}"))
        request.request_id = str(i)
        request.continue_on_error = continue_on_error
        out.append(request)
    return out


def check_answers(responses: list[pb.ExplainResponse], n: int, alone: pb.ExplainResponse) -> None:
    assert [r.request_id for r in responses] == [str(i) for i in range(n)]
    for i, r in enumerate(responses):
        if i in REFUSED:
            assert r.HasField("error") and not r.HasField("explanation") and not r.label
            assert r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert REFUSED[i][1] in r.error.message
        else:
            assert not r.HasField("error") and r.label and r.explanation.scores
    # An answer among failures is the one a call of its own gets.
    assert responses[1].label == alone.label
    assert list(responses[1].probabilities) == pytest.approx(list(alone.probabilities), abs=1e-5)


def test_stream_answers_failed_inputs_in_their_place_and_goes_on(
    sidecar: RunningSidecar,
) -> None:
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(sidecar.target))
    alone = stub.Explain(pb.ExplainRequest(text="film 1"), timeout=30)
    responses = list(stub.ExplainStream(iter(requests(12)), timeout=60))
    check_answers(responses, 12, alone)
    # Without the flag the first failure ends the stream, after the answers before it.
    call = stub.ExplainStream(iter(requests(12, continue_on_error=False)), timeout=60)
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for response in call:
            got.append(response)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text is empty" in (err.value.details() or "")
    assert [r.request_id for r in got] == ["0", "1"]
    # Failures in place are counted, by RPC and the code they would have had.
    body = urllib.request.urlopen(sidecar.metrics_url, timeout=10).read().decode()
    assert 'limelight_item_errors_total{code="INVALID_ARGUMENT",rpc="ExplainStream"} 4.0' in body


def test_stream_flag_is_per_input(sidecar: RunningSidecar) -> None:
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(sidecar.target))
    sent = requests(12)
    sent[6].continue_on_error = False  # the third failure ends the stream
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for response in stub.ExplainStream(iter(sent), timeout=60):
            got.append(response)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "limit" in (err.value.details() or "")
    assert [r.request_id for r in got] == [str(i) for i in range(6)]
    assert [r.HasField("error") for r in got] == [i in REFUSED for i in range(6)]


def test_a_message_that_cannot_be_read_still_ends_the_stream(sidecar: RunningSidecar) -> None:
    # Invalid UTF-8: not even its continue_on_error can be read.
    channel = grpc.insecure_channel(sidecar.target)
    good = pb.ExplainRequest(text="fine", continue_on_error=True).SerializeToString()
    bad = pb.ExplainRequest(text="QQ", continue_on_error=True).SerializeToString()
    bad = bad.replace(b"QQ", b"\xc3\x28")
    call = channel.stream_stream(
        "/limelight.v1.Explainer/ExplainStream",
        request_serializer=lambda b: b,
        response_deserializer=pb.ExplainResponse.FromString,
    )
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for response in call(iter([good, bad, good]), timeout=60):
            got.append(response)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in (err.value.details() or "")
    assert len(got) == 1 and got[0].label


def test_batch_answers_failed_inputs_in_their_place(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    running = start_sidecar(model_dir=bert_tiny_dir, max_batch_request_items=12, jobs="off")
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(running.target))
    alone = stub.Explain(pb.ExplainRequest(text="film 1"), timeout=30)
    batch = stub.ExplainBatch(pb.ExplainBatchRequest(requests=requests(12)), timeout=60)
    check_answers(list(batch.responses), 12, alone)
    # The good inputs still share forward passes.
    assert max(r.timings.batch_size for r in batch.responses) > 1
    # One input that did not ask to go on fails the whole call, naming it.
    sent = requests(12)
    sent[5].continue_on_error = False
    with pytest.raises(grpc.RpcError) as err:
        stub.ExplainBatch(pb.ExplainBatchRequest(requests=sent), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("input 5: unknown label")
    # The call's own limits still fail the call.
    with pytest.raises(grpc.RpcError) as big:
        stub.ExplainBatch(pb.ExplainBatchRequest(requests=requests(13)), timeout=60)
    assert "at most 12" in (big.value.details() or "")


TEXTS = ["a gorgeous film", "", "a dull mess", "x" * 30_000, "witty and warm", "   "]
BAD = {1: "text is empty", 3: "limit", 5: "text is empty"}


def check_outcomes(outcomes: list[Explanation | LimelightError]) -> None:
    assert len(outcomes) == len(TEXTS)
    for i, outcome in enumerate(outcomes):
        if i in BAD:
            assert isinstance(outcome, InvalidArgument), outcome
            assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
            assert BAD[i] in outcome.message
        else:
            assert isinstance(outcome, Explanation) and outcome.text == TEXTS[i]


def test_sdk_return_exceptions_sync_and_async(sidecar: RunningSidecar) -> None:
    with Client(sidecar.target, timeout=60, connections=2) as client:
        check_outcomes(list(client.explain_many(TEXTS, return_exceptions=True)))
        check_outcomes(
            list(client.explain_many(iter(TEXTS), texts_per_call=4, return_exceptions=True))
        )
        check_outcomes(client.explain_batch(TEXTS, return_exceptions=True))
        # By default the first failure is raised.
        with pytest.raises(InvalidArgument, match="text is empty"):
            list(client.explain_many(TEXTS))
        with pytest.raises(InvalidArgument, match="input 1: text is empty"):
            client.explain_batch(TEXTS)

    async def run_async() -> list[list[Explanation | LimelightError]]:
        async with AsyncClient(sidecar.target, timeout=60) as client:
            streamed = [e async for e in client.explain_many(TEXTS, return_exceptions=True)]
            packed = [
                e
                async for e in client.explain_many(TEXTS, texts_per_call=3, return_exceptions=True)
            ]
            batch = await client.explain_batch(TEXTS, return_exceptions=True)
            return [streamed, packed, batch]

    for outcomes in asyncio.run(run_async()):
        check_outcomes(outcomes)


def test_inputs_refused_for_capacity_come_back_to_be_sent_again(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    # Twelve inputs at once against a backlog of one (a call's inputs enter it up to two
    # batches, eight, at a time): some are refused for capacity, each in its place, so a
    # caller sends exactly those again and loses none.
    side = start_sidecar(model_dir=bert_tiny_dir, jobs="off", max_pending=1, max_batch_size=4)
    texts = [f"an ambitious, sprawling film, take {i}" for i in range(12)]
    with Client(side.target, timeout=60) as client:
        first = client.explain_batch(texts, return_exceptions=True)
        refused = [i for i, r in enumerate(first) if isinstance(r, LimelightError)]
        assert refused and len(refused) < len(texts)
        assert all(isinstance(first[i], ResourceExhausted) for i in refused)
        outcomes = list(first)
        for _ in range(len(texts)):  # each round gets at least the backlog's worth through
            if not refused:
                break
            again = client.explain_batch([texts[i] for i in refused], return_exceptions=True)
            for i, r in zip(refused, again, strict=True):
                outcomes[i] = r
            refused = [
                i for i, r in zip(refused, again, strict=True) if isinstance(r, LimelightError)
            ]
    assert [r.text for r in outcomes if isinstance(r, Explanation)] == texts
    body = urllib.request.urlopen(side.metrics_url, timeout=10).read().decode()
    assert 'limelight_item_errors_total{code="RESOURCE_EXHAUSTED",rpc="ExplainBatch"}' in body


def test_an_unexpected_failure_in_place_is_internal_and_logged(
    start_sidecar: Callable[..., RunningSidecar],
    bert_tiny_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    side = start_sidecar(model_dir=bert_tiny_dir, jobs="off")
    service = side.server.app.service
    assemble = service._assemble

    def broken(request: Any, *args: Any) -> Any:
        if "boom" in request.text:
            raise RuntimeError("secret internals")
        return assemble(request, *args)

    monkeypatch.setattr(service, "_assemble", broken)
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(side.target))
    sent = [
        pb.ExplainRequest(text=t, request_id=t, continue_on_error=True)
        for t in ("fine", "boom", "fine too")
    ]
    got = list(stub.ExplainStream(iter(sent), timeout=60))
    assert [r.request_id for r in got] == ["fine", "boom", "fine too"]
    assert got[0].label and got[2].label
    assert got[1].error.code == grpc.StatusCode.INTERNAL.value[0]
    assert "secret" not in got[1].error.message and "server log" in got[1].error.message
    assert "secret internals" in caplog.text  # the details go to the server's log only


def _batches(metrics_url: str) -> float:
    body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(
        float(line.split()[-1])
        for line in body.splitlines()
        if line.startswith("limelight_batch_size_count")
    )


def test_an_input_past_its_own_timeout_is_skipped_not_computed(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    side = start_sidecar(model_dir=bert_tiny_dir, jobs="off")
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(side.target))
    stub.Explain(pb.ExplainRequest(text="warm"), timeout=30)
    before = _batches(side.metrics_url)
    # Budgets spent before the inputs are even read: none reaches a forward pass.
    late = [
        pb.ExplainRequest(text=f"film {i}", continue_on_error=True, timeout_seconds=1e-9)
        for i in range(5)
    ]
    answers = list(stub.ExplainStream(iter(late), timeout=60))
    assert [a.error.code for a in answers] == [grpc.StatusCode.DEADLINE_EXCEEDED.value[0]] * 5
    assert _batches(side.metrics_url) == before
    # Mixed with inputs that have time, and budgets that are not numbers of seconds.
    mixed = [
        pb.ExplainRequest(text="film a", continue_on_error=True, timeout_seconds=60),
        pb.ExplainRequest(text="film b", continue_on_error=True, timeout_seconds=1e-9),
        pb.ExplainRequest(text="film c", continue_on_error=True, timeout_seconds=-1),
        pb.ExplainRequest(text="film d", continue_on_error=True, timeout_seconds=float("nan")),
        pb.ExplainRequest(text="film e", continue_on_error=True),
    ]
    got = list(stub.ExplainStream(iter(mixed), timeout=60))
    codes = [r.error.code if r.HasField("error") else 0 for r in got]
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert codes == [0, grpc.StatusCode.DEADLINE_EXCEEDED.value[0], invalid, invalid, 0]
    assert "timeout_seconds" in got[2].error.message
    # A unary call honours the earlier of its deadline and its own budget.
    with pytest.raises(grpc.RpcError) as err:
        stub.Explain(pb.ExplainRequest(text="film", timeout_seconds=1e-9), timeout=30)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    ok = stub.Explain(pb.ExplainRequest(text="film", timeout_seconds=30), timeout=30)
    assert ok.label


def test_sdk_text_timeout(sidecar: RunningSidecar) -> None:
    texts = ["a fine film", "a dull film", "a witty film"]
    with Client(sidecar.target, timeout=60) as client:
        late = list(client.explain_many(texts, text_timeout=1e-9, return_exceptions=True))
        assert all(isinstance(r, DeadlineExceeded) for r in late)
        with pytest.raises(DeadlineExceeded):
            list(client.explain_many(texts, text_timeout=1e-9))
        timely = list(client.explain_many(texts, text_timeout=60, texts_per_call=2))
        assert [r.text for r in timely] == texts
        for bad in (0, -1, float("inf")):
            with pytest.raises(ValueError, match="text_timeout"):
                client.explain_many(texts, text_timeout=bad)

    async def run_async() -> list[Explanation | LimelightError]:
        async with AsyncClient(sidecar.target, timeout=60) as client:
            stream = client.explain_many(texts, text_timeout=1e-9, return_exceptions=True)
            return [r async for r in stream]

    assert all(isinstance(r, DeadlineExceeded) for r in asyncio.run(run_async()))
