"""On a model decided by one known token: oracle > random > anti-oracle on every metric."""

from __future__ import annotations

import numpy as np
import pytest

from limelight.core.types import Encoded, FloatArray
from limelight.evaluation.explainers import build_explainers
from limelight.evaluation.perturbation import deletion_curve
from limelight.evaluation.runner import EvalConfig, Evaluator, MethodResult, token_idf
from limelight.settings import Settings
from tests.evaluation.conftest import TRIGGERS, TriggerSetup


def oracle(enc: Encoded, target: int) -> FloatArray:
    return np.array([1.0 if t.text in TRIGGERS else 0.0 for t in enc.tokens], dtype=np.float32)


def anti_oracle(enc: Encoded, target: int) -> FloatArray:
    """Every other token above the trigger (ties: earlier first), the trigger last."""
    return 1.0 - oracle(enc, target)


@pytest.fixture(scope="module")
def results(trigger_setup: TriggerSetup) -> dict[str, MethodResult]:
    model, examples = trigger_setup.model, trigger_setup.examples
    evaluator = Evaluator(model, EvalConfig(overlap_ks=(1, 5)))
    encoded = evaluator.encode(examples)
    predicted = [int(p) for p in evaluator.predict(encoded).argmax(axis=1)]
    idf = token_idf(model, [e.text for e in examples], 64)
    explainers, skipped = build_explainers(model, ["random"], Settings(), seed=3)
    assert not skipped
    out = {}
    for name, fn in [("oracle", oracle), ("random", explainers["random"]), ("anti", anti_oracle)]:
        out[name] = evaluator.evaluate_method(name, fn, examples, encoded, predicted, idf)
    return out


def test_the_model_learned_the_trigger(trigger_setup: TriggerSetup) -> None:
    evaluator = Evaluator(trigger_setup.model)
    probs = evaluator.predict(evaluator.encode(trigger_setup.examples))
    gold = np.array([e.gold for e in trigger_setup.examples])
    assert (probs.argmax(axis=1) == gold).mean() == 1.0
    assert probs.max(axis=1).min() > 0.9


def test_deletion_aopc_ranks_oracle_random_anti(results: dict[str, MethodResult]) -> None:
    o, r, a = (results[k].aopc_deletion for k in ("oracle", "random", "anti"))
    assert o is not None and r is not None and a is not None
    assert o > r > a
    assert o > 0.3  # deleting the trigger first really moves the prediction


def test_sufficiency_ranks_oracle_random_anti(results: dict[str, MethodResult]) -> None:
    o, r, a = (results[k].aopc_sufficiency for k in ("oracle", "random", "anti"))
    assert o is not None and r is not None and a is not None
    assert o < r < a


def test_games_rank_oracle_random_anti(results: dict[str, MethodResult]) -> None:
    o, r, a = (results[k] for k in ("oracle", "random", "anti"))
    assert o.n_gold == 40
    assert o.hide_auc < r.hide_auc < a.hide_auc  # type: ignore[operator]
    assert o.reveal_auc > r.reveal_auc > a.reveal_auc  # type: ignore[operator]
    # the unperturbed level is the model's accuracy, the same for every method
    assert o.hide_accuracy[0] == r.hide_accuracy[0] == a.hide_accuracy[0] == 1.0


def test_token_overlap_ranks_oracle_random_anti(results: dict[str, MethodResult]) -> None:
    o, r, a = (results[k] for k in ("oracle", "random", "anti"))
    # oracle: each class's only important token is its own trigger
    assert o.top_tokens == {"neg": ["terrible"], "pos": ["excellent"]}
    assert o.overlap[5] == 0.0
    assert o.overlap[5] < r.overlap[5] < a.overlap[5]  # type: ignore[operator]


def test_evidence_alignment_ranks_oracle_random_anti(results: dict[str, MethodResult]) -> None:
    o, r, a = (results[k] for k in ("oracle", "random", "anti"))
    assert o.n_evidence == 40
    assert o.evidence_ap == pytest.approx(1.0)
    assert o.evidence_ap > r.evidence_ap > a.evidence_ap  # type: ignore[operator]
    assert o.evidence_dot == pytest.approx(1.0)
    assert a.evidence_dot == pytest.approx(0.0)
    assert o.evidence_dot > r.evidence_dot > a.evidence_dot  # type: ignore[operator]


def test_deletion_curve_matches_the_perturbation_module(
    trigger_setup: TriggerSetup, results: dict[str, MethodResult]
) -> None:
    # independent path: perturbation.deletion_curve per input, averaged
    model = trigger_setup.model
    evaluator = Evaluator(model)
    encoded = evaluator.encode(trigger_setup.examples)
    predicted = evaluator.predict(encoded).argmax(axis=1)
    curves = [
        deletion_curve(model, e, oracle(e, int(t)), int(t))
        for e, t in zip(encoded, predicted, strict=True)
    ]
    assert np.mean(curves, axis=0) == pytest.approx(results["oracle"].deletion_curve, abs=1e-5)


def test_times_are_recorded(results: dict[str, MethodResult]) -> None:
    for r in results.values():
        assert len(r.seconds) == 40 and all(s >= 0 for s in r.seconds)
