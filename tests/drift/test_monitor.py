"""DriftMonitor, JSD and reference files on synthetic attributions with known answers."""

from __future__ import annotations

import itertools
import json
import math
import random
import threading
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from scipy.spatial.distance import jensenshannon

from limelight.drift import DriftMonitor, ReferenceFile
from limelight.drift.profile import (
    Profile,
    compare,
    js_divergence,
    normalise_token,
    positive_shares,
)
from limelight.drift.reference import ServedIdentity
from limelight.drift.sketch import SpaceSaving
from limelight.errors import FailedPrecondition
from limelight.metrics import Metrics
from limelight.settings import Settings

LABELS = ["neg", "pos"]


def make_settings(**kw: object) -> Settings:
    base: dict[str, object] = {
        "drift_bootstrap_n": 200,
        "drift_window": 200,
        "drift_sketch_size": 64,
        "drift_alert_threshold": 0.1,
        # these windows are small on purpose: compare every label that has any explanation
        "drift_min_count": 1,
    }
    base.update(kw)
    return Settings(**base)  # type: ignore[arg-type]


VOCAB = [f"w{i}" for i in range(300)]
WEIGHTS = [1.0 / (i + 1) for i in range(len(VOCAB))]


def sample(rng: random.Random, extra: str | None = None) -> tuple[list[str], list[float]]:
    """A synthetic explanation: Zipf tokens with mixed-sign scores."""
    tokens = rng.choices(VOCAB, WEIGHTS, k=rng.randint(8, 30))
    scores = [rng.gauss(0.3, 1.0) for _ in tokens]
    if extra is not None:
        tokens.append(extra)
        scores.append(sum(max(s, 0.0) for s in scores))  # half of the positive mass
    return tokens, scores


def feed(monitor: DriftMonitor, n: int, seed: int, extra: str | None = None) -> None:
    rng = random.Random(seed)
    for i in range(n):
        tokens, scores = sample(rng, extra)
        monitor.observe(LABELS[i % 2], tokens, scores)


# --- JSD ------------------------------------------------------------------------------------------


def test_jsd_properties() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = rng.random(12) * (rng.random(12) > 0.3)
        q = rng.random(12) * (rng.random(12) > 0.3)
        if p.sum() == 0 or q.sum() == 0:
            continue
        d = js_divergence(p, q)
        assert 0.0 <= d <= 1.0
        assert d == pytest.approx(js_divergence(q, p), abs=1e-12)
        # scipy returns the JS *distance* (square root of the divergence).
        assert d == pytest.approx(jensenshannon(p, q, base=2) ** 2, abs=1e-9)
        assert js_divergence(p, p) == pytest.approx(0.0, abs=1e-12)
    assert js_divergence([1, 0, 0], [0, 2, 3]) == pytest.approx(1.0)
    assert js_divergence([1, 1], [1, 1]) == 0.0
    # no data on one side: nothing to compare, not a 0 that reads as "no drift"
    assert math.isnan(js_divergence([0, 0], [1, 1]))


def test_compare_identical_and_disjoint_sketches() -> None:
    a, b, c = SpaceSaving(16), SpaceSaving(16), SpaceSaving(16)
    for token, w in [("x", 3.0), ("y", 1.0)]:
        a.add(token, w)
        b.add(token, 2 * w)  # same shares, twice the mass
    for token, w in [("u", 1.0), ("v", 1.0)]:
        c.add(token, w)
    assert compare(a, b).divergence == pytest.approx(0.0, abs=1e-12)
    assert compare(a, c).divergence == pytest.approx(1.0)
    assert compare(c, a).divergence == pytest.approx(1.0)
    shares = {s.token: (s.reference_share, s.current_share) for s in compare(a, c).shifts}
    assert shares["x"] == (0.75, 0.0) and shares["u"] == (0.0, 0.5)


