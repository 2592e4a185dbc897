"""Building a drift reference offline: the served inline method over a dataset, batched.

The reference must come from the same method the server explains with (its default inline
method): the monitor compares token shares of attribution mass, and two methods spread that
mass differently even on the same texts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from limelight.core.prediction import predict
from limelight.core.types import Encoded
from limelight.drift.monitor import REFERENCE_CAPACITY_FACTOR
from limelight.drift.profile import Profile, positive_shares
from limelight.drift.reference import ReferenceFile, ServedIdentity
from limelight.errors import InvalidArgument
from limelight.methods.base import InlineMethod
from limelight.methods.normxlogit import NormXLogit
from limelight.models.loaded import LoadedModel
from limelight.runtimes.base import InlineBatch, Runtime
from limelight.runtimes.torch_runtime import TorchRuntime


@dataclass(frozen=True)
class Observation:
    """What the serving path hands the drift monitor for one explanation."""

    label: str
    tokens: list[str]
    """Non-special token texts."""
    scores: np.ndarray
    """The explaining method's score per token for the predicted label."""


def explain_texts(
    model: LoadedModel,
    texts: Sequence[str],
    *,
    runtime: Runtime | None = None,
    method: InlineMethod | None = None,
    batch_size: int = 32,
    progress: Any = None,
    max_tokens: int | None = None,
    pairs: Sequence[str | None] | None = None,
    thresholds: Sequence[float] | None = None,
    truncation: Literal["truncate", "reject", "window"] = "truncate",
) -> list[Observation]:
    """Inline attributions of the predicted class for every text (and pair), in input order:
    ``method`` (default NormXLogit) on ``runtime`` (default torch, without extra heads; a method
    that reads an extra head needs a runtime that computes it).

    Texts are batched in order of token length (less padding); ``progress`` is an optional
    tqdm-like object whose ``update(n)`` is called after each batch. A multi-label model gives
    one observation per predicted label (at ``thresholds``, default 0.5 each), as the
    sidecar's monitor sees them; a text with none gives none. Texts over ``max_tokens``
    are cut there, or with ``truncation="reject"`` give none (a sidecar refuses them); with
    ``"window"`` they are cut too (a sidecar explains every window: the reference holds their
    first).
    """
    runtime = runtime or TorchRuntime(model)
    method = method or NormXLogit()
    if pairs is not None and len(pairs) != len(texts):
        raise ValueError("pairs must match texts")
    encoded: list[Encoded] = []
    kept: list[int] = []
    for i, text in enumerate(texts):
        pair = pairs[i] if pairs is not None else None
        try:
            cut: Literal["truncate", "reject"] = "reject" if truncation == "reject" else "truncate"
            encoded.append(model.encode(text, pair, max_tokens=max_tokens, truncation=cut))
        except InvalidArgument:  # over the limit, refused as the sidecar refuses it
            continue
        kept.append(i)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    results: list[list[Observation]] = [[] for _ in encoded]
    limits = list(thresholds) if thresholds is not None else [0.5] * model.num_labels
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = InlineBatch.from_encoded([encoded[i] for i in rows], model.pad_id)
        outputs = runtime.run_inline(batch)
        for row, index in enumerate(rows):
            enc = encoded[index]
            if model.is_multi_label:
                labels = predict(outputs.logits[row], model.problem_type, limits).active
            else:
                labels = [int(np.argmax(outputs.logits[row]))]
            matrix = method.attribute(outputs, row, len(enc))
            keep = ~enc.special_mask
            tokens = [t.text for t, k in zip(enc.tokens, keep, strict=True) if k]
            results[index] = [
                Observation(
                    label=model.labels[label],
                    tokens=tokens,
                    scores=np.asarray(matrix[:, label][keep], dtype=np.float32),
                )
                for label in labels
            ]
        if progress is not None:
            progress.update(len(rows))
    if progress is not None and len(kept) < len(texts):
        progress.update(len(texts) - len(kept))
    return [obs for per_text in results for obs in per_text]


def profile_of(
    observations: Sequence[Observation], labels: Sequence[str], capacity: int
) -> Profile:
    """A profile of observations, aggregated exactly like the monitor's reference."""
    profile = Profile(labels, capacity)
    for obs in observations:
        shares, entropy = positive_shares(obs.tokens, obs.scores)
        profile.add(obs.label, shares, entropy)
    return profile


def build_reference(
    model: LoadedModel,
    texts: Sequence[str],
    *,
    sketch_size: int,
    runtime: Runtime | None = None,
    method: InlineMethod | None = None,
    batch_size: int = 32,
    progress: Any = None,
    source: dict[str, Any] | None = None,
    pairs: Sequence[str | None] | None = None,
    thresholds: Sequence[float] | None = None,
    served: ServedIdentity | None = None,
    truncation: Literal["truncate", "reject", "window"] = "truncate",
) -> ReferenceFile:
    """A reference file of ``model``'s inline attributions (``method`` on ``runtime``, as in
    :func:`explain_texts`) on ``texts`` (multi-label: per predicted label at ``thresholds``);
    the file records the method and ``served`` (what else the attributions come from: its
    token limit is the one applied), which the monitor checks against what it serves."""
    method = method or NormXLogit()
    observations = explain_texts(
        model,
        texts,
        runtime=runtime,
        method=method,
        batch_size=batch_size,
        progress=progress,
        pairs=pairs,
        thresholds=thresholds,
        max_tokens=served.max_tokens if served is not None else None,
        truncation=truncation,
    )
    profile = profile_of(observations, model.labels, sketch_size * REFERENCE_CAPACITY_FACTOR)
    return ReferenceFile(
        profile=profile,
        labels=list(model.labels),
        model_name=model.name,
        model_version=model.version,
        method=method.name,
        source=dict(source or {}),
        served=served,
    )
