"""What the drift monitor aggregates per window, and how two windows are compared.

An explanation enters as (predicted label, token texts, target scores). Only positive scores
count: each explanation's positive mass is normalised to 1 and spread over its tokens, so a
label's distribution is the mean over its explanations of "which tokens carried the evidence"
(independent of the model's logit scale and of text length). Token texts are normalised by
:func:`normalise_token`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from limelight.drift.report import TokenShift
from limelight.drift.sketch import SpaceSaving, json_int, json_number

_WORD_START_MARKERS = ("\u0120", "\u2581")  # byte-level BPE "Ġ", SentencePiece "▁"


def normalise_token(text: str) -> str:
    """Lowercase, and drop a leading word-start marker (RoBERTa/GPT-2 ``Ġ``, SentencePiece ``▁``).

    The same word then counts once whether or not it starts the text or is capitalised.
    WordPiece continuation pieces keep their ``##`` so ``##ly`` stays apart from ``ly``.
    """
    if text[:1] in _WORD_START_MARKERS and len(text) > 1:
        text = text[1:]
    return text.lower()


def positive_shares(
    tokens: Sequence[str], scores: Sequence[float] | npt.NDArray[np.floating]
) -> tuple[dict[str, float], float | None]:
    """Each token's share of the explanation's positive mass, and that distribution's entropy.

    Returns ``({}, None)`` when no score is positive. The entropy (bits) is over token
    positions; the shares are summed over equal normalised tokens (:func:`normalise_token`).
    """
    if len(tokens) != len(scores):
        raise ValueError(f"{len(tokens)} tokens but {len(scores)} scores")
    values = scores.tolist() if isinstance(scores, np.ndarray) else scores
    picked = [i for i, s in enumerate(values) if s > 0.0]
    mass = math.fsum([values[i] for i in picked])
    if not mass > 0.0 or not math.isfinite(mass):
        return {}, None
    inv = 1.0 / mass
    log2 = math.log2
    shares: dict[str, float] = {}
    entropy = 0.0
    for i in picked:
        share = float(values[i]) * inv
        if share > 0.0:  # a share may underflow to 0
            entropy -= share * log2(share)
        key = normalise_token(tokens[i])
        shares[key] = shares.get(key, 0.0) + share
    return shares, max(entropy, 0.0)


class Profile:
    """Per-label token sketches, the label mix and the entropy sum of a set of explanations.

    ``label_counts`` counts every explanation predicted as a label (the label mix);
    ``positive_counts`` only those with positive attribution mass, the ones its sketch (its
    token distribution) is made of: a label is compared by how many of these each side holds.
    """

    __slots__ = (
        "capacity",
        "count",
        "entropy_count",
        "entropy_sum",
        "label_counts",
        "positive_counts",
        "sketches",
    )

    def __init__(self, labels: Sequence[str], capacity: int) -> None:
        self.capacity = capacity
        self.sketches: dict[str, SpaceSaving] = {label: SpaceSaving(capacity) for label in labels}
        self.label_counts: dict[str, int] = dict.fromkeys(labels, 0)
        self.positive_counts: dict[str, int] = dict.fromkeys(labels, 0)
        self.count = 0
        self.entropy_sum = 0.0
        self.entropy_count = 0

    def add(self, label: str, shares: dict[str, float], entropy: float | None) -> None:
        """Count one explanation predicted as ``label``."""
        self.count += 1
        self.label_counts[label] += 1
        if shares:
            self.positive_counts[label] += 1
        sketch = self.sketches[label]
        for token, share in shares.items():
            sketch.add(token, share)
        if entropy is not None:
            self.entropy_sum += entropy
            self.entropy_count += 1

    def copy(self, with_sketches: bool = True) -> Profile:
        """An independent copy (``with_sketches=False``: the counters, with empty sketches)."""
        out = Profile(list(self.label_counts), self.capacity)
        if with_sketches:
            out.sketches = {label: s.copy() for label, s in self.sketches.items()}
        out.label_counts = dict(self.label_counts)
        out.positive_counts = dict(self.positive_counts)
        out.count = self.count
        out.entropy_sum = self.entropy_sum
        out.entropy_count = self.entropy_count
        return out

    @property
    def mean_entropy(self) -> float:
        """NaN without an explanation of positive mass: no entropy, not one of 0 bits."""
        return self.entropy_sum / self.entropy_count if self.entropy_count else math.nan

    @classmethod
    def merge(cls, parts: Iterable[Profile], capacity: int | None = None) -> Profile:
        """One profile of all parts (same labels); sketches keep up to ``capacity`` tokens."""
        items = list(parts)
        labels = list(items[0].label_counts)
        cap = capacity if capacity is not None else sum(p.capacity for p in items)
        out = cls(labels, cap)
        for label in labels:
            out.sketches[label] = SpaceSaving.merge((p.sketches[label] for p in items), cap)
            out.label_counts[label] = sum(p.label_counts[label] for p in items)
            out.positive_counts[label] = sum(p.positive_counts[label] for p in items)
        out.count = sum(p.count for p in items)
        out.entropy_sum = sum(p.entropy_sum for p in items)
        out.entropy_count = sum(p.entropy_count for p in items)
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "capacity": self.capacity,
            "count": self.count,
            "entropy_sum": self.entropy_sum,
            "entropy_count": self.entropy_count,
            "label_counts": dict(self.label_counts),
            "positive_counts": dict(self.positive_counts),
            "sketches": {label: s.to_json() for label, s in self.sketches.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Profile:
        label_counts = data["label_counts"]
        sketches = data["sketches"]
        if not isinstance(label_counts, dict) or not isinstance(sketches, dict):
            raise ValueError("profile needs label_counts and sketches objects")
        out = cls(list(label_counts), json_int(data, "capacity"))
        out.label_counts = {str(k): json_int(label_counts, k) for k in label_counts}
        out.sketches = {str(k): SpaceSaving.from_json(v) for k, v in sketches.items()}
        if set(out.sketches) != set(out.label_counts):
            raise ValueError("profile sketches and label_counts name different labels")
        positive = data.get("positive_counts")
        if positive is None:  # written before they were counted: all, if any mass came in
            out.positive_counts = {
                k: n if out.sketches[k].total > 0 else 0 for k, n in out.label_counts.items()
            }
        else:
            if not isinstance(positive, dict) or set(positive) != set(out.label_counts):
                raise ValueError("profile positive_counts must name the labels of label_counts")
            out.positive_counts = {str(k): json_int(positive, k) for k in positive}
            if any(out.positive_counts[k] > n for k, n in out.label_counts.items()):
                raise ValueError("profile positive_counts exceed label_counts")
        out.count = json_int(data, "count")
        out.entropy_sum = json_number(data, "entropy_sum")
        out.entropy_count = json_int(data, "entropy_count")
        return out


def js_divergence(
    p: Sequence[float] | npt.NDArray[np.floating], q: Sequence[float] | npt.NDArray[np.floating]
) -> float:
    """Jensen-Shannon divergence in bits (base 2), in [0, 1]; inputs are normalised first.

    An all-zero side means "no data": the divergence is NaN (nothing to compare), never a 0
    that reads as "no drift".
    """
    a = np.asarray(p, dtype=np.float64)
    b = np.asarray(q, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError("distributions differ in length")
    if np.any(a < 0) or np.any(b < 0):
        raise ValueError("distributions must be non-negative")
    sa, sb = a.sum(), b.sum()
    if sa <= 0 or sb <= 0:
        return math.nan
    a, b = a / sa, b / sb
    m = 0.5 * (a + b)

    def kl(x: npt.NDArray[np.float64]) -> float:
        nz = x > 0
        return float(np.sum(x[nz] * np.log2(x[nz] / m[nz])))

    return min(max(0.5 * kl(a) + 0.5 * kl(b), 0.0), 1.0)


@dataclass(frozen=True)
class Comparison:
    divergence: float
    shifts: list[TokenShift]
    """Every resolvable token's share in both windows (see :func:`compare`)."""


