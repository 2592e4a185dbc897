"""Typed, frozen result objects converted from the protobuf messages of ``limelight.v1``.

The objects are frozen dataclasses: attributes cannot be rebound. They hold plain Python values
(lists, dicts, floats) so that they need nothing beyond the standard library to use (those that
hold lists or dicts, ``Explanation`` among them, are therefore not hashable) and
``to_dict()`` is JSON-serialisable as is, strict JSON included (``json.dumps(...,
allow_nan=False)``): a float that is not finite — the ``divergence`` of a drift label not
compared yet, a score a method could not compute — is ``None`` there.

Field names follow the protobuf messages (and the server's own types) name for name;
``to_dict()`` is derived from the dataclass fields (plus each type's derived properties, such as
``TokenShift.delta``), never written by hand, and a test checks every type against its message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import enum
import math
import struct
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from google.protobuf import json_format, struct_pb2, timestamp_pb2

from limelight_client import render
from limelight_client._text import TARGET_SCORES, splits_at, strip_piece_marker, word_boundary
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


def _as_float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def float32_value(value: float) -> float:
    """A ``float`` field of a message (32 bits on the wire) as the shortest decimal that reads
    back as the same float32: a threshold set to 0.3 comes back 0.3, not 0.30000001192092896
    (the float32 nearest 0.3, read as a double). For values that were set, such as thresholds,
    not for scores."""
    if not math.isfinite(value):
        return value
    for digits in range(1, 10):  # 9 significant digits tell every float32 apart
        short = float(f"{value:.{digits}g}")
        with contextlib.suppress(OverflowError):  # rounded up past the largest float32
            if _as_float32(short) == value:
                return short
    return value


def struct_to_dict(message: struct_pb2.Struct) -> dict[str, Any]:
    """A ``google.protobuf.Struct`` as a plain dict; integral numbers come back as ints."""
    if not message.fields:  # most answers' parameters and details: skip the JSON round trip
        return {}
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
    return ts.ToDatetime(tzinfo=_dt.timezone.utc)  # datetime.UTC is 3.11+


def _jsonable(value: Any) -> Any:
    """A field value as JSON types: nested shapes as dicts, enums by name, times in ISO 8601,
    NaN and infinities as ``None`` (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, _Shape):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, _dt.datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class _Shape:
    """Base of the result dataclasses: ``to_dict`` from the fields, never by hand."""

    #: Read-only properties that ``to_dict`` includes after the fields.
    _derived: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field (and derived property); a float that is not
        finite is ``None`` (strict JSON has no NaN)."""
        assert dataclasses.is_dataclass(self)
        out = {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        for name in self._derived:
            out[name] = _jsonable(getattr(self, name))
        return out


@dataclass(frozen=True)
class Token(_Shape):
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

    @classmethod
    def all_from_proto(cls, explanation: pb.Explanation) -> list[Token]:
        """An explanation's tokens, in whichever layout the server sent them."""
        columns = explanation.token_columns
        if not columns.text:
            return [cls.from_proto(t) for t in explanation.tokens]
        # A frozen dataclass's __init__ sets each field through object.__setattr__; filling
        # the instance's __dict__ directly makes the same Token three times faster, which
        # counts for the hundreds of tokens of a long answer.
        new = object.__new__
        tokens = []
        for row in zip(
            columns.text,
            columns.id,
            columns.start,
            columns.end,
            columns.special,
            columns.segment,
            strict=True,
        ):
            token = new(cls)
            fields = token.__dict__
            (
                fields["text"],
                fields["id"],
                fields["start"],
                fields["end"],
                fields["special"],
                fields["segment"],
            ) = row
            tokens.append(token)
        return tokens


@dataclass(frozen=True)
class Word(_Shape):
    """A whitespace-delimited word: adjacent tokens of one segment merged (word pieces,
    contractions, attached punctuation). ``score`` is the sum of its tokens' scores, which keeps
    additive attributions additive; ``tokens`` are indexes into ``Explanation.tokens``."""

    text: str
    score: float
    start: int
    end: int
    segment: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Timings(_Shape):
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


