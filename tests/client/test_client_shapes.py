"""The SDK's result types mirror the protobuf messages (and the server's own types) name for
name, and ``to_dict`` is every field: the shapes cannot drift apart silently."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import warnings
from typing import Any

import pytest
from google.protobuf.message import Message

from limelight_client.proto import explainer_pb2 as pb
from limelight_client.types import (
    DriftReport,
    Explanation,
    JobInfo,
    JobState,
    LabelDrift,
    MethodInfo,
    ModelInfo,
    Timings,
    Token,
    TokenShift,
)

# Each type with the message it is converted from, and the fields only the client has (with why).
MIRRORS: list[tuple[type, list[type[Message]], set[str]]] = [
    (Token, [pb.Token], set()),
    (Timings, [pb.Timings], set()),
    (MethodInfo, [pb.MethodInfo], set()),
    (ModelInfo, [pb.ModelInfo], set()),
    (JobInfo, [pb.Job], set()),
    (TokenShift, [pb.TokenShift], set()),
    (LabelDrift, [pb.LabelDrift], set()),
    (DriftReport, [pb.DriftReport], set()),
    # An ExplainResponse's own fields and its nested Explanation's, flattened; the inputs are
    # attached by the client (the server does not echo them).
    (Explanation, [pb.ExplainResponse, pb.Explanation], {"text", "text_pair"}),
]


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize(
    ("cls", "messages", "client_only"), MIRRORS, ids=[cls.__name__ for cls, _, _ in MIRRORS]
)
def test_fields_mirror_the_messages(
    cls: type, messages: list[type[Message]], client_only: set[str]
) -> None:
    proto = {f.name for m in messages for f in m.DESCRIPTOR.fields}
    if pb.ExplainResponse in messages:
        # ``explanation`` is flattened; an answer with ``error`` becomes that error (returned
        # or raised), never a result; ``token_columns`` is another layout of ``tokens``.
        proto -= {"explanation", "error", "token_columns"}
    assert _field_names(cls) == proto | client_only


def test_drift_types_use_the_servers_names() -> None:
    from limelight.drift import report as server

    for client_cls, server_cls in [
        (TokenShift, server.TokenShift),
        (LabelDrift, server.LabelDrift),
        (DriftReport, server.DriftReport),
    ]:
        assert _field_names(client_cls) == _field_names(server_cls)
    # The derived change of share has one name on both sides.
    assert isinstance(server.TokenShift.delta, property)
    assert TokenShift._derived == ("delta",)
    shift = TokenShift("refund", reference_share=0.01, current_share=0.2)
    assert shift.delta == pytest.approx(server.TokenShift("refund", 0.01, 0.2).delta)


def test_token_uses_the_servers_token_info_names() -> None:
    from limelight.core.types import TokenInfo

    assert [f.name for f in dataclasses.fields(Token)] == [
        f.name for f in dataclasses.fields(TokenInfo)
    ]


def test_token_shift_change_is_a_deprecated_alias_of_delta() -> None:
    shift = TokenShift("refund", reference_share=0.01, current_share=0.2)
    with pytest.warns(DeprecationWarning, match="delta"):
        assert shift.change == shift.delta


def _sample_job() -> JobInfo:
    result = Explanation(
        label="pos",
        label_index=1,
        labels=["neg", "pos"],
        probabilities={"neg": 0.1, "pos": 0.9},
        tokens=[Token("[CLS]", 101, 0, 0, special=True), Token("fun", 4569, 0, 3)],
        scores=[0.0, 1.5],
        method="slalom",
        target_label="pos",
        target_index=1,
        class_scores=[[0.0, 0.0], [-1.5, 1.5]],
        extra_scores={"value": [0.0, 2.0]},
        details={"heldout_r2": 0.97},
        text="fun",
    )
    return JobInfo(
        id="j1",
        state=JobState.SUCCEEDED,
        method="slalom",
        parameters={"num_samples": 500},
        progress=1.0,
        created_at=dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.timezone.utc),  # noqa: UP017
        attempts=1,
        result=result,
        model_name="bert-tiny",
        model_version="7334" * 16,
    )


def _check_every_field(obj: Any, data: dict[str, Any]) -> None:
    derived = getattr(type(obj), "_derived", ())
    assert list(data) == [f.name for f in dataclasses.fields(obj)] + list(derived)


def test_to_dict_is_every_field_recursively_and_json() -> None:
    job = _sample_job()
    data = job.to_dict()
    _check_every_field(job, data)
    assert job.result is not None
    _check_every_field(job.result, data["result"])
    _check_every_field(job.result.tokens[0], data["result"]["tokens"][0])
    _check_every_field(job.result.timings, data["result"]["timings"])
    assert data["state"] == "SUCCEEDED"
    assert data["created_at"] == "2026-11-23T12:00:00+00:00" and data["finished_at"] is None
    assert json.loads(json.dumps(data)) == data
    report = DriftReport(
        reference_state="ready",
        reference_count=100,
        window_count=50,
        alert_threshold=0.02,
        labels=[LabelDrift("pos", 0.05, True, 20, risers=[TokenShift("refund", 0.01, 0.2)])],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # to_dict must not touch the deprecated alias
        drift = report.to_dict()
    shift = drift["labels"][0]["risers"][0]
    assert shift == {
        "token": "refund",
        "reference_share": 0.01,
        "current_share": 0.2,
        "delta": pytest.approx(0.19),
    }


def test_token_columns_have_a_column_for_every_token_field() -> None:
    """TOKEN_LAYOUT_COLUMNS carries the same fields as a Token message, in the same order
    (the SDK reads both into ``Token``)."""
    columns = [f.name for f in pb.TokenColumns.DESCRIPTOR.fields]
    assert columns == [f.name for f in pb.Token.DESCRIPTOR.fields]
    assert all(f.is_repeated for f in pb.TokenColumns.DESCRIPTOR.fields)
    assert columns == [f.name for f in dataclasses.fields(Token)]


def test_job_info_reads_every_field_of_a_job_message() -> None:
    """Every field of the ``Job`` message reaches ``JobInfo`` under its own name."""
    fields = [f.name for f in pb.Job.DESCRIPTOR.fields]
    assert fields == [f.name for f in dataclasses.fields(JobInfo)]
    info = JobInfo.from_proto(
        pb.Job(id="j2", state=pb.JOB_STATE_QUEUED, method="slalom", no_worker=True, attempts=2)
    )
    assert (info.state, info.no_worker, info.attempts) == (JobState.QUEUED, True, 2)
    assert not JobInfo.from_proto(pb.Job(id="j3", state=pb.JOB_STATE_QUEUED)).no_worker
