"""Protobuf -> typed result conversion, rankings and serialisation."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Callable

import pytest
from google.protobuf import struct_pb2

from limelight_client import Explanation, JobInfo, JobState, Token
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.types import DriftReport, ModelInfo

Factory = Callable[..., pb.ExplainResponse]

TEXT = "The movie wasn't bad at all!"


def test_explanation_from_proto_fields(response_factory: Factory) -> None:
    msg = response_factory(TEXT, request_id="r-1", all_classes=True)
    msg.explanation.parameters.update({"layer": 3, "variant": "eq6"})
    msg.explanation.details.update({"mask": "none"})
    msg.explanation.extra_scores["value"].values.extend([0.5] * len(msg.explanation.tokens))
    msg.truncated = True

    exp = Explanation.from_proto(msg, text=TEXT)

    assert exp.label == "negative" and exp.label_index == 0  # len(TEXT) is even
    assert exp.labels == ["negative", "positive"]
    assert exp.probabilities == {"negative": 0.75, "positive": 0.25}
    assert exp.request_id == "r-1"
    assert exp.model_name == "tiny" and exp.model_version == "abc123"
    assert exp.truncated is True
    assert exp.method == "normxlogit"
    assert exp.parameters == {"layer": 3, "variant": "eq6"}
    assert isinstance(exp.parameters["layer"], int)
    assert exp.details == {"mask": "none"}
    assert exp.text == TEXT and exp.text_pair is None
    assert exp.timings.batch_size == 2
    assert exp.timings.total_seconds == pytest.approx(0.004)

    assert len(exp.tokens) == len(msg.explanation.tokens) == len(exp.scores)
    first, word, last = exp.tokens[0], exp.tokens[2], exp.tokens[-1]
    assert first == Token("[CLS]", 101, 0, 0, special=True, segment=0)
    assert last.special and last.text == "[SEP]"
    assert (word.text, word.start, word.end, word.special) == ("movie", 4, 9, False)
    assert TEXT[word.start : word.end] == "movie"
    assert exp.scores == pytest.approx(list(msg.explanation.scores))
    assert exp.class_scores is not None
    assert exp.class_scores[2] == pytest.approx([-exp.scores[2], exp.scores[2]])
    assert exp.extra_scores == {"value": [0.5] * len(exp.tokens)}


def test_explanation_without_class_scores_and_unknown_text(response_factory: Factory) -> None:
    exp = Explanation.from_proto(response_factory("ok then"))
    assert exp.class_scores is None
    assert exp.extra_scores == {}
    assert exp.text is None


def test_explanation_is_frozen(response_factory: Factory) -> None:
    exp = Explanation.from_proto(response_factory(TEXT))
    assert repr(exp) == (
        "Explanation(label='negative', p=0.750, target='negative', method='normxlogit', "
        "tokens=11, model='tiny@abc123')"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        exp.label = "other"  # type: ignore[misc]


def test_score_array_by_name(response_factory: Factory) -> None:
    msg = response_factory(TEXT, all_classes=True)
    msg.explanation.extra_scores["importance"].values.extend(range(len(msg.explanation.tokens)))
    exp = Explanation.from_proto(msg)
    assert exp.score_array() == exp.scores
    assert exp.score_array("importance") == [float(i) for i in range(len(exp.tokens))]
    assert exp.score_array("positive") == pytest.approx(exp.scores)
    assert exp.score_array("negative") == pytest.approx([-s for s in exp.scores])
    assert exp.score_names == ["scores", "importance", "negative", "positive"]
    with pytest.raises(KeyError, match="available"):
        exp.score_array("nope")


def test_top_excludes_special_tokens(response_factory: Factory) -> None:
    exp = Explanation.from_proto(response_factory(TEXT))
    # Specials carry 9.0, far above every word: a ranking that kept them would return them.
    top = exp.top(3)
    assert all(not tok.special for tok, _ in top)
    expected = sorted(
        ((t, s) for t, s in zip(exp.tokens, exp.scores, strict=True) if not t.special),
        key=lambda p: -p[1],
    )[:3]
    assert top == expected
    assert [s for _, s in top] == sorted((s for _, s in top), reverse=True)
    assert top[0][1] > 0


def test_top_absolute_keeps_sign(response_factory: Factory) -> None:
    exp = Explanation.from_proto(response_factory(TEXT))
    top = exp.top(2, absolute=True)
    words = [(t, s) for t, s in zip(exp.tokens, exp.scores, strict=True) if not t.special]
    strongest = max(words, key=lambda p: abs(p[1]))
    assert top[0] == strongest
    assert any(s < 0 for _, s in exp.top(len(words), absolute=True))
    assert len(exp.top(100)) == len(words)
    assert exp.top(0) == []


def test_to_dict_is_json_roundtrippable(response_factory: Factory) -> None:
    msg = response_factory(TEXT, all_classes=True)
    msg.explanation.parameters.update({"steps": 50})
    exp = Explanation.from_proto(msg, text=TEXT)
    data = json.loads(json.dumps(exp.to_dict()))
    assert data["label"] == exp.label
    assert data["tokens"][2] == {
        "text": "movie",
        "id": exp.tokens[2].id,
        "start": 4,
        "end": 9,
        "special": False,
        "segment": 0,
    }
    assert data["scores"] == pytest.approx(exp.scores)
    assert data["class_scores"][1] == pytest.approx(exp.class_scores[1])  # type: ignore[index]
    assert data["parameters"] == {"steps": 50}
    assert data["timings"]["batch_size"] == 2
    assert data["text"] == TEXT


def test_text_pair_tokens_have_segment_one(response_factory: Factory) -> None:
    exp = Explanation.from_proto(
        response_factory("A man sleeps.", "Nobody sleeps."),
        text="A man sleeps.",
        text_pair="Nobody sleeps.",
    )
    pair_words = [t for t in exp.tokens if t.segment == 1 and not t.special]
    assert [t.text for t in pair_words] == ["Nobody", "sleeps", "."]
    assert exp.text_pair is not None
    assert all(exp.text_pair[t.start : t.end] == t.text for t in pair_words)


def test_job_state_mirrors_proto() -> None:
    names = {v.name for v in pb.JobState.DESCRIPTOR.values}
    assert {f"JOB_STATE_{s.name}" for s in JobState} == names
    for s in JobState:
        assert pb.JobState.Value(f"JOB_STATE_{s.name}") == int(s)
    assert [s for s in JobState if s.terminal] == [
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
    ]
    assert JobState.parse("running") is JobState.RUNNING
    assert JobState.parse("JOB_STATE_FAILED") is JobState.FAILED
    assert JobState.parse(1) is JobState.QUEUED
    with pytest.raises(ValueError):
        JobState.parse("exploded")


def test_job_info_from_proto(response_factory: Factory) -> None:
    params = struct_pb2.Struct()
    params.update({"n_samples": 500})
    job = pb.Job(
        id="j1",
        state=pb.JOB_STATE_SUCCEEDED,
        method="slalom",
        parameters=params,
        progress=1.0,
        message="done",
        attempts=2,
        idempotency_key="k",
    )
    job.created_at.FromSeconds(1_700_000_000)
    job.finished_at.FromSeconds(1_700_000_042)
    job.result.CopyFrom(response_factory(TEXT))

    info = JobInfo.from_proto(job, text=TEXT)
    assert info.state is JobState.SUCCEEDED and info.done
    assert info.parameters == {"n_samples": 500}
    assert info.created_at == dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=dt.timezone.utc)  # noqa: UP017
    assert info.finished_at is not None and info.created_at is not None
    assert (info.finished_at - info.created_at).total_seconds() == 42
    assert info.started_at is None
    assert info.attempts == 2 and info.idempotency_key == "k"
    assert info.result is not None and info.result.text == TEXT
    data = json.loads(json.dumps(info.to_dict()))
    assert data["state"] == "SUCCEEDED" and data["started_at"] is None

    queued = JobInfo.from_proto(pb.Job(id="j2", state=pb.JOB_STATE_QUEUED))
    assert queued.result is None and not queued.done


def test_model_info_from_proto() -> None:
    defaults = struct_pb2.Struct()
    defaults.update({"tau": 5})
    msg = pb.ModelInfo(
        name="m",
        version="v",
        architecture="BertForSequenceClassification",
        labels=["a", "b", "c"],
        num_layers=4,
        methods=[
            pb.MethodInfo(name="normxlogit", cost="inline"),
            pb.MethodInfo(name="gradcam", cost="job", defaults=defaults, unavailable_reason="x"),
        ],
        default_method="normxlogit",
        max_tokens=512,
        supports_text_pair=True,
    )
    info = ModelInfo.from_proto(msg)
    assert info.labels == ["a", "b", "c"] and info.num_layers == 4 and info.max_tokens == 512
    assert info.method("normxlogit").available
    gc = info.method("gradcam")
    assert not gc.available and gc.defaults == {"tau": 5} and gc.cost == "job"
    with pytest.raises(KeyError):
        info.method("lime")
    assert json.loads(json.dumps(info.to_dict()))["methods"][1]["unavailable_reason"] == "x"


def test_drift_report_from_proto() -> None:
    msg = pb.DriftReport(
        reference_state="ready",
        reference_count=10,
        window_count=5,
        alert_threshold=0.2,
        labels=[
            pb.LabelDrift(
                label="pos",
                divergence=0.5,
                alert=True,
                window_count=3,
                risers=[pb.TokenShift(token="refund", reference_share=0.01, current_share=0.2)],
            ),
            pb.LabelDrift(label="neg", divergence=0.1),
        ],
    )
    report = DriftReport.from_proto(msg)
    assert [d.label for d in report.alerts] == ["pos"]
    riser = report.label("pos").risers[0]
    assert riser.token == "refund" and riser.delta == pytest.approx(0.19)
    assert report.generated_at is None
    assert json.loads(json.dumps(report.to_dict()))["labels"][0]["risers"][0]["token"] == "refund"
    # A sidecar older than the sample rate leaves it 0: it observed every explanation.
    assert report.sample_rate == 1.0
    assert DriftReport.from_proto(pb.DriftReport(sample_rate=0.25)).sample_rate == 0.25


def test_top_puts_nan_last(response_factory: Factory) -> None:
    msg = response_factory("a b c")
    msg.explanation.scores[1] = float("nan")  # "a"
    exp = Explanation.from_proto(msg)
    ranked = exp.top(3)
    assert [t.text for t, _ in ranked] == ["c", "b", "a"]
    assert [t.text for t, _ in exp.top(3, absolute=True)] == ["c", "b", "a"]


def test_struct_numbers() -> None:
    from limelight_client.types import dict_to_struct, struct_to_dict

    values = {"steps": 50, "lr": 0.005, "nested": {"k": [1, 2.5, -3]}, "flag": True, "s": "x"}
    back = struct_to_dict(dict_to_struct(values))
    assert back == values
    assert isinstance(back["steps"], int) and isinstance(back["lr"], float)
    assert isinstance(back["nested"]["k"][0], int) and back["flag"] is True
    with pytest.raises(TypeError, match="JSON-like"):
        dict_to_struct({"x": object()})


def test_tokens_in_columns_read_as_the_same_tokens(response_factory: Factory) -> None:
    """A server asked for TOKEN_LAYOUT_COLUMNS lists the tokens in columns; an older one
    ignores the field and sends Token messages: the SDK reads either to the same result."""
    as_messages = response_factory(TEXT, request_id="r-2")
    as_columns = pb.ExplainResponse()
    as_columns.CopyFrom(as_messages)
    del as_columns.explanation.tokens[:]
    columns = as_columns.explanation.token_columns
    for tok in as_messages.explanation.tokens:
        columns.text.append(tok.text)
        columns.id.append(tok.id)
        columns.start.append(tok.start)
        columns.end.append(tok.end)
        columns.special.append(tok.special)
        columns.segment.append(tok.segment)
    expected = Explanation.from_proto(as_messages, text=TEXT)
    read = Explanation.from_proto(as_columns, text=TEXT)
    assert read == expected and read.to_dict() == expected.to_dict()
    assert [hash(t) for t in read.tokens] == [hash(t) for t in expected.tokens]
    assert read.words() == expected.words()
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.tokens[1].text = "changed"  # type: ignore[misc]
    assert Token.all_from_proto(pb.Explanation()) == []
    del columns.segment[-1]  # a malformed answer: columns of different lengths
    with pytest.raises(ValueError):
        Token.all_from_proto(as_columns.explanation)


def test_thresholds_read_back_as_they_were_set(response_factory: Factory) -> None:
    """Thresholds travel as 32-bit floats: 0.3 arrives as 0.30000001192092896 read as a double.
    The SDK gives back the shortest decimal of that float32, as the server was told it."""
    from limelight_client.types import float32_value

    set_to = [0.3, 0.5, 0.123456789, 1e-6]
    labels = ["a", "b", "c", "d"]
    info = ModelInfo.from_proto(pb.ModelInfo(name="m", labels=labels, thresholds=set_to))
    msg = response_factory(TEXT)
    msg.labels[:] = labels
    msg.probabilities[:] = [0.1] * 4
    msg.multi_label = True
    msg.thresholds.extend(set_to)
    exp = Explanation.from_proto(msg)
    expected = {"a": 0.3, "b": 0.5, "c": 0.12345679, "d": 1e-6}
    assert info.thresholds == expected and exp.thresholds == expected
    assert '"a": 0.3,' in json.dumps(exp.to_dict()) and '"a": 0.3,' in json.dumps(info.to_dict())
    # the same float32 as was sent, whatever the value
    for value in (*set_to, 2 / 3, 3.4e38, 1e-45, 0.0, -0.25, float("inf")):
        sent = pb.ModelInfo(thresholds=[value]).thresholds[0]
        assert pb.ModelInfo(thresholds=[float32_value(sent)]).thresholds[0] == sent
