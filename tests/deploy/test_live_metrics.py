"""The dashboard and the alerts against a live scrape of a real sidecar (no container)."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest

from limelight_client import Client
from tests.deploy.deploy_support import (
    OVERLAYS,
    dashboard,
    dashboard_exprs,
    exported_metric_names,
    kustomize_command,
    live_metric_names,
    promql_metric_names,
    render,
    rule_exprs,
    rule_groups,
)

# Series that exist after one successful inline Explain call on a fresh sidecar.
AFTER_ONE_EXPLAIN = {
    "limelight_request_duration_seconds_bucket",
    "limelight_request_duration_seconds_count",
    "limelight_requests_in_flight",
    "limelight_inline_stage_duration_seconds_bucket",
    "limelight_batch_size_sum",
    "limelight_batch_size_count",
    "limelight_inline_pending_requests",
    "limelight_predictions_total",
    "limelight_prediction_confidence_bucket",
    "limelight_ready",
    "limelight_model_info",
}


@pytest.mark.skipif(kustomize_command() is None, reason="needs kubectl or kustomize on PATH")
def test_live_exposition_serves_what_the_dashboard_and_alerts_query(sidecar: Any) -> None:
    with Client(sidecar.target, timeout=60) as client:
        client.explain("A gripping, beautifully shot film.")
    with urllib.request.urlopen(sidecar.metrics_url, timeout=30) as response:
        live = live_metric_names(response.read().decode())
    exported = exported_metric_names()
    objects = render(OVERLAYS["base"])
    queried = set().union(
        *(promql_metric_names(e) for e in dashboard_exprs(dashboard(objects))),
        *(promql_metric_names(e) for e in rule_exprs(rule_groups(objects))),
    )
    # Everything served is declared, so "declared" is a sound stand-in for series not yet born.
    assert {n for n in live if n.startswith("limelight_")} - exported == set()
    assert queried - exported == set()
    missing = (AFTER_ONE_EXPLAIN & queried) - live
    assert missing == set(), f"queried but not served after an Explain call: {sorted(missing)}"
    assert queried | {"limelight_requests_in_flight"} >= AFTER_ONE_EXPLAIN
