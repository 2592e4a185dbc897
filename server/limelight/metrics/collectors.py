"""Prometheus collectors of Limelight, registered on an injected CollectorRegistry.

Naming: prefix ``limelight_``, base units (seconds, bytes), ``_total`` for counters. Label values
are bounded: RPC names, status codes, method names, model labels; never a token or request id.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    Metric,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_JOB_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class _InfoOnly(Collector):
    """This process's info metrics, which Prometheus' multiprocess mode does not share."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        return [m for m in self._registry.collect() if m.type == "info"]


class JobMetrics:
    """The collectors of a process that runs jobs, on one registry (a fresh one per process or
    test): what a ``limelight worker`` exports, and the part of the sidecar's ``Metrics`` that
    the job runners (``jobs/execution.py``, ``jobs/redis_worker.py``) write.

    A worker has no model serving, drift or readiness of its own to report: its state is the
    queue's (``limelight_job_queue_up``), and everything else it exported would be zeros that
    dashboards and alerts read as a sidecar's.

    ``multiprocess_dir``: this process is one of several sidecar workers (``--workers``) whose
    values prometheus_client keeps in that directory (``PROMETHEUS_MULTIPROC_DIR``, set before
    the process imported it); ``exposition()`` then adds up every worker's.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, multiprocess_dir: Path | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir
        self._exposed = self.registry
        if multiprocess_dir is not None:
            self._exposed = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(self._exposed, path=str(multiprocess_dir))
            self._exposed.register(_InfoOnly(self.registry))
        r = self.registry
        self.job_queue_up = Gauge(
            "limelight_job_queue_up",
            "1 while the job queue takes work; 0 while it is unreachable, refuses this "
            "process's Redis user, is full or is damaged (no series without a job queue).",
            ["backend"],
            multiprocess_mode="livemin",
            registry=r,
        )
        self.job_wait = Histogram(
            "limelight_job_wait_seconds",
            "Time from submission to start, by method.",
            ["method"],
            buckets=_JOB_BUCKETS,
            registry=r,
        )
        self.job_duration = Histogram(
            "limelight_job_duration_seconds",
            "Run time of a job attempt, by method.",
            ["method"],
            buckets=_JOB_BUCKETS,
            registry=r,
        )
        self.job_outcomes = Counter(
            "limelight_jobs_total",
            "Finished jobs by method and outcome (succeeded, failed, cancelled).",
            ["method", "outcome"],
            registry=r,
        )

    def exposition(self) -> bytes:
        """The text format of ``/metrics``: this process's metrics, or every worker's."""
        return generate_latest(self._exposed)


class Metrics(JobMetrics):
    """Every collector of the sidecar: the job collectors of ``JobMetrics`` and the rest.

    Gauges say how several sidecar workers' values combine (``multiprocess_mode``): in-flight
    counts are summed, readiness is the least ready worker, drift is per worker (a ``pid``
    label: each monitor sees its own share of the traffic), and what every worker reads from
    the same job queue (its depth, its workers) is the most recently read value.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, multiprocess_dir: Path | None = None
    ) -> None:
        super().__init__(registry, multiprocess_dir)
        r = self.registry
        self.request_duration = Histogram(
            "limelight_request_duration_seconds",
            "Server-side duration of gRPC calls by RPC and status code.",
            ["rpc", "code"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.item_errors = Counter(
            "limelight_item_errors_total",
            "Inputs of an ExplainStream or ExplainBatch call answered in their place by an error "
            "(continue_on_error), by RPC and the status code they would have had; the call's own "
            "status stays OK.",
            ["rpc", "code"],
            registry=r,
        )
        self.requests_in_flight = Gauge(
            "limelight_requests_in_flight",
            "gRPC calls being served now.",
            ["rpc"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.stage_duration = Histogram(
            "limelight_inline_stage_duration_seconds",
            "Inline explanation stages: queue, tokenize, forward, attribute; total: each "
            "input's whole time in the service, from read to answer, whatever the RPC.",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "limelight_batch_size",
            "Inline requests per forward pass.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Counter(
            "limelight_batch_tokens_total",
            "Tokens in inline forward passes: the inputs' own (kind=input) and with the padding"
            " to each batch's longest input (kind=padded).",
            ["kind"],
            registry=r,
        )
        self.batch_anticipation = Counter(
            "limelight_batch_anticipation_total",
            "Waits for the clients of a length bucket owed the next batch while only other"
            " buckets had work (batch_anticipate_ms): hit when one came back in time.",
            ["outcome"],
            registry=r,
        )
        for kind in ("input", "padded"):
            self.batch_tokens.labels(kind=kind)
        for outcome in ("hit", "miss"):
            self.batch_anticipation.labels(outcome=outcome)
        self.inline_pending = Gauge(
            "limelight_inline_pending_requests",
            "Inline requests waiting for a micro-batch.",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.predictions = Counter(
            "limelight_predictions_total",
            "Predictions served, by predicted label.",
            ["label"],
            registry=r,
        )
        self.confidence = Histogram(
            "limelight_prediction_confidence",
            "Probability of the predicted label.",
            buckets=(0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
            registry=r,
        )
        self.truncated = Counter(
            "limelight_truncated_inputs_total",
            "Inputs cut to the token limit.",
            registry=r,
        )
        self.model_info = Info("limelight_model", "The served model.", registry=r)
        self.inline_reloads = Counter(
            "limelight_inline_reloads_total",
            "Rebuilds of the inline runtime from files written beside the model (a head, a "
            "lexicon table, a graph), by outcome: reloaded (served now) or failed (the files "
            "were not whole or readable; what was served stays).",
            ["outcome"],
            registry=r,
        )
        self.ready = Gauge(
            "limelight_ready",
            "1 when the model is loaded and warmed.",
            multiprocess_mode="livemin",
            registry=r,
        )
        self.tls_certificate_expiry = Gauge(
            "limelight_tls_certificate_expiry_timestamp_seconds",
            "When the TLS certificate served now expires (Unix time), by its file; it follows "
            "renewals (no series without TLS).",
            ["cert"],
            multiprocess_mode="livemin",
            registry=r,
        )
        # Jobs: the sidecar's view of the queue. Every process reads the same queue (Redis, or
        # the shared SQLite file) now and then: the latest read is right, not the largest.
        self.job_queue_depth = Gauge(
            "limelight_job_queue_depth",
            "Jobs waiting to run, by method.",
            ["method"],
            multiprocess_mode="livemostrecent",
            registry=r,
        )
        self.job_workers = Gauge(
            "limelight_job_workers",
            "Job workers consuming the queue: the embedded backend's threads, or the `limelight "
            "worker` processes that announced themselves to Redis within the last "
            "job_reclaim_idle_s (no series without a job queue).",
            ["backend"],
            multiprocess_mode="livemostrecent",
            registry=r,
        )
        # Attribution drift (limelight.drift.DriftMonitor keeps these current).
        self.attribution_drift = Gauge(
            "limelight_attribution_drift",
            "Jensen-Shannon divergence (base 2, 0..1) of the positive attribution mass over "
            "tokens, window vs reference, by predicted label; NaN while not comparable.",
            ["label"],
            multiprocess_mode="liveall",
            registry=r,
        )
        self.label_mix_drift = Gauge(
            "limelight_label_mix_drift",
            "Jensen-Shannon divergence (base 2, 0..1) of the predicted-label mix, window vs "
            "reference; NaN while not comparable.",
            multiprocess_mode="liveall",
            registry=r,
        )
        # Not a 0 that reads as "no drift" while the model loads, or with drift disabled.
        self.label_mix_drift.set(math.nan)
        self.attribution_entropy = Gauge(
            # Not "_bits": promtool reads that as a unit and asks for bytes; entropy has none.
            "limelight_attribution_entropy",
            "Mean Shannon entropy (in bits) of each explanation's positive attribution mass, "
            "by window (reference, current).",
            ["window"],
            multiprocess_mode="liveall",
            registry=r,
        )
        self.drift_reference_state = Gauge(
            "limelight_drift_reference_state",
            "1 for the drift reference's current state (building, ready, disabled), else 0.",
            ["state"],
            multiprocess_mode="liveall",
            registry=r,
        )
        self.drift_reference_explanations = Gauge(
            "limelight_drift_reference_explanations",
            "Explanations in the drift reference.",
            multiprocess_mode="liveall",
            registry=r,
        )
        self.drift_window_explanations = Gauge(
            "limelight_drift_window_explanations",
            "Explanations in the drift monitor's sliding window.",
            multiprocess_mode="liveall",
            registry=r,
        )
        self.drift_alert_threshold = Gauge(
            "limelight_drift_alert_threshold",
            "Configured divergence above which a label's drift is an alert.",
            multiprocess_mode="livemax",
            registry=r,
        )
        self.drift_dropped = Counter(
            "limelight_drift_dropped_total",
            "Inline answers the drift monitor did not observe because its queue had no room "
            "(the monitor fell behind the traffic).",
            registry=r,
        )
        self.drift_sample_rate = Gauge(
            "limelight_drift_sample_rate",
            "Configured share of inline explanations the drift monitor observes (1: all).",
            multiprocess_mode="livemax",
            registry=r,
        )