def test_positive_shares_and_entropy() -> None:
    shares, entropy = positive_shares(["The", "film", "the", "[x]"], [1.0, 2.0, 1.0, -5.0])
    assert shares == {"the": 0.5, "film": 0.5}
    assert entropy == pytest.approx(1.5)  # positions: 1/4, 1/2, 1/4
    assert positive_shares(["a"], [-1.0]) == ({}, None)
    assert normalise_token("\u0120Great") == "great"
    assert normalise_token("\u2581Film") == "film"
    assert normalise_token("##ING") == "##ing"


# --- the monitor ----------------------------------------------------------------------------------


def test_bootstrap_reference_then_low_drift_on_same_distribution() -> None:
    metrics = Metrics(CollectorRegistry())
    monitor = DriftMonitor(make_settings(), LABELS, metrics)
    feed(monitor, 150, seed=1)
    report = monitor.report()
    assert report.reference_state == "building" and report.reference_count == 150
    assert (
        metrics.registry.get_sample_value("limelight_drift_reference_state", {"state": "building"})
        == 1.0
    )
    feed(monitor, 50, seed=2)
    assert monitor.state == "ready"
    feed(monitor, 200, seed=3)
    report = monitor.report()
    assert report.reference_state == "ready"
    assert report.reference_count == 200
    assert 180 <= report.window_count <= 200
    for d in report.labels:
        assert d.divergence < 0.05, d
        assert not d.alert
    assert report.label_mix_divergence == pytest.approx(0.0, abs=1e-3)
    assert report.current_entropy == pytest.approx(report.reference_entropy, rel=0.05)
    get = metrics.registry.get_sample_value
    assert get("limelight_drift_reference_state", {"state": "ready"}) == 1.0
    assert get("limelight_attribution_drift", {"label": "pos"}) == pytest.approx(
        report.labels[1].divergence
    )
    assert get("limelight_drift_window_explanations") == report.window_count


def test_new_heavy_token_alerts_and_is_named() -> None:
    monitor = DriftMonitor(make_settings(), LABELS, None)
    feed(monitor, 200, seed=1)
    rng = random.Random(9)
    for _ in range(200):  # only "pos" explanations gain the word
        tokens, scores = sample(rng, "Brilliant")
        monitor.observe("pos", tokens, scores)
        tokens, scores = sample(rng)
        monitor.observe("neg", tokens, scores)
    report = monitor.report(top_k=3)
    pos, neg = report.labels[1], report.labels[0]
    assert pos.alert and pos.divergence > 0.1
    assert pos.risers[0].token == "brilliant"
    assert pos.risers[0].current_share == pytest.approx(0.5, abs=0.05)
    assert pos.risers[0].reference_share == pytest.approx(0.0, abs=0.01)
    assert len(pos.risers) <= 3 and pos.fallers
    assert not neg.alert and neg.divergence < 0.05


def test_label_mix_and_entropy_match_direct_computation() -> None:
    monitor = DriftMonitor(make_settings(drift_bootstrap_n=4, drift_window=10), LABELS, None)
    for label in ["neg", "pos", "pos", "pos"]:
        monitor.observe(label, ["a", "b"], [1.0, 1.0])  # entropy 1 bit
    for label in ["neg", "neg", "pos"]:
        monitor.observe(label, ["a", "b", "c", "d"], [1.0, 1.0, 1.0, 1.0])  # 2 bits
    report = monitor.report()
    assert report.label_mix_divergence == pytest.approx(js_divergence([1, 3], [2, 1]))
    assert report.reference_entropy == pytest.approx(1.0)
    assert report.current_entropy == pytest.approx(2.0)


def test_disabled_monitor_ignores_everything() -> None:
    metrics = Metrics(CollectorRegistry())
    monitor = DriftMonitor(make_settings(drift_enabled=False), LABELS, metrics)
    feed(monitor, 10, seed=0)
    report = monitor.report()
    assert report.reference_state == "disabled" and report.reference_count == 0
    get = metrics.registry.get_sample_value
    assert get("limelight_drift_reference_state", {"state": "disabled"}) == 1.0