@dataclass(frozen=True)
class Explanation(_Shape):
    """A prediction and its token attribution.

    ``scores`` has one value per token for ``target_label``; ``class_scores`` (when the request
    asked for all classes) has one row per token and one column per label; ``extra_scores``
    holds further named per-token arrays (e.g. SLALOM ``value`` and ``importance``).
    ``text`` / ``text_pair`` are the inputs when the client knows them (they are not echoed by
    the server), which lets the renderers draw over the original text.

    Multi-label models (``multi_label``): ``probabilities`` are independent sigmoids,
    ``predicted_labels`` the labels at or over their ``thresholds`` (most probable first,
    possibly none), ``label`` the most probable label; this object explains the first
    predicted label (or the requested target) and ``label_explanations`` the other predicted
    labels, one :class:`Explanation` each (same tokens). :meth:`explained` lists them all.
    """

    #: Not hashable (``hash()`` raises ``TypeError``, as for a list): it holds lists and
    #: dicts. Key explanations by what identifies them for you, such as ``(text, method,
    #: target_label)``; ``==`` compares every field.
    __hash__ = None  # type: ignore[assignment]

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
    predicted_labels: list[str] = field(default_factory=list)
    multi_label: bool = False
    thresholds: dict[str, float] = field(default_factory=dict)
    label_explanations: list[Explanation] = field(default_factory=list)
    windows: int = 0
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
        first = cls._from_parts(message, exp, names, probs, text, text_pair, None, [])
        if not message.label_explanations:
            return first
        others = [
            cls._from_parts(message, other, names, probs, text, text_pair, first.tokens, [])
            for other in message.label_explanations
        ]
        return dataclasses.replace(first, label_explanations=others)

    @classmethod
    def _from_parts(
        cls,
        message: pb.ExplainResponse,
        exp: pb.Explanation,
        names: list[str],
        probs: list[float],
        text: str | None,
        text_pair: str | None,
        tokens: list[Token] | None,
        others: list[Explanation],
    ) -> Explanation:
        labels = list(message.labels)
        class_scores = [list(row.scores) for row in exp.class_scores] or None
        thresholds = [float32_value(t) for t in message.thresholds]
        return cls(
            label=message.label,
            label_index=message.label_index,
            labels=labels,
            probabilities=dict(zip(names, probs, strict=True)),
            tokens=tokens if tokens is not None else Token.all_from_proto(exp),
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
            predicted_labels=list(message.predicted_labels),
            multi_label=message.multi_label,
            thresholds=dict(zip(labels, thresholds, strict=False)),
            label_explanations=others,
            windows=message.windows,
            text=text,
            text_pair=text_pair,
        )

    def explained(self) -> list[Explanation]:
        """Every explained label's explanation: this one first, then ``label_explanations``
        (multi-label); a one-element list otherwise."""
        return [self, *self.label_explanations]

    def explanation_for(self, label: str) -> Explanation:
        """The explanation of ``label`` among :meth:`explained` (``KeyError`` if not there)."""
        for exp in self.explained():
            if exp.target_label == label:
                return exp
        names = ", ".join(e.target_label for e in self.explained())
        raise KeyError(f"label {label!r} was not explained; explained: {names}")

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

    def words(self, scores: str = TARGET_SCORES, *, punctuation_apart: bool = False) -> list[Word]:
        """The non-special tokens merged into words, in text order, with summed scores.

        Words are those of BERT's basic pre-tokenizer, as far as the tokens' offsets allow
        (a piece is never cut): a piece joins the one before it when it starts where that one
        ended and neither character at the join is whitespace or stands apart — each CJK
        ideograph is a word of its own ("这部电影" is four words), and with
        ``punctuation_apart`` each punctuation character too ("gorgeous" and "," rather than
        "gorgeous,"; "good", ",", "but"; an apostrophe between letters stays: "don't"), as
        :meth:`by_words`, ``--words`` and the web viewer show words. Pieces that share one
        character's span (an uncased BERT's Hangul letters, an emoji's bytes) always join.
        Without usable offsets,
        ``##``-continuation pieces join their word, by the same rule on the pieces' text.
        """
        return self._words(self.score_array(scores), punctuation_apart)

    def _joins(self, prev: Token, tok: Token, have_offsets: bool, punctuation: bool) -> bool:
        """Whether ``tok`` belongs to the word of ``prev``, the piece before it (``words``)."""
        if prev.segment != tok.segment:
            return False
        piece = strip_piece_marker(tok.text)
        if not have_offsets:
            return tok.text.startswith("##") and not word_boundary(
                strip_piece_marker(prev.text)[-1:], piece[:1], punctuation
            )
        if prev.start <= tok.start < prev.end:
            return True  # pieces of one character share its span
        if tok.start != prev.end:
            return False  # whitespace (or something the tokenizer dropped) between them
        source = self.text if tok.segment == 0 else self.text_pair
        if source is not None and 0 < tok.start < len(source):
            return not splits_at(source, tok.start, punctuation)
        # no text to look at: the pieces' own
        return not word_boundary(strip_piece_marker(prev.text)[-1:], piece[:1], punctuation)

    def _words(self, values: Sequence[float], punctuation_apart: bool) -> list[Word]:
        have_offsets = any(t.end > t.start for t in self.tokens if not t.special)
        groups: list[list[int]] = []
        prev: Token | None = None
        for i, tok in enumerate(self.tokens):
            if tok.special or i >= len(values):
                prev = None
                continue
            if prev is not None and self._joins(prev, tok, have_offsets, punctuation_apart):
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

    def by_words(self) -> Explanation:
        """This explanation with the pieces of each word merged into one token, for display:
        every per-token array (``scores``, ``extra_scores``, ``class_scores``, and those of
        ``label_explanations``) summed over the word's pieces, as :meth:`words` sums them.
        A merged token's ``text`` is the word as the input spells it, its span the word's and
        its ``id`` -1 (a word of one piece keeps the piece's id); special tokens stay as they
        are. Rankings of words are legible ("unwatchable" rather than "##watch") but are not
        what the faithfulness metrics score, which count the model's tokens. The words
        are those of :meth:`words` with ``punctuation_apart``: BERT's basic pre-tokenizer's,
        each punctuation character and CJK ideograph apart ("unwatchable" and "," rather than
        "unwatchable,")."""
        words = self._words(self.scores, punctuation_apart=True)
        return self._merged([(w.tokens, w.text) for w in words])

    def by_characters(self) -> Explanation:
        """This explanation with the pieces that share one span of the input merged into one
        token (their scores summed, as :meth:`by_words` sums them): a tokenizer may cut one
        character into several pieces (an uncased BERT splits each Hangul syllable into its
        letters, a byte-level BPE an emoji into bytes), which a heat-map of the input cannot
        show apart. Every other token stays as it is; an explanation without such pieces is
        returned unchanged. The renderers show word pieces this way."""
        runs: list[list[int]] = []
        prev: Token | None = None
        for i, tok in enumerate(self.tokens):
            if tok.special or tok.end <= tok.start:
                prev = None
                continue
            shared = prev is not None and prev.segment == tok.segment and tok.start < prev.end
            if shared:
                runs[-1].append(i)
            else:
                runs.append([i])
            prev = tok
        runs = [run for run in runs if len(run) > 1]
        if not runs:
            return self
        merged = []
        for run in runs:
            first = self.tokens[run[0]]
            end = max(self.tokens[i].end for i in run)
            source = self.text if first.segment == 0 else self.text_pair
            text = source[first.start : end] if source is not None and end <= len(source) else ""
            merged.append((tuple(run), text or "".join(self.tokens[i].text for i in run)))
        return self._merged(merged)

    def _merged(self, runs: Sequence[tuple[tuple[int, ...], str]]) -> Explanation:
        """This explanation with each run of token indexes (in text order, with the text it
        covers) merged into one token, every per-token array summed over the run."""
        first = {run[0]: (run, text) for run, text in runs}
        inside = {i for run, _ in runs for i in run[1:]}
        groups: list[tuple[int, ...]] = []
        tokens: list[Token] = []
        for i, tok in enumerate(self.tokens):
            if i in first:
                run, text = first[i]
                tokens.append(
                    Token(
                        text=text,
                        id=-1 if len(run) > 1 else tok.id,
                        start=tok.start,
                        end=max(self.tokens[j].end for j in run),
                        segment=tok.segment,
                    )
                )
                groups.append(run)
            elif i not in inside:
                tokens.append(tok)
                groups.append((i,))

        def merge(values: Sequence[float]) -> list[float]:
            return [math.fsum(values[i] for i in group if i < len(values)) for group in groups]

        def by_class(rows: list[list[float]]) -> list[list[float]]:
            columns = [merge(column) for column in zip(*rows, strict=True)]
            return [list(row) for row in zip(*columns, strict=True)]

        def merged(exp: Explanation) -> Explanation:
            rows = exp.class_scores
            return dataclasses.replace(
                exp,
                tokens=tokens,
                scores=merge(exp.scores),
                extra_scores={name: merge(arr) for name, arr in exp.extra_scores.items()},
                class_scores=None if rows is None else by_class(rows),
                label_explanations=[merged(other) for other in exp.label_explanations],
            )

        return merged(self)

    def to_html(
        self,
        path: str | Path | None = None,
        scores: str | Sequence[str] | None = None,
        fragment: bool = False,
    ) -> str:
        """A self-contained HTML page (inline CSS, no external assets); written to ``path``
        when given. ``scores`` names one or more arrays (see :meth:`score_array`) to show side
        by side, e.g. ``["value", "importance"]`` for SLALOM; default: the target scores.
        ``fragment``: one ``<div>`` with its style scoped to it, to embed in another page."""
        page = render.to_html(self, scores=scores, fragment=fragment)
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page

    def _repr_html_(self) -> str:
        # Jupyter and other notebooks show the heat-map rather than the repr.
        return self.to_html(fragment=True)

    def to_terminal(
        self, scores: str | Sequence[str] = TARGET_SCORES, color: bool | None = None
    ) -> str:
        """A heat-map of the text for a terminal (ANSI truecolor; plain text with bracketed
        scores when ``NO_COLOR`` is set and ``FORCE_COLOR`` is not, or ``color=False``);
        several named score arrays give one map each under one header, e.g. ``["scores",
        "importance"]`` for SLALOM."""
        return render.to_terminal(self, scores=scores, color=color)


