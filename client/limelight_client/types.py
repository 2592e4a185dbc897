"""Typed, frozen result objects converted from the protobuf messages of ``limelight.v1``.

The objects are frozen dataclasses: attributes cannot be rebound. They hold plain Python values
(lists, dicts, floats) so that they need nothing beyond the standard library to use and
``to_dict()`` is JSON-serialisable as is.
"""

from __future__ import annotations

import datetime as _dt
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import json_format, struct_pb2, timestamp_pb2

from limelight_client.proto import explainer_pb2 as pb

__all__ = [
    "DriftReport",
    "Explanation",
    "JobInfo",
    "JobState",
    "LabelDrift",
    "MethodInfo",
    "ModelInfo",
    "Timings",
    "Token",
    "TokenShift",
    "Word",
]

#: The name under which ``Explanation.scores`` is addressed in ``score_array`` and the renderers.
TARGET_SCORES = "scores"


def _ints(value: Any) -> Any:
    # A Struct stores every number as a double; give integral ones back as ints so that
    # parameters read naturally (steps=50, not 50.0). Equality with the float is unchanged.
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


def struct_to_dict(message: struct_pb2.Struct) -> dict[str, Any]:
    """A ``google.protobuf.Struct`` as a plain dict; integral numbers come back as ints."""
    return {k: _ints(v) for k, v in json_format.MessageToDict(message).items()}


def dict_to_struct(values: Mapping[str, Any]) -> struct_pb2.Struct:
    """A plain JSON-like mapping as a ``google.protobuf.Struct``.

    Raises ``TypeError`` for values a Struct cannot hold (only JSON types are allowed).
    """
    struct = struct_pb2.Struct()
    try:
        struct.update(dict(values))
    except (ValueError, TypeError, AttributeError) as exc:
        raise TypeError(
            f"parameters must be JSON-like (str, number, bool, list, dict): {exc}"
        ) from exc
    return struct


def _timestamp(message: Any, name: str) -> _dt.datetime | None:
    if not message.HasField(name):
        return None
    ts: timestamp_pb2.Timestamp = getattr(message, name)
    return ts.ToDatetime(tzinfo=_dt.timezone.utc)  # noqa: UP017 (client supports Python 3.10)


def strip_piece_marker(text: str) -> str:
    """A token string without its tokenizer marker (WordPiece ``##``, BPE ``Ġ``/``Ċ``,
    SentencePiece ``▁``)."""
    for marker in ("##", "Ġ", "▁", "Ċ"):
        if text.startswith(marker):
            return text[len(marker) :]
    return text


@dataclass(frozen=True)
class Token:
    """One model token with its character span ``[start, end)`` in its segment's text.

    ``segment`` is 0 for ``text`` and 1 for ``text_pair``; ``special`` marks tokens the
    tokenizer added (``[CLS]``, ``<s>``, ...), which have no span and are never ranked.
    """

    text: str
    id: int
    start: int
    end: int
    special: bool = False
    segment: int = 0

    @classmethod
    def from_proto(cls, message: pb.Token) -> Token:
        return cls(
            text=message.text,
            id=message.id,
            start=message.start,
            end=message.end,
            special=message.special,
            segment=message.segment,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "id": self.id,
            "start": self.start,
            "end": self.end,
            "special": self.special,
            "segment": self.segment,
        }


@dataclass(frozen=True)
class Word:
    """A whitespace-delimited word: adjacent tokens of one segment merged (word pieces,
    contractions, attached punctuation). ``score`` is the sum of its tokens' scores, which keeps
    additive attributions additive; ``tokens`` are indexes into ``Explanation.tokens``."""

    text: str
    score: float
    start: int
    end: int
    segment: int
    tokens: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "score": self.score,
            "start": self.start,
            "end": self.end,
            "segment": self.segment,
            "tokens": list(self.tokens),
        }


