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
from typing import TYPE_CHECKING, Literal

import numpy as np

from limelight.core.types import Encoded, FloatArray, TokenInfo
from limelight.errors import InvalidArgument

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel

Aggregation = Literal["mean", "max"]


def check_stride(stride: int, limit: int) -> None:
    """The overlap must leave every window at least half new tokens."""
    if not 0 <= stride <= limit // 2:
        raise InvalidArgument(
            f"window_stride {stride} must be between 0 and half the token limit ({limit // 2})"
        )


def encode_windows(model: LoadedModel, text: str, limit: int, stride: int) -> list[Encoded]:
    """``text`` as overlapping windows of at most ``limit`` tokens; one window when it fits."""
    enc = model.tokenizer(
        text,
        truncation=True,
        max_length=limit,
        stride=stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
    )
    with_types = model.adapter.uses_token_type_ids
    windows = []
    for w, ids in enumerate(enc["input_ids"]):
        names = model.tokenizer.convert_ids_to_tokens(ids)
        tokens = [
            TokenInfo(str(name), int(tid), int(start), int(end), bool(special), 0)
            for name, tid, (start, end), special in zip(
                names, ids, enc["offset_mapping"][w], enc["special_tokens_mask"][w], strict=True
            )
        ]
        types = enc["token_type_ids"][w] if with_types and "token_type_ids" in enc else None
        type_ids = list(types) if types is not None else None
        windows.append(Encoded(list(ids), type_ids, tokens, False))
    return windows


@dataclass
class WindowLayout:
    """Where each token of the stitched document comes from: (window, row) pairs."""

    tokens: list[TokenInfo]
    sources: list[list[tuple[int, int]]]

    @classmethod
    def of(cls, windows: Sequence[Encoded]) -> WindowLayout:
        first, last = windows[0].tokens, windows[-1].tokens
        lead = 0
        while lead < len(first) and first[lead].special:
            lead += 1
        tail = len(last)
        while tail > 0 and last[tail - 1].special:
            tail -= 1
        tokens: list[TokenInfo] = list(first[:lead])
        sources: list[list[tuple[int, int]]] = [[(0, row)] for row in range(lead)]
        where: dict[tuple[int, int], int] = {}
        for w, window in enumerate(windows):
            for row, tok in enumerate(window.tokens):
                if tok.special:
                    continue
                key = (tok.start, tok.end)
                index = where.get(key)
                if index is None:
                    where[key] = len(tokens)
                    tokens.append(tok)
                    sources.append([(w, row)])
                else:
                    sources[index].append((w, row))
        # Text order whatever order the tokenizer returned the windows in (left truncation).
        body = sorted(range(lead, len(tokens)), key=lambda i: (tokens[i].start, tokens[i].end))
        tokens[lead:] = [tokens[i] for i in body]
        sources[lead:] = [sources[i] for i in body]
        for row in range(tail, len(last)):
            tokens.append(last[row])
            sources.append([(len(windows) - 1, row)])
        return cls(tokens, sources)

    def stitch(self, arrays: Sequence[FloatArray]) -> FloatArray:
        """Per-window arrays [n_w, ...] -> one [len(tokens), ...] array (means over overlaps)."""
        rows = [
            np.mean([arrays[w][row] for w, row in pairs], axis=0)
            if len(pairs) > 1
            else arrays[pairs[0][0]][pairs[0][1]]
            for pairs in self.sources
        ]
        return np.ascontiguousarray(np.stack(rows), dtype=np.float32)


def aggregate_logits(logits: Sequence[FloatArray], rule: Aggregation) -> FloatArray:
    """The document's logits [C] from its windows' logits."""
    stacked = np.stack([np.asarray(x, dtype=np.float32) for x in logits])
    out = stacked.max(axis=0) if rule == "max" else stacked.mean(axis=0)
    return np.asarray(out, dtype=np.float32)