@dataclass(frozen=True)
class MethodInfo(_Shape):
    """An attribution method the server offers: ``cost`` is ``"inline"`` or ``"job"``."""

    #: Not hashable: it holds lists and dicts (equal objects compare equal with ``==``).
    __hash__ = None  # type: ignore[assignment]

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


@dataclass(frozen=True)
class ModelInfo(_Shape):
    """The served model: labels, architecture, limits and the methods it supports."""

    #: Not hashable: it holds lists and dicts (equal objects compare equal with ``==``).
    __hash__ = None  # type: ignore[assignment]

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
    problem_type: str = ""
    """``single_label_classification``, ``multi_label_classification`` or ``regression``."""
    thresholds: dict[str, float] = field(default_factory=dict)
    """Multi-label: each label's threshold."""
    instance: str = ""
    """An opaque id of the server process that answered (each ``--workers`` process has its
    own; new at every start)."""
    workers: int = 1
    """How many server processes share the sidecar's port."""

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
            problem_type=message.problem_type,
            thresholds=dict(
                zip(message.labels, map(float32_value, message.thresholds), strict=False)
            ),
            instance=message.instance,
            workers=message.workers or 1,
        )

    def method(self, name: str) -> MethodInfo:
        """The method called ``name`` (``KeyError`` when the server does not offer it)."""
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(
            f"unknown method {name!r}; offered: {', '.join(m.name for m in self.methods)}"
        )


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
class JobInfo(_Shape):
    """A snapshot of a job; ``result`` is set once it SUCCEEDED, ``error`` when it did not."""

    #: Not hashable: it holds lists and dicts (equal objects compare equal with ``==``).
    __hash__ = None  # type: ignore[assignment]

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
    #: The model the job was submitted to (name and content hash); empty from older servers.
    model_name: str = ""
    model_version: str = ""
    #: QUEUED on a queue that no live ``limelight worker`` consumes: it waits until one starts
    #: (RUNNING then: its worker died with it; it runs again once a worker starts).
    no_worker: bool = False

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
            model_name=message.model_name,
            model_version=message.model_version,
            no_worker=message.no_worker,
        )