@dataclass(frozen=True)
class Timings:
    """Server-side stage timings of one inline explanation, in seconds."""

    queue_seconds: float = 0.0
    tokenize_seconds: float = 0.0
    forward_seconds: float = 0.0
    attribute_seconds: float = 0.0
    total_seconds: float = 0.0
    batch_size: int = 0

    @classmethod
    def from_proto(cls, message: pb.Timings) -> Timings:
        return cls(
            queue_seconds=message.queue_seconds,
            tokenize_seconds=message.tokenize_seconds,
            forward_seconds=message.forward_seconds,
            attribute_seconds=message.attribute_seconds,
            total_seconds=message.total_seconds,
            batch_size=message.batch_size,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue_seconds": self.queue_seconds,
            "tokenize_seconds": self.tokenize_seconds,
            "forward_seconds": self.forward_seconds,
            "attribute_seconds": self.attribute_seconds,
            "total_seconds": self.total_seconds,
            "batch_size": self.batch_size,
        }


@dataclass(frozen=True)
class Explanation:
    """A prediction and its token attribution.

    ``scores`` has one value per token for ``target_label``; ``class_scores`` (when the request
    asked for all classes) has one row per token and one column per label; ``extra_scores``
    holds further named per-token arrays (e.g. SLALOM ``value`` and ``importance``).
    ``text`` / ``text_pair`` are the inputs when the client knows them (they are not echoed by
    the server), which lets the renderers draw over the original text.
    """

    label: str
    label_index: int
    labels: list[str]
    probabilities: dict[str, float]
    tokens: list[Token]
    scores: list[float]
    method: str
    target_label: str
    target_index: int
    class_scores: list[list[float]] | None = None
    extra_scores: dict[str, list[float]] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    model_name: str = ""
    model_version: str = ""
    truncated: bool = False
    timings: Timings = field(default_factory=Timings)
    request_id: str = ""
    text: str | None = None
    text_pair: str | None = None

    @classmethod
    def from_proto(
        cls,
        message: pb.ExplainResponse,
        *,
        text: str | None = None,
        text_pair: str | None = None,
    ) -> Explanation:
        """Convert an ``ExplainResponse`` (the inputs, when known, are attached)."""
        exp = message.explanation
        labels = list(message.labels)
        probs = [float(p) for p in message.probabilities]
        # Labels should always come with the probabilities; index names keep the dict usable.
        names = labels if len(labels) == len(probs) else [str(i) for i in range(len(probs))]
        class_scores = [list(row.scores) for row in exp.class_scores] or None
        return cls(
            label=message.label,
            label_index=message.label_index,
            labels=labels,
            probabilities=dict(zip(names, probs, strict=True)),
            tokens=[Token.from_proto(t) for t in exp.tokens],
            scores=[float(s) for s in exp.scores],
            class_scores=class_scores,
            extra_scores={k: [float(v) for v in arr.values] for k, arr in exp.extra_scores.items()},
            details=struct_to_dict(exp.details),
            method=exp.method,
            parameters=struct_to_dict(exp.parameters),
            target_label=exp.target_label,
            target_index=exp.target_index,
            model_name=message.model_name,
            model_version=message.model_version,
            truncated=message.truncated,
            timings=Timings.from_proto(message.timings),
            request_id=message.request_id,
            text=text,
            text_pair=text_pair,
        )

    def __repr__(self) -> str:
        # The default dataclass repr would print every token and score.
        p = self.probabilities.get(self.label)
        prob = f", p={p:.3f}" if p is not None else ""
        model = self.model_name + (f"@{self.model_version}" if self.model_version else "")
        return (
            f"Explanation(label={self.label!r}{prob}, target={self.target_label!r}, "
            f"method={self.method!r}, tokens={len(self.tokens)}, model={model!r})"
        )

    @property
    def score_names(self) -> list[str]:
        """Names accepted by :meth:`score_array`: ``"scores"``, extra arrays, class labels."""
        names = [TARGET_SCORES, *self.extra_scores]
        if self.class_scores is not None:
            names += [label for label in self.labels if label not in names]
        return names

    def score_array(self, name: str = TARGET_SCORES) -> list[float]:
        """One per-token score array by name.

        ``"scores"`` is the target-class attribution, any key of ``extra_scores`` its array,
        and a class label its column of ``class_scores`` (only when all classes were asked for).
        """
        if name == TARGET_SCORES:
            return list(self.scores)
        if name in self.extra_scores:
            return list(self.extra_scores[name])
        if self.class_scores is not None and name in self.labels:
            column = self.labels.index(name)
            return [row[column] for row in self.class_scores]
        raise KeyError(f"no score array {name!r}; available: {', '.join(self.score_names)}")

    def top(
        self, k: int = 5, absolute: bool = False, scores: str = TARGET_SCORES
    ) -> list[tuple[Token, float]]:
        """The ``k`` highest-scoring non-special tokens, best first.

        With ``absolute=True`` tokens are ranked by magnitude (strong negative evidence counts
        too); the returned scores keep their sign. Ties keep text order.
        """
        values = self.score_array(scores)
        pairs = [(tok, s) for tok, s in zip(self.tokens, values, strict=False) if not tok.special]

        def key(pair: tuple[Token, float]) -> tuple[bool, float]:
            s = pair[1]
            # NaN sorts last rather than scrambling the order.
            return (math.isnan(s), -abs(s) if absolute else -s)

        return sorted(pairs, key=key)[: max(k, 0)]

    def words(self, scores: str = TARGET_SCORES) -> list[Word]:
        """The non-special tokens merged into words, in text order, with summed scores.

        Tokens join when one starts where the previous ended (no whitespace between them in
        the text); without usable offsets, ``##``-continuation pieces join their word.
        """
        values = self.score_array(scores)
        have_offsets = any(t.end > t.start for t in self.tokens if not t.special)
        groups: list[list[int]] = []
        prev: Token | None = None
        for i, tok in enumerate(self.tokens):
            if tok.special or i >= len(values):
                prev = None
                continue
            joined = (
                prev is not None
                and prev.segment == tok.segment
                and (tok.start == prev.end if have_offsets else tok.text.startswith("##"))
            )
            if joined:
                groups[-1].append(i)
            else:
                groups.append([i])
            prev = tok
        out = []
        for group in groups:
            first, last = self.tokens[group[0]], self.tokens[group[-1]]
            source = self.text if first.segment == 0 else self.text_pair
            if source is not None and have_offsets and last.end <= len(source):
                text = source[first.start : last.end]
            else:
                text = "".join(strip_piece_marker(self.tokens[i].text) for i in group)
            out.append(
                Word(
                    text=text,
                    score=sum(values[i] for i in group),
                    start=first.start,
                    end=last.end,
                    segment=first.segment,
                    tokens=tuple(group),
                )
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return {
            "label": self.label,
            "label_index": self.label_index,
            "labels": list(self.labels),
            "probabilities": dict(self.probabilities),
            "tokens": [t.to_dict() for t in self.tokens],
            "scores": list(self.scores),
            "class_scores": (
                [list(r) for r in self.class_scores] if self.class_scores is not None else None
            ),
            "extra_scores": {k: list(v) for k, v in self.extra_scores.items()},
            "details": dict(self.details),
            "method": self.method,
            "parameters": dict(self.parameters),
            "target_label": self.target_label,
            "target_index": self.target_index,
            "model_name": self.model_name,
            "model_version": self.model_version,
            "truncated": self.truncated,
            "timings": self.timings.to_dict(),
            "request_id": self.request_id,
            "text": self.text,
            "text_pair": self.text_pair,
        }

    def to_html(
        self, path: str | Path | None = None, scores: str | Sequence[str] | None = None
    ) -> str:
        """A self-contained HTML page (inline CSS, no external assets); written to ``path``
        when given. ``scores`` names one or more arrays (see :meth:`score_array`) to show side
        by side, e.g. ``["value", "importance"]`` for SLALOM; default: the target scores."""
        from limelight_client import render

        page = render.to_html(self, scores=scores)
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page

    def to_terminal(self, scores: str = TARGET_SCORES, color: bool | None = None) -> str:
        """A heat-map of the text for a terminal (ANSI truecolor; plain text with bracketed
        scores when ``NO_COLOR`` is set or ``color=False``)."""
        from limelight_client import render

        return render.to_terminal(self, scores=scores, color=color)


@dataclass(frozen=True)
class MethodInfo:
    """An attribution method the server offers: ``cost`` is ``"inline"`` or ``"job"``."""

    name: str
    cost: str
    description: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    unavailable_reason: str = ""

    @property
    def available(self) -> bool:
        return not self.unavailable_reason

    @classmethod
    def from_proto(cls, message: pb.MethodInfo) -> MethodInfo:
        return cls(
            name=message.name,
            cost=message.cost,
            description=message.description,
            defaults=struct_to_dict(message.defaults),
            unavailable_reason=message.unavailable_reason,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cost": self.cost,
            "description": self.description,
            "defaults": dict(self.defaults),
            "unavailable_reason": self.unavailable_reason,
        }


@dataclass(frozen=True)
class ModelInfo:
    """The served model: labels, architecture, limits and the methods it supports."""

    name: str
    version: str
    architecture: str
    labels: list[str]
    num_layers: int = 0
    num_heads: int = 0
    hidden_size: int = 0
    methods: list[MethodInfo] = field(default_factory=list)
    default_method: str = ""
    max_tokens: int = 0
    max_text_chars: int = 0
    runtime: str = ""
    supports_text_pair: bool = False

    @classmethod
    def from_proto(cls, message: pb.ModelInfo) -> ModelInfo:
        return cls(
            name=message.name,
            version=message.version,
            architecture=message.architecture,
            labels=list(message.labels),
            num_layers=message.num_layers,
            num_heads=message.num_heads,
            hidden_size=message.hidden_size,
            methods=[MethodInfo.from_proto(m) for m in message.methods],
            default_method=message.default_method,
            max_tokens=message.max_tokens,
            max_text_chars=message.max_text_chars,
            runtime=message.runtime,
            supports_text_pair=message.supports_text_pair,
        )

    def method(self, name: str) -> MethodInfo:
        """The method called ``name`` (``KeyError`` when the server does not offer it)."""
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(
            f"unknown method {name!r}; offered: {', '.join(m.name for m in self.methods)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "architecture": self.architecture,
            "labels": list(self.labels),
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "hidden_size": self.hidden_size,
            "methods": [m.to_dict() for m in self.methods],
            "default_method": self.default_method,
            "max_tokens": self.max_tokens,
            "max_text_chars": self.max_text_chars,
            "runtime": self.runtime,
            "supports_text_pair": self.supports_text_pair,
        }


class JobState(enum.IntEnum):
    """Job lifecycle, mirroring ``limelight.v1.JobState`` value for value."""

    UNSPECIFIED = pb.JOB_STATE_UNSPECIFIED
    QUEUED = pb.JOB_STATE_QUEUED
    RUNNING = pb.JOB_STATE_RUNNING
    SUCCEEDED = pb.JOB_STATE_SUCCEEDED
    FAILED = pb.JOB_STATE_FAILED
    CANCELLED = pb.JOB_STATE_CANCELLED

    @property
    def terminal(self) -> bool:
        """True for SUCCEEDED, FAILED and CANCELLED: the state will not change again."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    @classmethod
    def parse(cls, value: JobState | str | int) -> JobState:
        """Accept a member, its name (``"queued"``, ``"JOB_STATE_QUEUED"``) or its number."""
        if isinstance(value, JobState):
            return value
        if isinstance(value, int):
            return cls(value)
        name = value.strip().upper().removeprefix("JOB_STATE_")
        try:
            return cls[name]
        except KeyError:
            raise ValueError(f"unknown job state {value!r}") from None


@dataclass(frozen=True)
class JobInfo:
    """A snapshot of a job; ``result`` is set once it SUCCEEDED, ``error`` when it did not."""

    id: str
    state: JobState
    method: str
    parameters: dict[str, Any] = field(default_factory=dict)
    progress: float = 0.0
    message: str = ""
    created_at: _dt.datetime | None = None
    started_at: _dt.datetime | None = None
    finished_at: _dt.datetime | None = None
    attempts: int = 0
    result: Explanation | None = None
    error: str = ""
    idempotency_key: str = ""

    @property
    def done(self) -> bool:
        return self.state.terminal

    @classmethod
    def from_proto(
        cls, message: pb.Job, *, text: str | None = None, text_pair: str | None = None
    ) -> JobInfo:
        result = (
            Explanation.from_proto(message.result, text=text, text_pair=text_pair)
            if message.HasField("result")
            else None
        )
        try:
            state = JobState(message.state)
        except ValueError:  # a state added by a newer server
            state = JobState.UNSPECIFIED
        return cls(
            id=message.id,
            state=state,
            method=message.method,
            parameters=struct_to_dict(message.parameters),
            progress=message.progress,
            message=message.message,
            created_at=_timestamp(message, "created_at"),
            started_at=_timestamp(message, "started_at"),
            finished_at=_timestamp(message, "finished_at"),
            attempts=message.attempts,
            result=result,
            error=message.error,
            idempotency_key=message.idempotency_key,
        )

    def to_dict(self) -> dict[str, Any]:
        def iso(t: _dt.datetime | None) -> str | None:
            return t.isoformat() if t is not None else None

        return {
            "id": self.id,
            "state": self.state.name,
            "method": self.method,
            "parameters": dict(self.parameters),
            "progress": self.progress,
            "message": self.message,
            "created_at": iso(self.created_at),
            "started_at": iso(self.started_at),
            "finished_at": iso(self.finished_at),
            "attempts": self.attempts,
            "result": self.result.to_dict() if self.result is not None else None,
            "error": self.error,
            "idempotency_key": self.idempotency_key,
        }


@dataclass(frozen=True)
class TokenShift:
    """A token's share of the positive attribution mass, reference vs current window."""

    token: str
    reference_share: float
    current_share: float

    @property
    def change(self) -> float:
        return self.current_share - self.reference_share

    @classmethod
    def from_proto(cls, message: pb.TokenShift) -> TokenShift:
        return cls(message.token, message.reference_share, message.current_share)

    def to_dict(self) -> dict[str, Any]:
        return {
            "token": self.token,
            "reference_share": self.reference_share,
            "current_share": self.current_share,
        }


@dataclass(frozen=True)
class LabelDrift:
    """Attribution drift of one predicted label (Jensen–Shannon divergence, base 2)."""

    label: str
    divergence: float
    alert: bool
    window_count: int
    risers: list[TokenShift] = field(default_factory=list)
    fallers: list[TokenShift] = field(default_factory=list)

    @classmethod
    def from_proto(cls, message: pb.LabelDrift) -> LabelDrift:
        return cls(
            label=message.label,
            divergence=message.divergence,
            alert=message.alert,
            window_count=message.window_count,
            risers=[TokenShift.from_proto(s) for s in message.risers],
            fallers=[TokenShift.from_proto(s) for s in message.fallers],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "divergence": self.divergence,
            "alert": self.alert,
            "window_count": self.window_count,
            "risers": [s.to_dict() for s in self.risers],
            "fallers": [s.to_dict() for s in self.fallers],
        }


@dataclass(frozen=True)
class DriftReport:
    """Attribution drift per label plus label-mix and concentration drift."""

    reference_state: str
    reference_count: int
    window_count: int
    alert_threshold: float
    labels: list[LabelDrift] = field(default_factory=list)
    label_mix_divergence: float = 0.0
    reference_entropy: float = 0.0
    current_entropy: float = 0.0
    generated_at: _dt.datetime | None = None

    @property
    def alerts(self) -> list[LabelDrift]:
        """The labels whose divergence crossed the alert threshold."""
        return [d for d in self.labels if d.alert]

    def label(self, name: str) -> LabelDrift:
        for d in self.labels:
            if d.label == name:
                return d
        raise KeyError(f"no drift entry for label {name!r}")

    @classmethod
    def from_proto(cls, message: pb.DriftReport) -> DriftReport:
        return cls(
            reference_state=message.reference_state,
            reference_count=message.reference_count,
            window_count=message.window_count,
            alert_threshold=message.alert_threshold,
            labels=[LabelDrift.from_proto(d) for d in message.labels],
            label_mix_divergence=message.label_mix_divergence,
            reference_entropy=message.reference_entropy,
            current_entropy=message.current_entropy,
            generated_at=_timestamp(message, "generated_at"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference_state": self.reference_state,
            "reference_count": self.reference_count,
            "window_count": self.window_count,
            "alert_threshold": self.alert_threshold,
            "labels": [d.to_dict() for d in self.labels],
            "label_mix_divergence": self.label_mix_divergence,
            "reference_entropy": self.reference_entropy,
            "current_entropy": self.current_entropy,
            "generated_at": self.generated_at.isoformat() if self.generated_at else None,
        }
