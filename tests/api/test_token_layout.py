"""ExplainRequest.token_layout over a real sidecar: the same tokens in columns as in messages,
each input of a stream or a batch answered in the layout it asked for."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import pytest

from limelight_client import AsyncClient, Client
from limelight_client._common import (
    cancel_job_request,
    explain_request,
    get_job_request,
    submit_request,
)
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from limelight_client.types import Token
from tests.conftest import RunningSidecar

COLUMNS = pb.TOKEN_LAYOUT_COLUMNS
MESSAGES = pb.TOKEN_LAYOUT_MESSAGES


@pytest.fixture
def stub(sidecar: RunningSidecar) -> Iterator[explainer_pb2_grpc.ExplainerStub]:
    with grpc.insecure_channel(sidecar.target) as channel:
        yield explainer_pb2_grpc.ExplainerStub(channel)


def rows(explanation: pb.Explanation) -> list[tuple[str, int, int, int, bool, int]]:
    """The tokens as tuples, from whichever layout holds them (the other must be empty)."""
    columns = explanation.token_columns
    if explanation.tokens:
        assert not columns.text and not columns.id and not columns.segment
        return [(t.text, t.id, t.start, t.end, t.special, t.segment) for t in explanation.tokens]
    # Read by the proto's own field list, not the SDK's: an independent reference.
    fields: list[Sequence[Any]] = [
        getattr(columns, field.name) for field in pb.TokenColumns.DESCRIPTOR.fields
    ]
    assert {len(f) for f in fields} == {len(columns.text)}, "every column has a row per token"
    return list(zip(*fields, strict=True))


def same_answer(a: pb.ExplainResponse, b: pb.ExplainResponse) -> None:
    """Everything but the token layout is the same."""
    assert rows(a.explanation) == rows(b.explanation)
    assert a.label == b.label and a.explanation.method == b.explanation.method
    assert list(a.explanation.scores) == pytest.approx(list(b.explanation.scores), abs=1e-5)


def test_explain_answers_the_same_tokens_in_columns(
    stub: explainer_pb2_grpc.ExplainerStub,
) -> None:
    text, pair = "Not bad at all — a gorgeous, witty movie", "was it good?"
    as_messages = stub.Explain(pb.ExplainRequest(text=text, text_pair=pair), timeout=30)
    as_columns = stub.Explain(
        pb.ExplainRequest(text=text, text_pair=pair, token_layout=COLUMNS), timeout=30
    )
    assert len(as_messages.explanation.tokens) > 10
    assert not as_columns.explanation.tokens and as_columns.explanation.token_columns.text
    same_answer(as_columns, as_messages)
    tokens = rows(as_columns.explanation)
    # Both segments, the special tokens and the offsets survive the columns.
    assert {segment for *_, special, segment in tokens if not special} == {0, 1}
    assert tokens[0][4] and tokens[-1][4]
    for tok, _, start, end, special, segment in tokens:
        if not special:
            source = text if segment == 0 else pair
            assert source[start:end].lower() == tok.removeprefix("##")
    # The scores keep the token order.
    assert len(as_columns.explanation.scores) == len(tokens)
    # An answer in columns is smaller on the wire.
    assert as_columns.ByteSize() < as_messages.ByteSize()


def test_a_layout_the_server_does_not_know_is_answered_with_messages(
    stub: explainer_pb2_grpc.ExplainerStub,
) -> None:
    request = pb.ExplainRequest(text="a fine film")
    request.MergeFromString(b"\x50\x07")  # field 10 (token_layout) = 7, which no layout is
    assert request.token_layout == 7
    answer = stub.Explain(request, timeout=30)
    assert answer.explanation.tokens and not answer.explanation.token_columns.text


def test_each_input_of_a_stream_is_answered_in_its_own_layout(
    stub: explainer_pb2_grpc.ExplainerStub,
) -> None:
    texts = [f"review {i}: {'great ' * (i % 4)}fun, {'dull ' * (i % 3)}plot" for i in range(24)]
    layouts = [COLUMNS if i % 3 else MESSAGES for i in range(24)]
    requests = [
        pb.ExplainRequest(text=t, request_id=str(i), token_layout=layout, continue_on_error=True)
        for i, (t, layout) in enumerate(zip(texts, layouts, strict=True))
    ]
    requests[5].target.label = "no such label"  # answered in its place, the stream goes on
    answers = list(stub.ExplainStream(iter(requests), timeout=60))
    assert [a.request_id for a in answers] == [str(i) for i in range(24)]
    assert answers[5].HasField("error") and not answers[5].explanation.token_columns.text
    for i, answer in enumerate(answers):
        if i == 5:
            continue
        explanation = answer.explanation
        assert bool(explanation.tokens) == (layouts[i] == MESSAGES)
        assert bool(explanation.token_columns.text) == (layouts[i] == COLUMNS)
        alone = stub.Explain(pb.ExplainRequest(text=texts[i]), timeout=30)
        assert rows(explanation) == rows(alone.explanation)


def test_each_input_of_a_batch_is_answered_in_its_own_layout(
    stub: explainer_pb2_grpc.ExplainerStub,
) -> None:
    texts = [f"batch review {i}: {'superb ' * (i % 5)}acting" for i in range(9)]
    requests = [
        pb.ExplainRequest(text=t, token_layout=COLUMNS if i % 2 else MESSAGES)
        for i, t in enumerate(texts)
    ]
    answers = stub.ExplainBatch(pb.ExplainBatchRequest(requests=requests), timeout=60).responses
    for i, (text, answer) in enumerate(zip(texts, answers, strict=True)):
        assert bool(answer.explanation.token_columns.text) == bool(i % 2)
        alone = stub.Explain(pb.ExplainRequest(text=text), timeout=30)
        assert rows(answer.explanation) == rows(alone.explanation)


def test_the_sdk_asks_for_columns_and_reads_the_same_tokens(
    sidecar: RunningSidecar, stub: explainer_pb2_grpc.ExplainerStub
) -> None:
    text = "an unwatchable, overwrought misfire of a film"
    as_messages = stub.Explain(pb.ExplainRequest(text=text), timeout=30)
    expected = Token.all_from_proto(as_messages.explanation)
    with Client(sidecar.target) as client:
        assert client.explain(text).tokens == expected
        assert [e.tokens for e in client.explain_many([text, text])] == [expected, expected]
    # Every explain call of the SDK builds its requests here.
    assert explain_request(text, None, None, False, None, None).token_layout == COLUMNS


def test_a_jobs_result_is_listed_in_the_layout_each_request_asks_for(
    sidecar: RunningSidecar, stub: explainer_pb2_grpc.ExplainerStub
) -> None:
    text, key = "a tender, funny and quietly devastating film", "layout-job"
    submitted = stub.SubmitJob(
        pb.SubmitJobRequest(text=text, method="grad_x_input", idempotency_key=key), timeout=30
    )
    watched = list(
        stub.WatchJob(pb.GetJobRequest(id=submitted.id, token_layout=COLUMNS), timeout=300)
    )
    done = watched[-1]
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    # Every Job of the watch is in the layout the watch asked for; only the last has a result.
    assert all(not job.result.explanation.tokens for job in watched)
    as_columns = done.result.explanation
    assert as_columns.token_columns.text and not as_columns.tokens

    as_messages = stub.GetJob(pb.GetJobRequest(id=submitted.id), timeout=30)
    assert as_messages.result.explanation.tokens
    assert not as_messages.result.explanation.token_columns.text
    same_answer(done.result, as_messages.result)
    expected = rows(as_messages.result.explanation)
    # The same job, read through each job call in columns.
    reads = [
        stub.GetJob(pb.GetJobRequest(id=submitted.id, token_layout=COLUMNS), timeout=30),
        stub.CancelJob(pb.CancelJobRequest(id=submitted.id, token_layout=COLUMNS), timeout=30),
        # The idempotency key names the succeeded job: the submit answers with its result.
        stub.SubmitJob(
            pb.SubmitJobRequest(
                text=text, method="grad_x_input", idempotency_key=key, token_layout=COLUMNS
            ),
            timeout=30,
        ),
    ]
    for job in reads:
        assert job.id == submitted.id and job.state == pb.JOB_STATE_SUCCEEDED
        assert not job.result.explanation.tokens
        assert rows(job.result.explanation) == expected

    # The SDK asks for columns on every job call and reads the same tokens.
    tokens = Token.all_from_proto(as_messages.result.explanation)
    with Client(sidecar.target) as client:
        assert client.job(submitted.id).result(timeout=60).tokens == tokens

    async def read_async() -> list[Token]:
        async with AsyncClient(sidecar.target) as client:
            job = await client.job(submitted.id)
            return (await job.result(timeout=60)).tokens

    assert asyncio.run(read_async()) == tokens
    assert get_job_request("x").token_layout == COLUMNS
    assert cancel_job_request("x").token_layout == COLUMNS
    assert submit_request(text, "grad_x_input", None, None, None, None, {}).token_layout == COLUMNS