@dataclass(frozen=True)
class TokenShift(_Shape):
    """A token's share of the positive attribution mass, reference vs current window."""

    token: str
    reference_share: float
    current_share: float

    _derived: ClassVar[tuple[str, ...]] = ("delta",)

    @property
    def delta(self) -> float:
        """current_share − reference_share (the server's name for it)."""
        return self.current_share - self.reference_share

    @property
    def change(self) -> float:
        """Deprecated alias of :attr:`delta`."""
        warnings.warn(
            "TokenShift.change is deprecated; use TokenShift.delta",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.delta

    @classmethod
    def from_proto(cls, message: pb.TokenShift) -> TokenShift:
        return cls(message.token, message.reference_share, message.current_share)


@dataclass(frozen=True)
class LabelDrift(_Shape):
    """Attribution drift of one predicted label (Jensen–Shannon divergence, base 2).

    ``divergence`` is NaN while the label is not compared (:attr:`compared`); ``to_dict()``
    gives ``None`` for it then."""

    #: Not hashable: it holds lists and dicts (equal objects compare equal with ``==``).
    __hash__ = None  # type: ignore[assignment]

    label: str
    divergence: float
    alert: bool
    window_count: int
    risers: list[TokenShift] = field(default_factory=list)
    fallers: list[TokenShift] = field(default_factory=list)
    reference_count: int = 0
    """Explanations predicted as this label in the reference (0 from an older sidecar)."""

    @property
    def compared(self) -> bool:
        """Whether the divergence was measured (enough explanations of the label on both
        sides; see :attr:`DriftReport.min_count`)."""
        return self.window_count > 0 and math.isfinite(self.divergence)

    @classmethod
    def from_proto(cls, message: pb.LabelDrift) -> LabelDrift:
        return cls(
            label=message.label,
            divergence=message.divergence,
            alert=message.alert,
            window_count=message.window_count,
            risers=[TokenShift.from_proto(s) for s in message.risers],
            fallers=[TokenShift.from_proto(s) for s in message.fallers],
            reference_count=message.reference_count,
        )


@dataclass(frozen=True)
class DriftReport(_Shape):
    """Attribution drift per label plus label-mix and concentration drift."""

    #: Not hashable: it holds lists and dicts (equal objects compare equal with ``==``).
    __hash__ = None  # type: ignore[assignment]

    reference_state: str
    reference_count: int
    window_count: int
    alert_threshold: float
    labels: list[LabelDrift] = field(default_factory=list)
    label_mix_divergence: float = 0.0
    reference_entropy: float = 0.0
    current_entropy: float = 0.0
    generated_at: _dt.datetime | None = None
    sample_rate: float = 1.0
    """Share of inline explanations the monitor observes: the counts are about this share of
    the requests."""
    reference_target: int = 0
    """While the reference builds: how many explanations it is built from (the sidecar's
    ``LIMELIGHT_DRIFT_BOOTSTRAP_N``); 0 once it is ready or when the sidecar does not say."""
    min_count: int = 0
    """A label is compared once the window and the reference each hold this many explanations
    of it (the sidecar's ``LIMELIGHT_DRIFT_MIN_COUNT``; 0 when the sidecar does not say)."""

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
            # 0: a sidecar older than the field, which observed every explanation.
            sample_rate=message.sample_rate or 1.0,
            reference_target=message.reference_target,
            min_count=message.min_count,
        )
