"""Limelight: an explanation sidecar for transformer text classifiers."""

__version__ = "0.1.0"
