"""Attribution methods that exist only as plug-ins, for the method loader's tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from limelight.core.types import Encoded
from limelight.methods.base import JobContext, JobMethod, MethodOutput
from limelight.settings import Settings


class LengthMethod(JobMethod):
    """Scores every token with its position; remembers the settings it was configured with."""

    name = "plugin_length"
    description = "test plug-in: the token's position"

    def __init__(self) -> None:
        self.configured_with: Settings | None = None

    def configure(self, settings: Settings) -> None:
        self.configured_with = settings

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        return MethodOutput(scores=np.arange(len(encoded), dtype=np.float32))


class NotAMethod:
    """Importable, but not an AttributionMethod."""
