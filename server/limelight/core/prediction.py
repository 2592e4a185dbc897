"""From a model's logits to its answer: probabilities, the top label and the predicted set.

Three kinds of heads, told apart by the model's config (``LoadedModel.problem_type``):

* ``single_label_classification``: softmax over the classes; the prediction is the arg-max.
* ``multi_label_classification``: an independent sigmoid per label; the prediction is the set
  of labels whose probability reaches that label's threshold (``Settings.label_threshold``,
  per label ``Settings.label_thresholds``). ``index`` is the most probable label, whether or
  not it passed its threshold (the set may be empty).
* ``regression`` (one output): the raw value is returned in place of a probability.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from limelight.core.types import FloatArray
from limelight.errors import InvalidArgument
from limelight.settings import LABEL_THRESHOLD_RANGE

ProblemType = Literal["single_label_classification", "multi_label_classification", "regression"]
SINGLE_LABEL: ProblemType = "single_label_classification"
MULTI_LABEL: ProblemType = "multi_label_classification"
REGRESSION: ProblemType = "regression"


def softmax(logits: FloatArray) -> FloatArray:
    shifted = np.exp(logits - logits.max())
    return np.asarray(shifted / shifted.sum(), dtype=np.float32)


def sigmoid(logits: FloatArray) -> FloatArray:
    """Element-wise logistic function, without overflow for large negative logits."""
    x = np.asarray(logits, dtype=np.float64)
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    e = np.exp(x[~pos])
    out[~pos] = e / (1.0 + e)
    return out.astype(np.float32)


@dataclass(frozen=True)
class Prediction:
    """The answer for one input."""

    probabilities: FloatArray
    """[C] softmax, sigmoid per label, or the raw regression value."""
    index: int
    """The top label (arg-max of the probabilities; 0 for regression)."""
    active: list[int] = field(default_factory=list)
    """The predicted labels: multi-label, every label at or above its threshold, most probable
    first (possibly none); otherwise ``[index]``."""


def predict(logits: FloatArray, problem: ProblemType, thresholds: Sequence[float]) -> Prediction:
    """The prediction for one row of logits [C]."""
    logits = np.asarray(logits, dtype=np.float32)
    if problem == REGRESSION:
        return Prediction(logits.astype(np.float32), 0, [0])
    if problem == MULTI_LABEL:
        probs = sigmoid(logits)
        order = np.argsort(-probs, kind="stable")
        active = [int(i) for i in order if probs[i] >= thresholds[i]]
        return Prediction(probs, int(order[0]), active)
    probs = softmax(logits)
    top = int(np.argmax(probs))
    return Prediction(probs, top, [top])


def predict_rows(
    logits: FloatArray, problem: ProblemType, thresholds: Sequence[float]
) -> list[Prediction]:
    """:func:`predict` for every row of a batch's logits [B, C]: the same answers, with one
    numpy pass for the whole batch where a row's own pass costs microseconds of fixed overhead
    (single-label; the other kinds go row by row)."""
    logits = np.asarray(logits, dtype=np.float32)
    if problem != SINGLE_LABEL or logits.ndim != 2:
        return [predict(row, problem, thresholds) for row in logits]
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = np.asarray(shifted / shifted.sum(axis=1, keepdims=True), dtype=np.float32)
    return [Prediction(probs[i], top, [top]) for i, top in enumerate(probs.argmax(axis=1).tolist())]


def label_thresholds(
    labels: Sequence[str], default: float, per_label: Mapping[str, float]
) -> list[float]:
    """One threshold per label: ``per_label[name]`` where given, else ``default``.

    Raises InvalidArgument for a label the model does not have or a value outside (0, 1]."""
    unknown = sorted(set(per_label) - set(labels))
    if unknown:
        raise InvalidArgument(
            f"label_thresholds names unknown labels {', '.join(map(repr, unknown))}; "
            f"this model's labels are: {', '.join(labels)}"
        )
    out = [float(per_label.get(name, default)) for name in labels]
    low, high = LABEL_THRESHOLD_RANGE  # the settings' own range
    for name, value in zip(labels, out, strict=True):
        if not low < value <= high or not np.isfinite(value):
            raise InvalidArgument(
                f"threshold {value} for label {name!r} is not in ({low:g}, {high:g}]"
            )
    return out
