"""Dynamic, length-aware micro-batching of inline requests."""

from limelight.batching.batcher import LengthPolicy, MicroBatcher

__all__ = ["LengthPolicy", "MicroBatcher"]