def test_sampling_at_rate_one_observes_every_explanation() -> None:
    monitor = DriftMonitor(make_settings(), LABELS, None)
    assert all(monitor.sampled() for _ in range(1000))
    disabled = DriftMonitor(make_settings(drift_enabled=False), LABELS, None)
    assert not any(disabled.sampled() for _ in range(100))


@pytest.mark.parametrize("rate", [0.5, 0.1, 0.013])
def test_sampling_is_a_coin_per_call(rate: float) -> None:
    """The skips drawn per observed call behave as an independent coin per call: the share
    observed and the share observed right after an observed call are both ``rate`` (each
    within 5 binomial standard errors, a fixed seed)."""
    metrics = Metrics(CollectorRegistry())
    monitor = DriftMonitor(
        make_settings(drift_sample_rate=rate), LABELS, metrics, rng=random.Random(7)
    )
    n = 200_000
    calls = [monitor.sampled() for _ in range(n)]
    observed = sum(calls)
    assert abs(observed / n - rate) <= 5 * math.sqrt(rate * (1 - rate) / n)
    after = [b for a, b in itertools.pairwise(calls) if a]
    assert abs(sum(after) / len(after) - rate) <= 5 * math.sqrt(rate * (1 - rate) / len(after))
    # Operators see the rate; reports carry it (the counts are observed explanations).
    assert metrics.registry.get_sample_value("limelight_drift_sample_rate") == rate
    assert monitor.report().sample_rate == rate


@pytest.mark.parametrize("rate", [0.0, -0.5, 1.5])
def test_sample_rate_outside_zero_to_one_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="drift_sample_rate"):
        make_settings(drift_sample_rate=rate)


def test_unknown_label_is_ignored_and_length_mismatch_raises() -> None:
    monitor = DriftMonitor(make_settings(), LABELS, None)
    monitor.observe("other", ["a"], [1.0])
    assert monitor.report().reference_count == 0
    with pytest.raises(ValueError):
        monitor.observe("pos", ["a", "b"], [1.0])


def test_memory_stays_bounded_with_unbounded_vocabulary() -> None:
    s = make_settings(drift_bootstrap_n=50, drift_window=100, drift_sketch_size=32)
    monitor = DriftMonitor(s, LABELS, None)
    for i in range(3000):
        monitor.observe(LABELS[i % 2], [f"u{i}-{j}" for j in range(20)], [1.0] * 20)
    ref_entries = sum(len(x) for x in monitor._reference.sketches.values())
    window_entries = sum(len(sk) for part in monitor._ring.parts() for sk in part.sketches.values())
    assert ref_entries <= 2 * 4 * 32
    assert window_entries <= 2 * 10 * 32
    assert monitor.report().window_count <= 100


def test_concurrent_observe_and_report() -> None:
    monitor = DriftMonitor(make_settings(drift_bootstrap_n=100, drift_window=10_000), LABELS, None)
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        try:
            feed(monitor, 500, seed)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for _ in range(20):
        monitor.report()
    for t in threads:
        t.join()
    assert not errors
    report = monitor.report()
    assert report.reference_count + report.window_count == 4 * 500


