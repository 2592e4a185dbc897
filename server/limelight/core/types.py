"""Domain types shared by the core, the methods, the runtimes and the API layer."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class TargetSpec:
    """Which class to explain: by label name or index; both unset means the predicted class."""

    label: str | None = None
    index: int | None = None


@dataclass(frozen=True)
class ExplainInput:
    text: str
    text_pair: str | None = None
    target: TargetSpec | None = None
    all_classes: bool = False
    method: str = ""
    request_id: str = ""
    deadline: float | None = None
    """Absolute ``time.monotonic()`` deadline; expired work is skipped, not computed."""
    continue_on_error: bool = False
    """In a stream or a batch (``explain_many``, ``explain_each``): when this input fails, it
    is answered in its place by a ``Failed`` and the others go on; otherwise its error ends the
    stream or fails the whole batch."""
    trace_context: Mapping[str, str] = field(default_factory=dict)
    """The caller's W3C trace context (``traceparent``), for an input of a stream or batch whose
    call carries other callers' inputs too: it is traced as a span of its own in that trace."""

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


@dataclass(frozen=True)
class Failed:
    """The answer in its place to an input of a stream or batch that failed and asked for
    ``continue_on_error``: ``error`` is what a call of its own would have raised."""

    error: Exception
    request_id: str = ""


@dataclass(frozen=True)
class TokenInfo:
    text: str
    id: int
    start: int
    end: int
    special: bool
    segment: int = 0


class TokenColumns(Sequence[TokenInfo]):
    """An input's tokens as the fast tokenizer hands them over: one list per field. The request
    path (tokenising, drift, the answer's protobuf) reads the columns and never builds an
    object per token, which for a long text cost as much as tokenising it. Still a
    ``Sequence[TokenInfo]`` for everything else: indexing or iterating builds each
    ``TokenInfo`` on demand. Treated as immutable: the lists are shared, never changed."""

    __slots__ = ("ids", "offsets", "segments", "special", "texts")

    def __init__(
        self,
        texts: list[str],
        ids: list[int],
        offsets: list[tuple[int, int]],
        special: list[int],
        segments: list[int],
    ) -> None:
        self.texts = texts
        self.ids = ids
        #: ``(start, end)`` character offsets into the token's segment.
        self.offsets = offsets
        #: 1 for a token the tokenizer added (``[CLS]``, ``<s>``, ...), else 0.
        self.special = special
        #: 0: ``text``, 1: ``text_pair``.
        self.segments = segments

    @classmethod
    def of(cls, tokens: Sequence[TokenInfo]) -> TokenColumns:
        """``tokens`` in columns (themselves when they already are)."""
        if isinstance(tokens, TokenColumns):
            return tokens
        return cls(
            [t.text for t in tokens],
            [t.id for t in tokens],
            [(t.start, t.end) for t in tokens],
            [int(t.special) for t in tokens],
            [t.segment for t in tokens],
        )

    def __len__(self) -> int:
        return len(self.ids)

    def _row(self, i: int) -> TokenInfo:
        start, end = self.offsets[i]
        return TokenInfo(
            self.texts[i], self.ids[i], start, end, bool(self.special[i]), self.segments[i]
        )

    @overload
    def __getitem__(self, index: int) -> TokenInfo: ...

    @overload
    def __getitem__(self, index: slice) -> list[TokenInfo]: ...

    def __getitem__(self, index: int | slice) -> TokenInfo | list[TokenInfo]:
        if isinstance(index, slice):
            return [self._row(i) for i in range(*index.indices(len(self)))]
        return self._row(range(len(self))[index])  # negative indexes, IndexError

    def __iter__(self) -> Iterator[TokenInfo]:
        for text, tid, (start, end), special, segment in zip(
            self.texts, self.ids, self.offsets, self.special, self.segments, strict=True
        ):
            yield TokenInfo(text, tid, start, end, bool(special), segment)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable lists inside, like a list

    def __repr__(self) -> str:
        return f"TokenColumns({self.texts!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenColumns, (self.texts, self.ids, self.offsets, self.special, self.segments))


