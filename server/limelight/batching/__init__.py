"""Micro-batching of concurrent inline requests."""

from limelight.batching.batcher import MicroBatcher

__all__ = ["MicroBatcher"]