def test_a_report_in_progress_does_not_hold_up_observe(monkeypatch: pytest.MonkeyPatch) -> None:
    """A report merges and compares outside the lock that ``observe`` takes: with the
    comparison held open in another thread, explanations are still counted (a report computed
    under the lock would deadlock here; the joins' timeouts only turn that into a failure)."""
    import limelight.drift.monitor as monitor_module

    monitor = DriftMonitor(make_settings(drift_bootstrap_n=20, drift_window=100), LABELS, None)
    feed(monitor, 60, seed=1)
    inside, release = threading.Event(), threading.Event()
    real_compare = monitor_module.compare

    def held_compare(*args: object, **kw: object) -> object:
        inside.set()
        release.wait(30)
        return real_compare(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(monitor_module, "compare", held_compare)
    reports: list[object] = []
    reporter = threading.Thread(target=lambda: reports.append(monitor.report()))
    reporter.start()
    assert inside.wait(30)
    observer = threading.Thread(target=feed, args=(monitor, 30, 2))
    observer.start()
    observer.join(30)
    observed_while_held = not observer.is_alive()
    release.set()
    reporter.join(30)
    observer.join(30)
    assert observed_while_held
    # The held report is of the window as it was when it began.
    assert reports and reports[0].window_count == 40  # type: ignore[attr-defined]
    assert monitor.report().window_count == 70


def test_the_periodic_gauge_refresh_runs_off_the_observing_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The explanation that fills a sub-window does not pay for the full report behind the
    gauges: it runs in a thread of its own, and the gauges still follow the window."""
    import limelight.drift.monitor as monitor_module

    threads: set[str] = set()
    real_compare = monitor_module.compare

    def recording_compare(*args: object, **kw: object) -> object:
        threads.add(threading.current_thread().name)
        return real_compare(*args, **kw)  # type: ignore[arg-type]

    metrics = Metrics(CollectorRegistry())
    monitor = DriftMonitor(
        make_settings(drift_bootstrap_n=20, drift_window=100), LABELS, metrics,
        gauge_interval_s=0.0,
    )  # fmt: skip
    feed(monitor, 20, seed=3)  # the reference is ready: refreshed at once, on this thread
    get = metrics.registry.get_sample_value
    assert get("limelight_drift_reference_state", {"state": "ready"}) == 1.0
    monkeypatch.setattr(monitor_module, "compare", recording_compare)
    feed(monitor, 10, seed=4)  # fills the first sub-window (10 of them in 100)
    for _ in range(3000):
        if get("limelight_drift_window_explanations") == 10.0 and not monitor._refreshing:
            break
        threading.Event().wait(0.01)
    assert get("limelight_drift_window_explanations") == 10.0
    assert threads == {"drift-gauges"}


def test_profile_copy_is_independent() -> None:
    profile = Profile(LABELS, 8)
    profile.add("pos", {"good": 0.75, "film": 0.25}, 0.8)
    copy, counters = profile.copy(), profile.copy(with_sketches=False)
    profile.add("pos", {"good": 1.0}, 0.0)
    assert copy.count == 1 and copy.sketches["pos"].counts == {"good": 0.75, "film": 0.25}
    assert counters.count == 1 and counters.mean_entropy == 0.8
    assert len(counters.sketches["pos"]) == 0


# --- reference files ------------------------------------------------------------------------------


def test_reference_file_round_trip_gives_the_same_report(tmp_path: Path) -> None:
    settings = make_settings()
    boot = DriftMonitor(settings, LABELS, None)
    feed(boot, 200, seed=1)
    path = tmp_path / "ref.json"
    ReferenceFile(profile=boot._reference, labels=LABELS, model_name="m", model_version="abc").save(
        path
    )
    loaded = DriftMonitor(make_settings(drift_reference=path), LABELS, None, model_version="abc")
    assert loaded.state == "ready"
    feed(boot, 150, seed=5, extra="new")
    feed(loaded, 150, seed=5, extra="new")
    a, b = boot.report(), loaded.report()
    assert a.reference_count == b.reference_count == 200
    for x, y in zip(a.labels, b.labels, strict=True):
        assert x.divergence == pytest.approx(y.divergence, abs=1e-12)
        assert x.risers == y.risers


def test_reference_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="does not exist"):
        DriftMonitor(make_settings(drift_reference=tmp_path / "none.json"), LABELS, None)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(FailedPrecondition, match="not a Limelight drift reference"):
        DriftMonitor(make_settings(drift_reference=bad), LABELS, None)
    other = tmp_path / "other.json"
    ReferenceFile(profile=Profile(["a", "b", "c"], 8), labels=["a", "b", "c"]).save(other)
    with pytest.raises(FailedPrecondition, match="labels"):
        DriftMonitor(make_settings(drift_reference=other), LABELS, None)


def test_a_reference_of_another_method_is_refused(tmp_path: Path) -> None:
    """Methods spread attribution mass differently: a reference of one cannot judge another."""
    path = tmp_path / "ref.json"
    ReferenceFile(profile=Profile(LABELS, 8), labels=LABELS, method="normxlogit").save(path)
    settings = make_settings(drift_reference=path)
    with pytest.raises(FailedPrecondition) as refused:
        DriftMonitor(settings, LABELS, None, method="distilled")
    message = refused.value.message
    assert "normxlogit" in message and "distilled" in message
    assert "limelight drift-reference build" in message
    assert DriftMonitor(settings, LABELS, None, method="normxlogit").state == "ready"
    assert DriftMonitor(settings, LABELS, None).state == "ready"  # method unknown: not checked


def test_gauges_are_nan_until_comparable() -> None:
    metrics = Metrics(CollectorRegistry())
    DriftMonitor(make_settings(), LABELS, metrics)
    value = metrics.registry.get_sample_value("limelight_attribution_drift", {"label": "pos"})
    assert value is not None and math.isnan(value)


def test_a_label_the_reference_never_saw_is_not_compared_not_calm() -> None:
    # A reference of "neg" answers only: traffic predicted "pos" has nothing to be compared
    # with. It read JSD 0 and "ok" (and 0 on the gauge), which says "no drift".
    metrics = Metrics(CollectorRegistry())
    monitor = DriftMonitor(make_settings(drift_bootstrap_n=50), LABELS, metrics)
    rng = random.Random(0)
    for _ in range(50):
        monitor.observe("neg", *sample(rng))
    assert monitor.state == "ready"
    for _ in range(120):
        monitor.observe("pos", *sample(rng))
    report = monitor.report()
    pos = next(d for d in report.labels if d.label == "pos")
    assert math.isnan(pos.divergence) and not pos.alert and pos.window_count == 120
    monitor.refresh_gauges()
    gauge = metrics.registry.get_sample_value("limelight_attribution_drift", {"label": "pos"})
    assert gauge is not None and math.isnan(gauge)
    # The label mix did change, all the way.
    assert report.label_mix_divergence == pytest.approx(1.0)


def test_the_reference_count_on_metrics_follows_the_build() -> None:
    # Only GetDrift moved the gauge while the reference built: /metrics said 0 explanations
    # for as long as nobody asked.
    from tests.waiting import wait_until

    metrics = Metrics(CollectorRegistry())
    monitor = DriftMonitor(make_settings(), LABELS, metrics, gauge_interval_s=0.0)
    rng = random.Random(0)
    get = metrics.registry.get_sample_value

    def observed_so_far() -> bool:
        monitor.observe("neg", *sample(rng))
        return (get("limelight_drift_reference_explanations") or 0) >= 10

    wait_until(observed_so_far)
    assert monitor.state == "building"


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("label_counts", -3),
        ("count", -1),
        ("entropy_sum", "nan"),
        ("sketch_total", "inf"),
        ("sketch_count", -2.0),
    ],
)
def test_a_reference_with_impossible_numbers_is_refused_at_start(
    tmp_path: Path, where: str, value: object
) -> None:
    """A hand-edited or corrupted reference is refused when it is loaded, naming the file —
    not later, as an unnamed error from the divergence every gauge refresh computes."""
    boot = DriftMonitor(make_settings(), LABELS, None)
    feed(boot, 50, seed=1)
    path = tmp_path / "ref.json"
    ReferenceFile(profile=boot._reference, labels=LABELS).save(path)
    data = json.loads(path.read_text())
    profile = data["profile"]
    sketch = profile["sketches"][LABELS[0]]
    if where == "label_counts":
        profile["label_counts"][LABELS[0]] = value
    elif where == "sketch_total":
        sketch["total"] = value
    elif where == "sketch_count":
        sketch["tokens"][0][1] = value
    else:
        profile[where] = value
    path.write_text(json.dumps(data))
    with pytest.raises(FailedPrecondition, match="is malformed") as refused:
        DriftMonitor(make_settings(drift_reference=path), LABELS, None)
    assert str(path) in refused.value.message


# --- how many explanations a comparison needs ----------------------------------------------------


def test_a_label_with_too_few_explanations_is_not_compared_until_it_has_enough() -> None:
    """Shortly after a start (or for a rare label) a window holds a few explanations of a
    label: their divergence from the reference is mostly sampling noise and raised the alert on
    unchanged traffic. Below ``drift_min_count`` on either side a label reads NaN, no alert."""
    metrics = Metrics(CollectorRegistry())
    settings = make_settings(drift_bootstrap_n=200, drift_window=400, drift_min_count=40)
    monitor = DriftMonitor(settings, LABELS, metrics, gauge_interval_s=0.0)
    feed(monitor, 200, seed=1)  # the reference: 100 of each label
    rng = random.Random(2)
    for _ in range(39):  # a word the reference never saw, on every "pos" answer
        monitor.observe("pos", *sample(rng, "brilliant"))
    early = monitor.report()
    pos = early.labels[1]
    assert early.min_count == 40 and pos.reference_count == 100 and pos.window_count == 39
    assert math.isnan(pos.divergence) and not pos.alert
    assert math.isnan(early.label_mix_divergence)  # 39 answers: too few for a mix either
    gauge = metrics.registry.get_sample_value("limelight_attribution_drift", {"label": "pos"})
    assert gauge is not None and math.isnan(gauge)
    monitor.observe("pos", *sample(rng, "brilliant"))  # the 40th
    pos = monitor.report().labels[1]
    assert pos.window_count == 40 and pos.alert and pos.divergence > 0.1
    assert pos.risers[0].token == "brilliant"


def test_a_label_with_few_explanations_in_the_reference_is_not_compared(tmp_path: Path) -> None:
    reference = Profile(LABELS, 64)
    rng = random.Random(3)
    for i in range(60):  # 55 "neg", 5 "pos"
        tokens, scores = sample(rng)
        reference.add("neg" if i % 12 else "pos", *positive_shares(tokens, scores))
    path = tmp_path / "ref.json"
    ReferenceFile(profile=reference, labels=LABELS).save(path)
    monitor = DriftMonitor(make_settings(drift_reference=path, drift_min_count=50), LABELS, None)
    feed(monitor, 200, seed=4)
    neg, pos = monitor.report().labels
    assert pos.reference_count == 5 and pos.window_count == 100
    assert math.isnan(pos.divergence) and not pos.alert
    assert neg.reference_count == 55 and math.isfinite(neg.divergence)


def test_the_gauges_show_the_end_of_a_burst_without_a_later_request() -> None:
    """A refresh that falls due too soon after the last one runs when the interval is up:
    without it (and without the viewer's sampler) the gauges kept the window of the burst's
    start until the next request, so an alert could neither fire nor resolve."""
    metrics = Metrics(CollectorRegistry())
    settings = make_settings(drift_bootstrap_n=20, drift_window=100)
    monitor = DriftMonitor(settings, LABELS, metrics, gauge_interval_s=0.2)
    feed(monitor, 20, seed=1)  # ready: refreshed at once
    feed(monitor, 100, seed=2)  # ten sub-windows fill within the interval
    get = metrics.registry.get_sample_value
    for _ in range(3000):  # no request after the burst: only a timer can refresh
        if get("limelight_drift_window_explanations") == 100.0:
            break
        threading.Event().wait(0.01)
    assert get("limelight_drift_window_explanations") == 100.0


def test_the_gauges_show_a_burst_that_ends_part_way_through_a_sub_window() -> None:
    """The last answers of a burst reach /metrics though they fill no sub-window: refreshing
    only when one filled left them off (5 of 15 here) until more traffic came."""
    metrics = Metrics(CollectorRegistry())
    settings = make_settings(drift_bootstrap_n=20, drift_window=100)  # sub-windows of 10
    monitor = DriftMonitor(settings, LABELS, metrics, gauge_interval_s=0.2)
    feed(monitor, 20, seed=1)  # ready: refreshed at once
    get = metrics.registry.get_sample_value

    def shown_soon(count: float) -> bool:
        for _ in range(3000):  # no request after the burst: only a timer can refresh
            if get("limelight_drift_window_explanations") == count and not monitor._refreshing:
                return True
            threading.Event().wait(0.01)
        return False

    feed(monitor, 10, seed=2)  # fills the first sub-window
    assert shown_soon(10.0)
    feed(monitor, 5, seed=3)  # the burst's tail, after that refresh
    assert shown_soon(15.0)


def test_an_empty_window_exports_no_mix_or_entropy_of_its_own(tmp_path: Path) -> None:
    boot = DriftMonitor(make_settings(), LABELS, None)
    feed(boot, 200, seed=1)
    path = tmp_path / "ref.json"
    ReferenceFile(profile=boot._reference, labels=LABELS).save(path)
    metrics = Metrics(CollectorRegistry())
    DriftMonitor(make_settings(drift_reference=path), LABELS, metrics)
    get = metrics.registry.get_sample_value
    for value in (
        get("limelight_label_mix_drift"),
        get("limelight_attribution_entropy", {"window": "current"}),
    ):
        assert value is not None and math.isnan(value)  # was 0.0: "no drift", "no entropy"


def test_a_sample_rate_too_small_to_draw_a_gap_skips_instead_of_crashing() -> None:
    monitor = DriftMonitor(make_settings(drift_sample_rate=1e-320), LABELS, None)
    assert not monitor.sampled()


# --- what a reference file was built from ---------------------------------------------------------


def _identity(**kw: object) -> ServedIdentity:
    base: dict[str, object] = {
        "model_version": "m1",
        "explainer_digest": "head-a",
        "thresholds": None,
        "max_tokens": 512,
    }
    base.update(kw)
    return ServedIdentity(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("served", "named"),
    [
        (_identity(), None),
        (_identity(model_version="m2"), "model version m1 (serving m2)"),
        (_identity(explainer_digest="head-b"), "other distilled files"),
        (_identity(max_tokens=64), "max_tokens 512 (serving 64)"),
        (_identity(thresholds=(0.3, 0.5)), "label thresholds None (serving (0.3, 0.5))"),
    ],
)
def test_a_reference_built_from_something_else_is_set_aside_for_the_first_requests(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, served: ServedIdentity, named: str | None
) -> None:
    """A reference of another head (a hot reload swapped it), another model, other thresholds
    or another token limit holds attributions this sidecar would not compute on the same
    traffic: it is set aside with a warning and the first requests build the reference."""
    boot = DriftMonitor(make_settings(), LABELS, None)
    feed(boot, 200, seed=1)
    path = tmp_path / "ref.json"
    ReferenceFile(
        profile=boot._reference,
        labels=LABELS,
        model_version="m1",
        method="distilled",
        served=_identity(),
    ).save(path)
    assert ReferenceFile.load(path).served == _identity(model_version="")
    monitor = DriftMonitor(
        make_settings(drift_reference=path),
        LABELS,
        None,
        model_version=served.model_version,
        method="distilled",
        served=served,
    )
    if named is None:
        assert monitor.state == "ready" and "set aside" not in caplog.text
    else:
        assert monitor.state == "building" and monitor.report().reference_count == 0
        assert named in caplog.text and "set aside" in caplog.text


def test_an_older_reference_file_of_a_head_is_set_aside_but_one_of_normxlogit_is_kept(
    tmp_path: Path,
) -> None:
    """A file written before references recorded their head cannot say which head it holds."""
    path = tmp_path / "ref.json"
    ReferenceFile(profile=Profile(LABELS, 8), labels=LABELS, method="distilled").save(path)
    settings = make_settings(drift_reference=path)
    head = _identity(model_version="")
    assert DriftMonitor(settings, LABELS, None, method="distilled", served=head).state == (
        "building"
    )
    ReferenceFile(profile=Profile(LABELS, 8), labels=LABELS, method="normxlogit").save(path)
    plain = _identity(model_version="", explainer_digest="")
    assert DriftMonitor(settings, LABELS, None, method="normxlogit", served=plain).state == (
        "ready"
    )
