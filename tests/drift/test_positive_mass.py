"""Explanations without positive attribution mass, and references without entropy.

Only positive scores make up a label's token distribution. A label whose window held only
explanations with no positive score (its evidence flipped negative, the most extreme drift)
was compared as two distributions of which one is empty: JSD 0.0000, "ok". And a reference
with no explanation yet exported a mean entropy of 0 bits, which reads as a measurement."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from limelight.cli.drift import format_report
from limelight.drift import DriftMonitor, ReferenceFile
from limelight.drift.profile import Profile, compare, positive_shares
from limelight.drift.sketch import SpaceSaving
from limelight.metrics import Metrics
from limelight.settings import Settings

LABELS = ["neg", "pos"]


def words(rng: random.Random) -> list[str]:
    return [f"w{rng.randrange(30)}" for _ in range(10)]


def positive(rng: random.Random) -> list[float]:
    return [rng.random() for _ in range(10)]


def negative(rng: random.Random) -> list[float]:
    return [-rng.random() for _ in range(10)]


def monitor_after(pos_window: str, metrics: Metrics | None = None) -> DriftMonitor:
    """A reference of 200 + 200 ordinary explanations, then a window of 200 + 200 in which
    "pos" explanations carry: ``all`` positive mass, ``none`` (every score negative) or
    ``half`` (every other one none)."""
    settings = Settings(drift_bootstrap_n=400, drift_window=400, drift_min_count=150)
    monitor = DriftMonitor(settings, LABELS, metrics)
    rng = random.Random(0)
    for i in range(400):
        monitor.observe(LABELS[i % 2], words(rng), positive(rng))
    for i in range(400):
        if i % 2 == 0:
            scores = positive(rng)
        elif pos_window == "none" or (pos_window == "half" and i % 4 == 1):
            scores = negative(rng)
        else:
            scores = positive(rng)
        monitor.observe(LABELS[i % 2], words(rng), scores)
    return monitor


def test_a_label_whose_window_has_no_positive_mass_is_not_compared_not_calm() -> None:
    metrics = Metrics(CollectorRegistry())
    report = monitor_after("none", metrics).report()
    neg, pos = report.labels
    assert math.isfinite(neg.divergence) and not neg.alert
    # was 0.0 and "ok": no drift read off a window that has nothing to compare
    assert math.isnan(pos.divergence) and not pos.alert
    assert pos.window_count == 200 and pos.reference_count == 200  # all predicted as it
    gauge = metrics.registry.get_sample_value("limelight_attribution_drift", {"label": "pos"})
    assert gauge is not None and math.isnan(gauge)
    text = format_report(report)
    row = next(line for line in text.splitlines() if line.startswith("pos "))
    assert row.split() == ["pos", "-", "-", "200"]
    assert (
        "not compared: pos (fewer than 150 of its explanations in the window or in the "
        "reference carry any positive attribution mass" in text
    )
    assert "not compared yet" not in text  # it has its 200: waiting does not help


def test_explanations_without_positive_mass_do_not_count_towards_min_count() -> None:
    # 100 of the window's 200 "pos" explanations have positive mass: fewer than 150 make up
    # its distribution, so it is not compared (it was, on 200 counted).
    neg, pos = monitor_after("half").report().labels
    assert math.isfinite(neg.divergence)
    assert math.isnan(pos.divergence) and pos.window_count == 200
    # with all of them positive, the same window is compared
    assert math.isfinite(monitor_after("all").report().labels[1].divergence)


def test_a_side_without_positive_mass_compares_as_undefined() -> None:
    full, empty = SpaceSaving(8), SpaceSaving(8)
    full.add("film", 1.0)
    for a, b in ((full, empty), (empty, full), (empty, empty)):
        cmp = compare(a, b)
        assert math.isnan(cmp.divergence) and cmp.shifts == []


def test_positive_counts_survive_a_reference_file_and_older_files_still_load(
    tmp_path: Path,
) -> None:
    rng = random.Random(1)
    profile = Profile(LABELS, 32)
    for i in range(40):
        scores = negative(rng) if i % 4 == 3 else positive(rng)  # 10 of "pos" have none
        profile.add(LABELS[i % 2], *positive_shares(words(rng), scores))
    assert profile.label_counts == {"neg": 20, "pos": 20}
    assert profile.positive_counts == {"neg": 20, "pos": 10}
    path = tmp_path / "ref.json"
    ReferenceFile(profile=profile, labels=LABELS).save(path)
    assert ReferenceFile.load(path).profile.positive_counts == {"neg": 20, "pos": 10}
    merged = Profile.merge([profile, profile.copy()])
    assert merged.positive_counts == {"neg": 40, "pos": 20}
    # A file written before they were counted: each label's count, or 0 without any mass.
    data = json.loads(path.read_text())
    del data["profile"]["positive_counts"]
    data["profile"]["sketches"]["pos"] = SpaceSaving(32).to_json()
    path.write_text(json.dumps(data))
    assert ReferenceFile.load(path).profile.positive_counts == {"neg": 20, "pos": 0}
    # more with mass than explanations: refused
    data = json.loads(path.read_text())
    data["profile"]["positive_counts"] = {"neg": 21, "pos": 0}
    path.write_text(json.dumps(data))
    with pytest.raises(Exception, match="positive_counts"):
        ReferenceFile.load(path)


def test_an_empty_reference_has_no_mean_entropy() -> None:
    """NaN on the gauge and "-" in `limelight drift`: 0 bits is a measurement (all the mass
    on one token), not "nothing yet"."""
    metrics = Metrics(CollectorRegistry())
    settings = Settings(drift_bootstrap_n=10, drift_window=100, drift_min_count=1)
    monitor = DriftMonitor(settings, LABELS, metrics)
    get = metrics.registry.get_sample_value
    for _ in range(2):  # nothing observed; then one explanation without positive mass
        report = monitor.report()
        assert math.isnan(report.reference_entropy)
        gauge = get("limelight_attribution_entropy", {"window": "reference"})
        assert gauge is not None and math.isnan(gauge)
        line = format_report(report).splitlines()[1]
        assert line.endswith("attribution entropy - -> - bits"), line
        monitor.observe("pos", ["dull"], [-1.0])
    monitor.observe("pos", ["fine", "film"], [1.0, 1.0])
    report = monitor.report()
    assert report.reference_entropy == pytest.approx(1.0)
    assert format_report(report).splitlines()[1].endswith("attribution entropy 1.00 -> - bits")
