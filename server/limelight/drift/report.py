"""The drift report: domain types mirroring ``limelight.v1.DriftReport`` (no protobuf here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ReferenceState = Literal["building", "ready", "disabled"]


@dataclass(frozen=True)
class TokenShift:
    """A token whose share of positive attribution mass changed between the two windows."""

    token: str
    reference_share: float
    current_share: float

    @property
    def delta(self) -> float:
        return self.current_share - self.reference_share


@dataclass(frozen=True)
class LabelDrift:
    """Drift of one predicted label's attribution distribution."""

    label: str
    divergence: float
    """Jensen-Shannon divergence, base 2, in [0, 1]."""
    alert: bool
    window_count: int
    """Explanations predicted as this label in the current window."""
    risers: list[TokenShift] = field(default_factory=list)
    fallers: list[TokenShift] = field(default_factory=list)
    reference_count: int = 0
    """Explanations predicted as this label in the reference."""


@dataclass(frozen=True)
class DriftReport:
    """Attribution drift of the current window against the reference."""

    reference_state: ReferenceState
    reference_count: int
    window_count: int
    alert_threshold: float
    labels: list[LabelDrift]
    label_mix_divergence: float
    """JSD (base 2) of the predicted-label mix, reference vs window."""
    reference_entropy: float
    """Mean entropy (bits) of each explanation's positive-mass distribution in the reference."""
    current_entropy: float
    generated_at: float
    """Unix time (seconds)."""
    sample_rate: float = 1.0
    """Share of inline explanations observed: the counts are about this share of requests."""
    reference_target: int = 0
    """While the reference builds: the explanations it is built from; 0 otherwise."""
    min_count: int = 0
    """A label is compared once the window and the reference each hold this many of it."""

    @property
    def alerting(self) -> list[str]:
        return [d.label for d in self.labels if d.alert]
