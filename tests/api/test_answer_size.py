"""Answers over the server's send limit (``max_response_bytes``), over a real socket: the call
fails RESOURCE_EXHAUSTED with the answer's size and what to do (gRPC alone said only "Sent
message larger than max", after logging the call as a client hang-up); a stream answers such an
input in its place when it asked for ``continue_on_error``; the server keeps serving."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from limelight_client import Client
from limelight_client.errors import ResourceExhausted
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar

#: A review long enough to fill the 512-token limit (its answer: a few tens of kB).
LONG = " ".join(["a genuinely moving and funny film with superb acting throughout"] * 60)


def stub(sidecar: RunningSidecar) -> explainer_pb2_grpc.ExplainerStub:
    return explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(sidecar.target))


def test_a_batch_whose_answer_is_too_large_says_its_size_and_to_split_it(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    sidecar = start_sidecar(model_dir=bert_tiny_dir, max_response_bytes=200_000)
    explainer = stub(sidecar)
    one = explainer.Explain(pb.ExplainRequest(text=LONG), timeout=60).ByteSize()
    fits = 200_000 // one
    assert fits >= 2  # the test's premise: a few answers fit, many do not

    too_many = pb.ExplainBatchRequest(requests=[pb.ExplainRequest(text=LONG)] * (3 * fits))
    with pytest.raises(grpc.RpcError) as refused:
        explainer.ExplainBatch(too_many, timeout=120)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = refused.value.details() or ""
    assert "MiB, above this server's limit of 0.2 MiB" in details
    assert "fewer texts per call" in details

    # Split as told, the same texts are answered; streamed, each on its own.
    batch = pb.ExplainBatchRequest(requests=[pb.ExplainRequest(text=LONG)] * fits)
    assert len(explainer.ExplainBatch(batch, timeout=120).responses) == fits
    streamed = list(explainer.ExplainStream(iter(too_many.requests), timeout=120))
    assert len(streamed) == 3 * fits and all(r.explanation.scores for r in streamed)

    # The SDK raises its typed error, with the same message.
    with Client(sidecar.target, timeout=120, retries=0) as client:
        with pytest.raises(ResourceExhausted, match="fewer texts per call"):
            client.explain_batch([LONG] * (3 * fits))
        assert client.explain("a witty film").label


def test_one_answer_too_large_alone(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    sidecar = start_sidecar(model_dir=bert_tiny_dir, max_response_bytes=5_000)
    explainer = stub(sidecar)
    with pytest.raises(grpc.RpcError) as refused:
        explainer.Explain(pb.ExplainRequest(text=LONG), timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "send a shorter text" in (refused.value.details() or "")

    def inputs(continue_on_error: bool) -> list[pb.ExplainRequest]:
        return [
            pb.ExplainRequest(text=text, request_id=str(i), continue_on_error=continue_on_error)
            for i, text in enumerate(["a witty film", LONG, "a dull film"])
        ]

    # In a stream that asked to go on, in its place; the inputs around it are answered.
    answers = list(explainer.ExplainStream(iter(inputs(True)), timeout=60))
    assert [a.request_id for a in answers] == ["0", "1", "2"]
    assert answers[0].explanation.scores and answers[2].explanation.scores
    assert answers[1].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "above this server's limit" in answers[1].error.message
    # Otherwise it ends the stream, after the answer before it.
    got = []
    with pytest.raises(grpc.RpcError) as ended:
        for answer in explainer.ExplainStream(iter(inputs(False)), timeout=60):
            got.append(answer)
    assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [a.request_id for a in got] == ["0"]
    assert explainer.Explain(pb.ExplainRequest(text="a witty film"), timeout=60).label
