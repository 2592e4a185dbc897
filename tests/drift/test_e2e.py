"""Drift through a real sidecar: Explain traffic, GetDrift via the CLI, the metrics endpoint."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from limelight.cli.main import main
from limelight.demo.datasets import rotten_tomatoes
from limelight_client import Client


def test_drift_cli_against_a_served_model(
    start_sidecar: Callable[..., Any],
    bert_tiny_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    running = start_sidecar(
        model_dir=bert_tiny_dir, drift_bootstrap_n=20, drift_window=30, drift_min_count=1
    )
    texts = [e.text for e in rotten_tomatoes("test")[:50]]
    with Client(running.target, timeout=60) as client:
        building = client.drift(top_k=5)
        assert building.reference_state == "building" and building.reference_target == 20
        # Nothing is compared while the reference builds: not a divergence of 0 ("no drift").
        assert building.labels and all(math.isnan(d.divergence) for d in building.labels)
        assert math.isnan(building.label_mix_divergence) and math.isnan(building.current_entropy)
        for text in texts[:20]:
            client.explain(text)
        for text in texts[20:50]:
            client.explain(text + " brilliant brilliant brilliant")
        report = client.drift(top_k=5)
    assert report.reference_state == "ready"
    assert report.reference_count == 20 and report.reference_target == 0
    assert report.window_count == 30
    assert sum(d.window_count for d in report.labels) == 30

    plot = tmp_path / "drift.png"
    rc = main(["drift", "--target", running.target, "--top-k", "5", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("reference: ready (20 explanations)   window: 30 explanations")
    for d in report.labels:
        assert any(line.startswith(f"{d.label} ") for line in out.splitlines())
    assert plot.read_bytes()[:4] == b"\x89PNG"

    # --json for scripts: stdout holds the report alone, the same as the SDK's
    assert main(["drift", "--target", running.target, "--top-k", "5", "--json"]) == 0
    scripted = json.loads(capsys.readouterr().out)
    assert scripted["reference_state"] == "ready" and scripted["window_count"] == 30
    assert [d["label"] for d in scripted["labels"]] == [d.label for d in report.labels]
    assert [d["window_count"] for d in scripted["labels"]] == [
        d.window_count for d in report.labels
    ]

    # The same numbers on the Prometheus endpoint, which passes promtool.
    with urllib.request.urlopen(running.metrics_url, timeout=10) as response:
        exposition = response.read()
    text = exposition.decode()
    assert 'limelight_drift_reference_state{state="ready"} 1.0' in text
    assert "limelight_drift_window_explanations 30.0" in text
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install Debian's prometheus package (make sysdeps)"
    check = subprocess.run(
        [promtool, "check", "metrics"], input=exposition, capture_output=True, check=False
    )
    assert check.returncode == 0, check.stderr.decode()


def test_a_sampling_sidecar_observes_a_share_of_its_answers(
    start_sidecar: Callable[..., Any],
    bert_tiny_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """At LIMELIGHT_DRIFT_SAMPLE_RATE 0.5 about half the answers reach the monitor (the
    reference still building, its count is every observed one): 200 answers observe
    Binomial(200, 0.5), inside 7 standard errors of 100 — never all 200, never none."""
    running = start_sidecar(
        model_dir=bert_tiny_dir, drift_bootstrap_n=10_000, drift_sample_rate=0.5
    )
    texts = [e.text for e in rotten_tomatoes("test")[:200]]
    with Client(running.target, timeout=60) as client:
        for text in texts:
            client.explain(text)
        report = client.drift(top_k=5)
    assert report.reference_state == "building"
    assert report.sample_rate == 0.5
    assert abs(report.reference_count - 100) <= 7 * (200 * 0.25) ** 0.5

    assert main(["drift", "--target", running.target]) == 0
    assert "observing 50% of requests" in capsys.readouterr().out.splitlines()[0]
    with urllib.request.urlopen(running.metrics_url, timeout=10) as response:
        text = response.read().decode()
    assert "limelight_drift_sample_rate 0.5" in text