MIN_BIN_SHARE = 0.01
"""Default smallest share (of a label's positive mass, in either window) that gets its own bin."""


def compare(
    reference: SpaceSaving, current: SpaceSaving, min_share: float = MIN_BIN_SHARE
) -> Comparison:
    """JSD of two token sketches on the union of their heavy tokens plus an "other" bin.

    A token keeps its own bin when its certain share (lower bound) in either window is at least
    ``min_share`` and above both sketches' noise floors (``floor / total``: the most an
    untracked token can hold). Its share is the midpoint of its bounds, or half the floor in a
    window whose sketch does not track it. All other mass is "other" in both windows.

    Why coarsen: a JSD over a sparse, long-tailed vocabulary is biased upwards by sampling
    noise (two samples of a few hundred texts from the same distribution differ in their rare
    words), and a bounded sketch cannot know the tail anyway. Merging bins can only lower a
    JSD (data-processing inequality), so the tail never raises a false alarm, while a token that
    gained or lost real share keeps its own bin and any mass moving into or out of the tail
    shows up in "other".
    """
    if reference.total <= 0 or current.total <= 0:
        # No positive mass on a side (no explanation, or evidence all negative): undefined.
        return Comparison(math.nan, [])
    r_total, c_total = reference.total, current.total
    cutoff = max(reference.floor / r_total, current.floor / c_total, min_share)
    # A token keeps a bin when its lower bound reaches cutoff * total on either side.
    r_min, c_min = cutoff * r_total, cutoff * c_total
    heavy = {t for t, c in reference.counts.items() if c - reference.errors[t] >= r_min}
    heavy.update(t for t, c in current.counts.items() if c - current.errors[t] >= c_min)
    shifts: list[TokenShift] = []
    for token in heavy:
        r = reference.estimate(token)
        c = current.estimate(token)
        if max(r.lower, c.lower) <= 0.0:
            continue
        shifts.append(TokenShift(token, r.mid / r_total, c.mid / c_total))
    p = [s.reference_share for s in shifts]
    q = [s.current_share for s in shifts]
    p.append(max(1.0 - sum(p), 0.0))
    q.append(max(1.0 - sum(q), 0.0))
    return Comparison(js_divergence(p, q), shifts)
