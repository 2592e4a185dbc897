"""Prometheus collectors on an injected registry."""

from limelight.metrics.collectors import Metrics

__all__ = ["Metrics"]
