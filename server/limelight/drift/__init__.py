"""Attribution drift: heavy-hitter sketches, the monitor and reference files (docs/drift.md)."""

from limelight.drift.monitor import DriftMonitor
from limelight.drift.reference import ReferenceFile
from limelight.drift.report import DriftReport, LabelDrift, TokenShift

__all__ = ["DriftMonitor", "DriftReport", "LabelDrift", "ReferenceFile", "TokenShift"]
