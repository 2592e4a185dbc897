"""Run attribution methods over a labelled dataset and compute every faithfulness metric.

For each input the target class is the model's own prediction on the unperturbed input, so the
AOPC metrics need no gold labels (faithfulness to the model, not to the annotators). The hiding
and revealing games measure accuracy against the gold label where the dataset has one that maps
onto the model's classes; they are also reported as *agreement* with the model's original
prediction, which every input has.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from limelight.core.types import Encoded, FloatArray, IntArray
from limelight.evaluation import metrics as M
from limelight.evaluation.perturbation import (
    DEFAULT_FRACTIONS,
    Replacement,
    perturb,
    probabilities,
    ranked_positions,
)
from limelight.models.loaded import LoadedModel

Explainer = Callable[[Encoded, int], FloatArray]


@runtime_checkable
class TimedExplainer(Protocol):
    """An explainer that knows what its answer cost (a stored answer: the time it took when it
    was computed, not the time it took to read back)."""

    def timed(self, enc: Encoded, target: int) -> tuple[FloatArray, float]: ...


"""(encoded input, target class) -> [n] scores, higher = more important for the target."""

GAME_FRACTIONS: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))
OVERLAP_KS: tuple[int, ...] = (5, 10, 20, 50)


@dataclass(frozen=True)
class EvalExample:
    """One input: text (and pair), gold class index in the model's label space, evidence.

    ``evidence`` is a list of [start, end) character spans of ``text`` (None = no annotation).
    """

    text: str
    gold: int | None = None
    text_pair: str | None = None
    evidence: tuple[tuple[int, int], ...] | None = None
    source_index: int | None = None
    """Position in the dataset it was drawn from (identifies it across runs)."""


@dataclass
class EvalConfig:
    """What to measure and how to perturb."""

    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    """Token fractions of the AOPC curves (deletion and sufficiency)."""
    game_fractions: tuple[float, ...] = GAME_FRACTIONS
    """Fractions of the hiding / revealing games, from 0 to 1."""
    replace: Replacement = "mask"
    overlap_ks: tuple[int, ...] = OVERLAP_KS
    batch_size: int = 64
    max_tokens: int = 512
    label_thresholds: dict[str, float] | None = None
    """Multi-label models: each label's threshold in force, which decides the evaluated items
    (one per text and label at or over its threshold); None for other models."""


@dataclass
class MethodResult:
    """Every metric of one method; lists run over ``fractions`` / ``game_fractions`` / ks."""

    name: str
    status: str = "ok"
    """ok, skipped (cannot run on this model) or failed."""
    reason: str = ""
    n: int = 0
    seconds: list[float] = field(default_factory=list)
    deletion_curve: list[float] = field(default_factory=list)
    sufficiency_curve: list[float] = field(default_factory=list)
    aopc_deletion: float | None = None
    aopc_deletion_se: float | None = None
    aopc_sufficiency: float | None = None
    aopc_sufficiency_se: float | None = None
    aopc_deletion_per_input: list[float] = field(default_factory=list)
    """Per input, in the order of the examples: paired differences between methods."""
    aopc_sufficiency_per_input: list[float] = field(default_factory=list)
    hide_accuracy: list[float] = field(default_factory=list)
    reveal_accuracy: list[float] = field(default_factory=list)
    hide_auc: float | None = None
    reveal_auc: float | None = None
    n_gold: int = 0
    hide_agreement: list[float] = field(default_factory=list)
    reveal_agreement: list[float] = field(default_factory=list)
    hide_agreement_auc: float | None = None
    reveal_agreement_auc: float | None = None
    overlap: dict[int, float | None] = field(default_factory=dict)
    overlap_tokens: list[str] = field(default_factory=list)
    top_tokens: dict[str, list[str]] = field(default_factory=dict)
    evidence_ap: float | None = None
    evidence_dot: float | None = None
    n_evidence: int = 0

    @property
    def mean_ms(self) -> float | None:
        return 1000.0 * float(np.mean(self.seconds)) if self.seconds else None

    @property
    def median_ms(self) -> float | None:
        return 1000.0 * float(np.median(self.seconds)) if self.seconds else None

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "seconds"}
        out["overlap"] = {str(k): v for k, v in self.overlap.items()}
        out["mean_ms"] = self.mean_ms
        out["median_ms"] = self.median_ms
        out["seconds"] = self.seconds
        return out


@dataclass
class _Scored:
    """One explained input: ranking and the model's outputs on every perturbed variant."""

    p0: float
    deletion: list[float]
    sufficiency: list[float]
    hide_pred: list[int]
    reveal_pred: list[int]


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of ``a - b`` over the same inputs."""
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return float(diff.mean()), _stderr(diff.tolist())


def _stderr(values: Sequence[float]) -> float:
    return float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0


class Evaluator:
    """Evaluates explainers on one model; no state between :meth:`evaluate` calls."""

    def __init__(self, model: LoadedModel, config: EvalConfig | None = None) -> None:
        self.model = model
        self.config = config or EvalConfig()

    def encode(self, examples: Sequence[EvalExample]) -> list[Encoded]:
        return [
            self.model.encode(e.text, e.text_pair, self.config.max_tokens, "truncate")
            for e in examples
        ]

    def predict(self, encoded: Sequence[Encoded]) -> FloatArray:
        """[len, C] class probabilities of the unperturbed inputs."""
        return probabilities(self.model, encoded, self.config.batch_size)

    def _variants(self, enc: Encoded, scores: FloatArray) -> tuple[list[Encoded], list[int]]:
        """Perturbed copies of ``enc`` and, per AOPC / game level, which copy it uses.

        Order of levels: the unperturbed input, deletion (fractions), sufficiency (fractions),
        hide (game fractions), reveal (game fractions). Identical perturbations share one copy.
        """
        cfg = self.config
        order = ranked_positions(enc, scores)
        n = len(order)
        drops: list[frozenset[int]] = [frozenset()]
        for f in cfg.fractions:
            drops.append(frozenset(order[: M.fraction_count(n, f, at_least_one=True)]))
        for f in cfg.fractions:
            drops.append(frozenset(order[M.fraction_count(n, f, at_least_one=True) :]))
        for f in cfg.game_fractions:
            drops.append(frozenset(order[: M.fraction_count(n, f)]))
        for f in cfg.game_fractions:
            drops.append(frozenset(order[M.fraction_count(n, f) :]))
        index: dict[frozenset[int], int] = {}
        variants: list[Encoded] = []
        which = []
        for drop in drops:
            if drop not in index:
                index[drop] = len(variants)
                variants.append(
                    perturb(self.model, enc, sorted(drop), cfg.replace) if drop else enc
                )
            which.append(index[drop])
        return variants, which

    def _score(
        self, encoded: Sequence[Encoded], scores: Sequence[FloatArray], targets: Sequence[int]
    ) -> list[_Scored]:
        cfg = self.config
        nf, ng = len(cfg.fractions), len(cfg.game_fractions)
        all_variants: list[Encoded] = []
        plans = []
        for enc, s in zip(encoded, scores, strict=True):
            variants, which = self._variants(enc, s)
            plans.append((len(all_variants), which))
            all_variants.extend(variants)
        probs = probabilities(self.model, all_variants, cfg.batch_size)
        out = []
        for (offset, which), target in zip(plans, targets, strict=True):
            rows = probs[[offset + w for w in which]][1:]
            p_target = rows[:, target]
            preds = self._game_predictions(rows, target)
            out.append(
                _Scored(
                    p0=float(probs[offset + which[0], target]),
                    deletion=[float(v) for v in p_target[:nf]],
                    sufficiency=[float(v) for v in p_target[nf : 2 * nf]],
                    hide_pred=[int(v) for v in preds[2 * nf : 2 * nf + ng]],
                    reveal_pred=[int(v) for v in preds[2 * nf + ng :]],
                )
            )
        return out

    def _game_predictions(self, rows: FloatArray, target: int) -> IntArray:
        """What each perturbed input of the games predicts. Single-label: the arg-max class.
        Multi-label: ``target`` while that label is still one the sidecar would explain (at or
        over its threshold, or the most probable when no label passes), else -1 — the arg-max
        of a text with several labels is only one of them, so an untouched text "disagreed"
        with its other labels."""
        argmax = rows.argmax(axis=1)
        limits = self.config.label_thresholds
        if not limits:
            return argmax
        thresholds = np.array([limits[label] for label in self.model.labels])
        passes = rows >= thresholds
        kept = np.where(passes.any(axis=1), passes[:, target], argmax == target)
        return np.where(kept, target, -1)

    def evaluate_method(
        self,
        name: str,
        explainer: Explainer,
        examples: Sequence[EvalExample],
        encoded: Sequence[Encoded] | None = None,
        predicted: Sequence[int] | None = None,
        idf: Mapping[str, float] | None = None,
        tick: Callable[[], None] | None = None,
    ) -> MethodResult:
        """Explain every example with ``explainer`` and compute all metrics."""
        cfg = self.config
        encoded = list(encoded) if encoded is not None else self.encode(examples)
        if predicted is None:
            predicted = [int(p) for p in self.predict(encoded).argmax(axis=1)]
        result = MethodResult(name=name, n=len(examples))
        scores: list[FloatArray] = []
        for enc, target in zip(encoded, predicted, strict=True):
            if isinstance(explainer, TimedExplainer):
                answer, seconds = explainer.timed(enc, int(target))
            else:
                start = time.perf_counter()
                answer = explainer(enc, int(target))
                seconds = time.perf_counter() - start
            s = np.asarray(answer, dtype=np.float32)
            result.seconds.append(seconds)
            if s.shape != (len(enc),):
                raise ValueError(f"{name}: {s.shape} scores for {len(enc)} tokens")
            scores.append(np.nan_to_num(s, nan=0.0, posinf=0.0, neginf=0.0))
            if tick is not None:
                tick()
        scored = self._score(encoded, scores, predicted)

        deletion = np.array([[r.p0 - v for v in r.deletion] for r in scored])
        sufficiency = np.array([[r.p0 - v for v in r.sufficiency] for r in scored])
        result.deletion_curve = [float(v) for v in deletion.mean(axis=0)]
        result.sufficiency_curve = [float(v) for v in sufficiency.mean(axis=0)]
        per_del = [M.aopc(r.p0, r.deletion) for r in scored]
        per_suf = [M.aopc(r.p0, r.sufficiency) for r in scored]
        result.aopc_deletion, result.aopc_deletion_se = float(np.mean(per_del)), _stderr(per_del)
        result.aopc_deletion_per_input = [float(v) for v in per_del]
        result.aopc_sufficiency_per_input = [float(v) for v in per_suf]
        result.aopc_sufficiency = float(np.mean(per_suf))
        result.aopc_sufficiency_se = _stderr(per_suf)

        xs = list(cfg.game_fractions)
        hide = np.array([r.hide_pred for r in scored])
        reveal = np.array([r.reveal_pred for r in scored])
        result.hide_agreement = M.accuracy_curve(hide, predicted)
        result.reveal_agreement = M.accuracy_curve(reveal, predicted)
        if len(xs) >= 2:
            result.hide_agreement_auc = M.auc(xs, result.hide_agreement)
            result.reveal_agreement_auc = M.auc(xs, result.reveal_agreement)
        labelled = [i for i, e in enumerate(examples) if e.gold is not None]
        result.n_gold = len(labelled)
        if labelled:
            gold = [int(examples[i].gold) for i in labelled]  # type: ignore[arg-type]
            result.hide_accuracy = M.accuracy_curve(hide[labelled], gold)
            result.reveal_accuracy = M.accuracy_curve(reveal[labelled], gold)
            if len(xs) >= 2:
                result.hide_auc = M.auc(xs, result.hide_accuracy)
                result.reveal_auc = M.auc(xs, result.reveal_accuracy)

        items = []
        for enc, s, cls in zip(encoded, scores, predicted, strict=True):
            keep = [i for i, t in enumerate(enc.tokens) if not t.special]
            items.append((int(cls), [enc.tokens[i].text.lower() for i in keep], s[keep]))
        importance = M.class_token_importance(items, idf)
        top = {c: M.top_tokens(imp, max(cfg.overlap_ks)) for c, imp in importance.items()}
        result.overlap = {k: M.token_overlap(top, k) for k in cfg.overlap_ks}
        result.overlap_tokens = M.overlapping_tokens(top, max(cfg.overlap_ks))
        labels = self.model.labels
        result.top_tokens = {labels[c]: t[:10] for c, t in sorted(top.items())}

        aps, dots = [], []
        for ex, enc, s in zip(examples, encoded, scores, strict=True):
            if not ex.evidence:
                continue
            evidence = M.evidence_from_spans(
                [(t.start, t.end) if t.segment == 0 else (0, 0) for t in enc.tokens],
                [t.special for t in enc.tokens],
                ex.evidence,
            )
            if not any(evidence):
                continue
            keep = [i for i, t in enumerate(enc.tokens) if not t.special]
            e = np.asarray(evidence, dtype=np.float64)[keep]
            v = s[keep].astype(np.float64)
            mass = np.abs(v).sum()
            aps.append(M.average_precision(e, v))
            # scale-free: share of the (L1) attribution mass that lands on the evidence
            dots.append(M.dot_product(e, v / mass) if mass > 0 else 0.0)
        result.n_evidence = len(aps)
        if aps:
            result.evidence_ap = float(np.mean(aps))
            result.evidence_dot = float(np.mean(dots))
        return result


def token_idf(model: LoadedModel, texts: Sequence[str], max_tokens: int) -> dict[str, float]:
    """IDF of the model's (lower-cased) tokens over ``texts``: the corpus of the evaluation."""
    docs = []
    for text in texts:
        enc = model.encode(text, None, max_tokens, "truncate")
        docs.append([t.text.lower() for t in enc.tokens if not t.special])
    return M.inverse_document_frequency(docs)
