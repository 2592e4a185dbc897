"""Drift on the demo classifier with the attributions it serves (issue 6 acceptance).

Reference: ``limelight drift-reference build`` over Rotten Tomatoes validation reviews, with the
served default inline method (the demo's distilled head). Then a fresh window of the same
method's attributions of

- held-out Rotten Tomatoes test reviews (same distribution): drift stays below the threshold;
- the same reviews with " brilliant" appended: the "fresh" label alerts and names the word;
- drugsCom medication reviews (another domain): drift rises above the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from limelight.cli.main import main
from limelight.core.service import served_inline_method
from limelight.demo.datasets import drugscom, rotten_tomatoes
from limelight.drift import DriftMonitor, DriftReport, ReferenceFile
from limelight.drift.build import Observation, explain_texts
from limelight.methods.base import MethodRegistry
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.serving import torch_serving_runtime
from limelight.settings import Settings

N_REFERENCE = 500
N_WINDOW = 300
# Same-distribution windows of this size measured JSD 0.001-0.004 (docs/drift.md); one appended
# word of strong weight 0.03 (NormXLogit, which spreads a review's positive mass over ~20 tokens)
# to 0.12 (the distilled head). The default threshold, 0.02, separates the two.
THRESHOLD = 0.02
WORD = "brilliant"


@dataclass
class Scenario:
    model: LoadedModel
    method: str
    reference: Path
    held_out: list[Observation]
    with_word: list[Observation]
    other_domain: list[Observation]

    def report(self, observations: list[Observation]) -> DriftReport:
        settings = Settings(
            drift_reference=self.reference,
            drift_window=N_WINDOW,
            drift_alert_threshold=THRESHOLD,
            # a window of 300 holds 120-150 of a label (the default asks 150)
            drift_min_count=100,
        )
        monitor = DriftMonitor(
            settings,
            self.model.labels,
            None,
            model_version=self.model.version,
            method=self.method,
        )
        for obs in observations:
            monitor.observe(obs.label, obs.tokens, obs.scores)
        return monitor.report(top_k=10)


@pytest.fixture(
    scope="module", params=["bert-tiny", pytest.param("minilm", marks=pytest.mark.slow)]
)
def scenario(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    fixture = "bert_tiny_dir" if request.param == "bert-tiny" else "minilm_dir"
    model_dir: Path = request.getfixturevalue(fixture)
    reference = tmp_path_factory.mktemp("drift") / "reference.json"
    rc = main(
        [
            "drift-reference", "build", "--model", str(model_dir),
            "--data", "rotten_tomatoes:validation", "--n", str(N_REFERENCE),
            "--out", str(reference), "--no-progress", "--default-method", "auto",
        ]
    )  # fmt: skip
    assert rc == 0
    model = load_model(model_dir)
    runtime = torch_serving_runtime(model)
    method = served_inline_method(Settings(default_method="auto"), runtime, MethodRegistry.load())
    assert method.name == "distilled"  # the demo build makes a head; the server serves it
    assert ReferenceFile.load(reference).method == method.name

    def explain(texts: list[str]) -> list[Observation]:
        return explain_texts(model, texts, runtime=runtime, method=method)

    held_out = [e.text for e in rotten_tomatoes("test")[:N_WINDOW]]
    return Scenario(
        model=model,
        method=method.name,
        reference=reference,
        held_out=explain(held_out),
        with_word=explain([f"{t} {WORD}" for t in held_out]),
        other_domain=explain([e.text for e in drugscom("train")[:N_WINDOW]]),
    )


def test_same_distribution_stays_below_threshold(scenario: Scenario) -> None:
    report = scenario.report(scenario.held_out)
    assert report.reference_state == "ready"
    assert report.reference_count == N_REFERENCE
    assert report.window_count == N_WINDOW
    for d in report.labels:
        assert d.divergence < THRESHOLD and not d.alert, d
    assert report.label_mix_divergence < 0.02
    assert report.current_entropy == pytest.approx(report.reference_entropy, rel=0.1)


def test_appended_word_alerts_and_is_named(scenario: Scenario) -> None:
    baseline = scenario.report(scenario.held_out)
    report = scenario.report(scenario.with_word)
    fresh = next(d for d in report.labels if d.label == "fresh")
    assert fresh.alert and fresh.divergence > THRESHOLD
    assert WORD in [s.token for s in fresh.risers[:3]], fresh.risers
    riser = next(s for s in fresh.risers if s.token == WORD)
    assert riser.current_share > 10 * max(riser.reference_share, 0.001)
    before = next(d for d in baseline.labels if d.label == "fresh")
    assert fresh.divergence > 3 * before.divergence


def test_other_domain_drifts(scenario: Scenario) -> None:
    baseline = scenario.report(scenario.held_out)
    report = scenario.report(scenario.other_domain)
    assert max(d.divergence for d in report.labels) > THRESHOLD
    assert any(d.alert for d in report.labels)
    worst = max(report.labels, key=lambda d: d.divergence)
    before = next(d for d in baseline.labels if d.label == worst.label)
    assert worst.divergence > 3 * before.divergence