def scored_tokens(
    tokens: Sequence[TokenInfo], scores: Iterable[float | None]
) -> list[dict[str, Any]]:
    """Each token as JSON with its score: the HTTP APIs' and the viewer's token shape (a score
    of None where the viewer has no finite one). Read from the columns: no object per token."""
    columns = TokenColumns.of(tokens)
    return [
        {
            "text": text,
            "start": start,
            "end": end,
            "special": bool(special),
            "segment": segment,
            "score": None if score is None else float(score),
        }
        for text, (start, end), special, segment, score in zip(
            columns.texts, columns.offsets, columns.special, columns.segments, scores, strict=True
        )
    ]


@dataclass(frozen=True)
class Encoded:
    """One tokenised input, unpadded."""

    input_ids: list[int]
    token_type_ids: list[int] | None
    tokens: Sequence[TokenInfo]
    """``TokenColumns`` from the tokenizer (windows and stitched documents too); a plain list
    where tokens were put together otherwise (jobs read back)."""
    truncated: bool

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def special_mask(self) -> npt.NDArray[np.bool_]:
        return np.array(TokenColumns.of(self.tokens).special, dtype=bool)


@dataclass
class Timings:
    queue_seconds: float = 0.0
    tokenize_seconds: float = 0.0
    forward_seconds: float = 0.0
    attribute_seconds: float = 0.0
    total_seconds: float = 0.0
    batch_size: int = 1


@dataclass
class Attribution:
    """What a method says about one input and one target class."""

    method: str
    parameters: dict[str, Any]
    target_index: int
    target_label: str
    scores: FloatArray
    """One score per token (special tokens included) for the target class."""
    class_scores: FloatArray | None = None
    """Token x class matrix, when asked for and available."""
    extra_scores: dict[str, FloatArray] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Explanation:
    request_id: str
    label_index: int
    label: str
    probabilities: list[float]
    labels: list[str]
    tokens: Sequence[TokenInfo]
    attribution: Attribution
    model_name: str
    model_version: str
    truncated: bool
    timings: Timings
    predicted_labels: list[str] = field(default_factory=list)
    """The predicted labels: multi-label, every label over its threshold (most probable first,
    possibly none); otherwise the one predicted label (empty for regression)."""
    multi_label: bool = False
    """Sigmoid probabilities per label (``probabilities`` need not sum to 1)."""
    thresholds: list[float] = field(default_factory=list)
    """Multi-label: the threshold of each label, in ``labels`` order."""
    label_attributions: list[Attribution] = field(default_factory=list)
    """Multi-label: the attributions of the further explained labels (every predicted label
    after the one ``attribution`` explains), same tokens."""
    windows: int = 0
    """``truncation=window``: how many windows the text was explained in (0: one pass)."""

    @property
    def attributions(self) -> list[Attribution]:
        """Every explained label's attribution, ``attribution`` first."""
        return [self.attribution, *self.label_attributions]


class Cost(enum.Enum):
    """How expensive a method is, which decides where it runs."""

    INLINE = "inline"  # rides along the serving forward pass
    JOB = "job"  # queued and run by a worker


@dataclass(frozen=True)
class MethodInfo:
    name: str
    cost: Cost
    description: str
    defaults: dict[str, Any]
    unavailable_reason: str = ""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    version: str
    architecture: str
    labels: list[str]
    num_layers: int
    num_heads: int
    hidden_size: int
    methods: list[MethodInfo]
    default_method: str
    max_tokens: int
    max_text_chars: int
    runtime: str
    supports_text_pair: bool
    problem_type: str = "single_label_classification"
    thresholds: list[float] = field(default_factory=list)
    """Multi-label: the threshold of each label."""
