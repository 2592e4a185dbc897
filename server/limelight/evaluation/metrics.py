"""Faithfulness and plausibility metrics as pure functions of numbers (no model in here).

- AOPC (NormXLogit paper, arXiv 2411.16252, eq. 5): mean over perturbation fractions of
  p(target | x) - p(target | x~). Deletion (comprehensiveness) removes the top-k tokens: higher
  is more faithful. Sufficiency keeps only the top-k tokens: lower is more faithful.
- Hiding / revealing games (Hou & Castanon, arXiv 2308.05219, §4.1): accuracy against the gold
  label after hiding the top-k% tokens (lower area is better) or after revealing only them
  (higher area is better); areas by the trapezoid rule over the fraction axis [0, 1].
- Token overlap across predicted classes (arXiv 2308.05219 §4.2): share of the top-k tokens of one
  class that are also among the top-k of another, over every pair of classes (lower is better).
- Evidence alignment (arXiv 2411.16252 §5.1, appendix A.4): dot product and average precision
  of an attribution vector against a 0/1 evidence vector.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

ArrayLike = Sequence[float] | npt.NDArray[np.floating]
FloatList = list[float]


def fraction_count(n: int, fraction: float, at_least_one: bool = False) -> int:
    """How many of ``n`` tokens a perturbation ``fraction`` touches (round half to even)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction {fraction} outside [0, 1]")
    k = round(fraction * n)
    if at_least_one and n > 0:
        k = max(1, k)
    return min(n, k)


def aopc(original: float, perturbed: ArrayLike) -> float:
    """Mean drop ``original - perturbed[k]`` over the perturbation levels (one input)."""
    values = np.asarray(perturbed, dtype=np.float64)
    if values.size == 0:
        raise ValueError("AOPC needs at least one perturbation level")
    return float(np.mean(original - values))


def auc(xs: ArrayLike, ys: ArrayLike) -> float:
    """Area under ``ys(xs)`` by the trapezoid rule; ``xs`` increasing."""
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if x.shape != y.shape or x.size < 2:
        raise ValueError("auc needs two equally long arrays of at least two points")
    if np.any(np.diff(x) <= 0):
        raise ValueError("auc needs strictly increasing x")
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2.0))


def accuracy_curve(predictions: npt.NDArray[np.integer], gold: Sequence[int]) -> FloatList:
    """Per perturbation level, the share of inputs predicted as their gold label.

    ``predictions`` is [inputs, levels] of class indices.
    """
    preds = np.asarray(predictions)
    labels = np.asarray(gold)[:, None]
    return [float(v) for v in np.mean(preds == labels, axis=0)]


# --- evidence alignment -------------------------------------------------------------------------


def dot_product(evidence: ArrayLike, scores: ArrayLike) -> float:
    """Total score the attribution assigns to the evidence tokens (arXiv 2411.16252, A.4)."""
    e = np.asarray(evidence, dtype=np.float64)
    s = np.asarray(scores, dtype=np.float64)
    if e.shape != s.shape:
        raise ValueError(f"evidence {e.shape} and scores {s.shape} differ in shape")
    return float(e @ s)


def average_precision(evidence: ArrayLike, scores: ArrayLike) -> float:
    """Average precision of ranking tokens by ``scores`` (descending) against 0/1 ``evidence``.

    Precision is taken at every rank where a new evidence token appears, and averaged over the
    evidence tokens. Ties keep the original token order (the earlier token ranks first), so the
    value is deterministic. Raises ValueError when there is no evidence token.
    """
    e = np.asarray(evidence, dtype=np.float64) > 0
    s = np.asarray(scores, dtype=np.float64)
    if e.shape != s.shape:
        raise ValueError(f"evidence {e.shape} and scores {s.shape} differ in shape")
    total = int(e.sum())
    if total == 0:
        raise ValueError("average precision needs at least one evidence token")
    order = sorted(range(len(s)), key=lambda i: (-s[i], i))
    found = 0
    precisions = []
    for rank, index in enumerate(order, start=1):
        if e[index]:
            found += 1
            precisions.append(found / rank)
    return float(np.mean(precisions))


def evidence_from_spans(
    offsets: Sequence[tuple[int, int]], special: Sequence[bool], spans: Iterable[Sequence[int]]
) -> list[int]:
    """0/1 per token: 1 where a non-special token's character span overlaps an evidence span.

    ``offsets`` are [start, end) character offsets into the text; ``spans`` are [start, end).
    """
    spans = [(int(a), int(b)) for a, b in spans]
    out = []
    for (start, end), is_special in zip(offsets, special, strict=True):
        hit = not is_special and end > start and any(start < b and a < end for a, b in spans)
        out.append(int(hit))
    return out


# --- token overlap across predicted classes -----------------------------------------------------


def inverse_document_frequency(documents: Iterable[Iterable[str]]) -> dict[str, float]:
    """Smoothed IDF, ``log((1 + N) / (1 + df)) + 1``, of each token over ``documents``."""
    df: Counter[str] = Counter()
    n = 0
    for doc in documents:
        n += 1
        df.update(set(doc))
    return {tok: math.log((1 + n) / (1 + count)) + 1.0 for tok, count in df.items()}


def class_token_importance(
    items: Iterable[tuple[int, Sequence[str], ArrayLike]],
    idf: Mapping[str, float] | None = None,
) -> dict[int, dict[str, float]]:
    """Per predicted class, each token's aggregated importance (arXiv 2308.05219 §4.2).

    ``items`` are (predicted class, token strings, scores) of the non-special tokens of each
    input. Each input's scores are clipped at 0 (only evidence *for* its class counts) and
    divided by their maximum, so no single input dominates; the sums over the inputs of a class
    are weighted by the token's IDF (1 when ``idf`` is None or lacks the token).
    """
    totals: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for cls, tokens, scores in items:
        s = np.clip(np.asarray(scores, dtype=np.float64), 0.0, None)
        top = float(s.max()) if s.size else 0.0
        if top <= 0.0:
            continue
        for tok, value in zip(tokens, s / top, strict=True):
            if value > 0.0:
                totals[cls][tok] += float(value)
    out: dict[int, dict[str, float]] = {}
    for cls, table in totals.items():
        out[cls] = {tok: v * (idf.get(tok, 1.0) if idf else 1.0) for tok, v in table.items()}
    return out


def top_tokens(importance: Mapping[str, float], k: int) -> list[str]:
    """The ``k`` most important tokens, ties broken alphabetically."""
    return [t for t, _ in sorted(importance.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def token_overlap(top_by_class: Mapping[int, Sequence[str]], k: int) -> float | None:
    """Share of top-``k`` tokens shared by two classes, pooled over every pair of classes.

    For each pair (a, b) count |top_k(a) ∩ top_k(b)|; divide the sum by the number of pairs
    times ``k``. 0 = every class has its own tokens, 1 = all classes rank the same tokens.
    None with fewer than two classes.
    """
    classes = sorted(top_by_class)
    if len(classes) < 2 or k <= 0:
        return None
    shared = 0
    pairs = 0
    for a, b in itertools.combinations(classes, 2):
        shared += len(set(top_by_class[a][:k]) & set(top_by_class[b][:k]))
        pairs += 1
    return shared / (pairs * k)


def overlapping_tokens(top_by_class: Mapping[int, Sequence[str]], k: int) -> list[str]:
    """The tokens in the top-``k`` of at least two classes, sorted."""
    seen: Counter[str] = Counter()
    for tokens in top_by_class.values():
        seen.update(set(tokens[:k]))
    return sorted(t for t, c in seen.items() if c >= 2)
