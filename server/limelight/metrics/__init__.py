"""Prometheus collectors on an injected registry."""

from limelight.metrics.collectors import JobMetrics, Metrics

__all__ = ["JobMetrics", "Metrics"]
