"""Every metric the README lists exists, with bounded labels, and the exposition passes
promtool."""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from limelight.drift import DriftMonitor
from limelight.metrics import Metrics
from limelight.settings import Settings

# name -> (type, label names): the README's Metrics section.
REQUIRED = {
    "limelight_request_duration_seconds": ("histogram", {"rpc", "code"}),
    "limelight_requests_in_flight": ("gauge", {"rpc"}),
    "limelight_item_errors": ("counter", {"rpc", "code"}),
    "limelight_inline_stage_duration_seconds": ("histogram", {"stage"}),
    "limelight_batch_size": ("histogram", set()),
    "limelight_batch_tokens": ("counter", {"kind"}),
    "limelight_batch_anticipation": ("counter", {"outcome"}),
    "limelight_job_queue_depth": ("gauge", {"method"}),
    "limelight_job_wait_seconds": ("histogram", {"method"}),
    "limelight_job_duration_seconds": ("histogram", {"method"}),
    "limelight_jobs": ("counter", {"method", "outcome"}),
    "limelight_predictions": ("counter", {"label"}),
    "limelight_prediction_confidence": ("histogram", set()),
    "limelight_model_info": ("gauge", {"name", "version", "architecture"}),
    "limelight_attribution_drift": ("gauge", {"label"}),
    "limelight_label_mix_drift": ("gauge", set()),
    "limelight_attribution_entropy": ("gauge", {"window"}),
    "limelight_drift_reference_state": ("gauge", {"state"}),
    "limelight_drift_window_explanations": ("gauge", set()),
    "limelight_inline_reloads": ("counter", {"outcome"}),
}
ALLOWED_LABELS = {"rpc", "code", "stage", "method", "outcome", "label", "window", "state", "kind"}


def populated_metrics() -> Metrics:
    m = Metrics(CollectorRegistry())
    for rpc, code in [("Explain", "OK"), ("SubmitJob", "RESOURCE_EXHAUSTED")]:
        m.request_duration.labels(rpc=rpc, code=code).observe(0.012)
    m.requests_in_flight.labels(rpc="Explain").set(3)
    m.item_errors.labels(rpc="ExplainStream", code="INVALID_ARGUMENT").inc()
    for stage in ("queue", "tokenize", "forward", "attribute"):
        m.stage_duration.labels(stage=stage).observe(0.001)
    m.batch_size.observe(8)
    m.batch_tokens.labels(kind="input").inc(100)
    m.batch_tokens.labels(kind="padded").inc(128)
    m.batch_anticipation.labels(outcome="hit").inc()
    m.inline_pending.set(2)
    m.predictions.labels(label="fresh").inc()
    m.confidence.observe(0.93)
    m.truncated.inc()
    m.model_info.info({"name": "demo", "version": "0123abcd", "architecture": "bert"})
    m.ready.set(1)
    m.inline_reloads.labels(outcome="reloaded").inc()
    m.job_queue_depth.labels(method="lrp").set(4)
    m.job_wait.labels(method="lrp").observe(1.5)
    m.job_duration.labels(method="lrp").observe(12.0)
    m.job_outcomes.labels(method="lrp", outcome="succeeded").inc()
    settings = Settings(
        drift_bootstrap_n=20, drift_window=20, drift_sketch_size=16, drift_min_count=1
    )
    monitor = DriftMonitor(settings, ["rotten", "fresh"], m)
    rng = random.Random(0)
    for i in range(60):
        tokens = rng.choices(["good", "bad", "film", "plot", "the"], k=6)
        monitor.observe(["rotten", "fresh"][i % 2], tokens, [rng.gauss(0.2, 1) for _ in tokens])
    monitor.report()
    return m


def test_required_metrics_exist_with_bounded_labels() -> None:
    text = generate_latest(populated_metrics().registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, labels) in REQUIRED.items():
        assert name in families, f"missing metric {name}"
        family = families[name]
        assert family.type == kind, (name, family.type)
        sample_labels = set().union(*(set(s.labels) for s in family.samples))
        sample_labels -= {"le", "quantile"}
        assert sample_labels == labels, (name, sample_labels)
    for family in families.values():
        assert family.name.startswith("limelight_")
        for sample in family.samples:
            extra = set(sample.labels) - ALLOWED_LABELS - {"le"}
            if family.name != "limelight_model_info":  # one constant series
                assert not extra, (family.name, extra)  # never a token or request id
    drift = families["limelight_drift_reference_state"]
    states = {s.labels["state"]: s.value for s in drift.samples}
    assert states == {"building": 0.0, "ready": 1.0, "disabled": 0.0}


def test_exposition_passes_promtool(tmp_path: object) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install Debian's prometheus package (make sysdeps)"
    exposition = generate_latest(populated_metrics().registry)
    result = subprocess.run(
        [promtool, "check", "metrics"], input=exposition, capture_output=True, check=False
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.strip() == b"", result.stdout.decode()


def test_promtool_catches_a_bad_metric() -> None:
    """The check above can fail: a counter without the _total suffix is reported."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found")
    bad = b"# HELP limelight_bad_requests Bad.\n# TYPE limelight_bad_requests counter\n"
    bad += b"limelight_bad_requests 1\n"
    result = subprocess.run(
        [promtool, "check", "metrics"], input=bad, capture_output=True, check=False
    )
    assert result.returncode != 0


def test_a_worker_registers_the_job_collectors_only() -> None:
    """``limelight worker`` exports what a job-running process does (tests/jobs/
    test_worker_metrics.py scrapes a real one); the sidecar's ``Metrics`` has all of it too."""
    from limelight.metrics import JobMetrics

    jobs = {"limelight_job_queue_up", "limelight_job_wait_seconds"}
    jobs |= {"limelight_job_duration_seconds", "limelight_jobs"}
    worker, sidecar = CollectorRegistry(), CollectorRegistry()
    metrics = JobMetrics(worker)
    Metrics(sidecar)
    assert {f.name for f in worker.collect()} == jobs
    assert jobs < {f.name for f in sidecar.collect()}
    metrics.job_queue_up.labels(backend="redis").set(0)
    metrics.job_wait.labels(method="lrp").observe(1.5)
    metrics.job_duration.labels(method="lrp").observe(12.0)
    metrics.job_outcomes.labels(method="lrp", outcome="succeeded").inc()
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install Debian's prometheus package (make sysdeps)"
    result = subprocess.run(
        [promtool, "check", "metrics"], input=metrics.exposition(), capture_output=True, check=False
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.strip() == b"", result.stdout.decode()


def test_label_mix_drift_is_nan_until_a_monitor_compares() -> None:
    """While the model loads, and for good with drift disabled, the label-mix gauge reads NaN:
    a 0 read as "no drift" on the dashboard's panel."""
    import math

    from limelight.app import build_drift

    metrics = Metrics(CollectorRegistry())

    def get(name: str, labels: dict[str, str] | None = None) -> float:
        value = metrics.registry.get_sample_value(name, labels)
        assert value is not None, name
        return value

    assert math.isnan(get("limelight_label_mix_drift"))
    settings = Settings(drift_enabled=False)
    assert build_drift(settings, None, metrics, "normxlogit") is None  # type: ignore[arg-type]
    assert math.isnan(get("limelight_label_mix_drift"))
    assert get("limelight_drift_reference_state", {"state": "disabled"}) == 1.0
