"""Long documents: the ``window`` truncation policy.

A text longer than the token limit is cut into overlapping windows of at most ``max_tokens``
tokens each (special tokens included), consecutive windows sharing ``window_stride`` tokens
(the tokenizers' own ``stride``). Every window is classified and explained on its own, in the
same micro-batches as other requests (the batcher counts windows, and the token budget their
tokens). Then:

* **prediction**: the windows' logits are aggregated, ``mean`` (default: the document is what
  it says on average) or ``max`` per class (a label is as strong as its strongest window: for
  multi-label moderation, one threatening paragraph makes the document threatening), and the
  usual softmax / sigmoid is applied to the aggregate;
* **attributions**: each window's token scores are stitched back onto the document by
  character offsets: a token seen by one window keeps that window's score, a token in the
  overlap of two windows gets the mean of its two scores; the leading special tokens come from
  the first window and the trailing ones from the last. Every token of the text is explained.

Jobs follow the same policy (``limelight.jobs.runner``): the method runs on each window in
turn and its arrays are stitched the same way. Text pairs are not windowed: a pair is truncated
as with ``truncate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from limelight.core.types import Encoded, FloatArray, TokenColumns
from limelight.errors import InvalidArgument
from limelight.models.tokenize import backend, to_encoded

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel

Aggregation = Literal["mean", "max"]


def check_stride(stride: int, limit: int, special: int = 0) -> None:
    """The overlap must leave every window at least half new tokens. ``special``: the special
    tokens each window carries besides the text's (the tokenizer panics, rather than raise,
    when the overlap is not below the text tokens a window holds)."""
    room = limit - special
    if not 0 <= stride <= room // 2:
        raise InvalidArgument(
            f"window_stride {stride} must be between 0 and half the text tokens a window "
            f"holds ({room // 2}: the token limit {limit} less the model's {special} special "
            "tokens, halved)"
        )


def check_token_limit(limit: int, single: int, pair: int) -> None:
    """A token limit must leave room for text besides the special tokens the model adds
    (``single`` around one text, ``pair`` around a text pair): below that the tokenizer ignores
    the limit or every text comes out empty."""
    if limit < pair + 2:
        raise InvalidArgument(
            f"max_tokens {limit} leaves no room for text: the model adds {single} special "
            f"tokens to a text and {pair} to a text pair; set it to at least {pair + 2}"
        )


def encode_windows(model: LoadedModel, text: str, limit: int, stride: int) -> list[Encoded]:
    """``text`` as overlapping windows of at most ``limit`` tokens; one window when it fits.

    What ``tokenizer(text, truncation=True, max_length=limit, stride=stride,
    return_overflowing_tokens=True)`` gives, through a private backend: safe from any thread
    (``limelight.models.tokenize``)."""
    first = backend(model.tokenizer, limit, stride).encode(text, add_special_tokens=True)
    with_types = model.adapter.uses_token_type_ids
    return [to_encoded(w, False, with_types, False) for w in [first, *first.overflowing]]


@dataclass
class WindowLayout:
    """Where each token of the stitched document comes from.

    The windows' rows laid end to end (window 0's, then window 1's, ...) are "flat rows". The
    document is the first window's leading special tokens, then every distinct token of the
    text in text order (a span, and among pieces sharing one span their ids), then the last
    window's trailing special tokens. A token seen by several windows (their overlap) gets the
    mean of their rows. Index arrays, so stitching a long document
    is a few numpy calls rather than a Python step per token (it runs on the event loop)."""

    tokens: TokenColumns
    #: Flat rows of the leading special tokens, of the one row per span that names its token
    #: (the first window that saw it), and of the trailing special tokens.
    lead_rows: npt.NDArray[np.intp]
    body_rows: npt.NDArray[np.intp]
    tail_rows: npt.NDArray[np.intp]
    #: Every flat row of a span, grouped by span in document order; ``group_starts[i]`` is
    #: where span i's rows begin in ``span_rows``, ``group_sizes[i]`` how many there are.
    span_rows: npt.NDArray[np.intp]
    group_starts: npt.NDArray[np.intp]
    group_sizes: npt.NDArray[np.intp]

    @classmethod
    def of(cls, windows: Sequence[Encoded]) -> WindowLayout:
        columns = [TokenColumns.of(w.tokens) for w in windows]
        sizes = [len(c) for c in columns]
        first_row = np.concatenate(([0], np.cumsum(sizes)))
        special = np.concatenate([np.asarray(c.special, dtype=bool) for c in columns])
        flat_offsets = chain.from_iterable(chain.from_iterable(c.offsets for c in columns))
        offsets = np.fromiter(flat_offsets, dtype=np.int64, count=2 * int(first_row[-1]))
        offsets = offsets.reshape(-1, 2)
        first, last = columns[0], columns[-1]
        lead = 0
        while lead < len(first) and first.special[lead]:
            lead += 1
        tail = len(last)
        while tail > 0 and last.special[tail - 1]:
            tail -= 1
        text_rows = np.flatnonzero(~special)
        # One key per token of the text: its span, its id, and which of the window's tokens
        # with that span and id it is. A span is not enough: a tokenizer can cut one character
        # into several pieces with the same offsets (a Hangul syllable into its jamo), and a
        # window may begin inside such a run; the id tells the pieces apart there.
        ids = np.fromiter(
            chain.from_iterable(c.ids for c in columns), dtype=np.int64, count=int(first_row[-1])
        )
        window = np.repeat(np.arange(len(columns)), sizes)
        token = np.stack(
            (window[text_rows], offsets[text_rows, 0], offsets[text_rows, 1], ids[text_rows]),
            axis=1,
        )
        same = np.lexsort(token.T[::-1])  # by window, span, id; stable: in row order
        run_start = np.ones(len(same), dtype=bool)
        run_start[1:] = (token[same][1:] != token[same][:-1]).any(axis=1)
        starts = np.flatnonzero(run_start)
        rank = np.empty(len(same), dtype=np.int64)
        rank[same] = np.arange(len(same)) - np.repeat(starts, np.diff(np.append(starts, len(same))))
        keys = np.column_stack((token[:, 1:], rank))
        _, first_seen, key_of_row, group_sizes = np.unique(
            keys, axis=0, return_index=True, return_inverse=True, return_counts=True
        )
        # Tokens in text order: by span, then as the tokenizer put them (where they were first
        # seen in the windows taken in text order: left truncation returns them reversed).
        begins = np.full(len(columns), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(begins, window[text_rows], offsets[text_rows, 0])
        window_rank = np.empty(len(columns), dtype=np.int64)
        window_rank[np.argsort(begins, kind="stable")] = np.arange(len(columns))
        row_in_window = text_rows - first_row[window[text_rows]]
        seen_at = window_rank[window[text_rows]] * (max(sizes) + 1) + row_in_window
        key_of_row = key_of_row.reshape(-1)
        earliest = np.full(len(first_seen), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(earliest, key_of_row, seen_at)
        spans = offsets[text_rows[first_seen]]
        text_order = np.lexsort((earliest, spans[:, 1], spans[:, 0]))
        position = np.empty_like(text_order)
        position[text_order] = np.arange(len(text_order))
        span_of_row = position[key_of_row]
        first_seen, group_sizes = first_seen[text_order], group_sizes[text_order]
        order = np.argsort(span_of_row, kind="stable")
        group_starts = np.cumsum(group_sizes) - group_sizes
        lead_rows = np.arange(lead, dtype=np.intp)
        tail_rows = first_row[-2] + np.arange(tail, len(last), dtype=np.intp)
        body_rows = text_rows[first_seen]
        picked = np.concatenate((lead_rows, body_rows, tail_rows)).tolist()
        take = itemgetter(*picked) if len(picked) > 1 else (lambda xs: (xs[picked[0]],))

        def gathered(field: str) -> list[Any]:
            return list(take(list(chain.from_iterable(getattr(c, field) for c in columns))))

        tokens = TokenColumns(
            gathered("texts"),
            gathered("ids"),
            gathered("offsets"),
            gathered("special"),
            gathered("segments"),
        )
        return cls(
            tokens,
            lead_rows.astype(np.intp),
            body_rows.astype(np.intp),
            tail_rows.astype(np.intp),
            text_rows[order].astype(np.intp),
            group_starts.astype(np.intp),
            group_sizes.astype(np.intp),
        )

    def stitch(self, arrays: Sequence[FloatArray]) -> FloatArray:
        """Per-window arrays [n_w, ...] -> one [len(tokens), ...] array (means over overlaps)."""
        rows = np.concatenate([np.asarray(a, dtype=np.float32) for a in arrays])
        spans = rows[self.span_rows]
        sums = np.add.reduceat(spans, self.group_starts, axis=0) if len(spans) else spans
        sizes = self.group_sizes.reshape((-1,) + (1,) * (rows.ndim - 1))
        body = (sums / sizes).astype(np.float32)
        out = np.concatenate((rows[self.lead_rows], body, rows[self.tail_rows]))
        return np.ascontiguousarray(out, dtype=np.float32)


def encode_document(
    model: LoadedModel, text: str, limit: int, stride: int
) -> tuple[list[Encoded], WindowLayout]:
    """The windows of ``text`` and their layout: everything of a long text that does not need
    the model's outputs, done together (in the tokenizer's thread, off the event loop)."""
    windows = encode_windows(model, text, limit, stride)
    return windows, WindowLayout.of(windows)


def aggregate_logits(logits: Sequence[FloatArray], rule: Aggregation) -> FloatArray:
    """The document's logits [C] from its windows' logits."""
    stacked = np.stack([np.asarray(x, dtype=np.float32) for x in logits])
    out = stacked.max(axis=0) if rule == "max" else stacked.mean(axis=0)
    return np.asarray(out, dtype=np.float32)
