"""The distilled inline explainer: job-quality attributions in the serving pass.

See docs/distillation.md.

A small head trained by `limelight distill` on a job method's attributions (the teacher) runs
on the same forward pass as the prediction; this method only reads its output.
"""

from __future__ import annotations

import numpy as np

from limelight.core.types import FloatArray
from limelight.errors import FailedPrecondition
from limelight.methods.base import InlineMethod
from limelight.models.explainer_head import OUTPUT_NAME, check_card, head_dir, read_card
from limelight.models.loaded import LoadedModel
from limelight.runtimes.base import InlineOutputs

__all__ = ["OUTPUT_NAME", "DistilledExplainer"]


class DistilledExplainer(InlineMethod):
    name = "distilled"
    description = (
        "A small head distilled from an expensive teacher (Shapley values, greedy deletion or "
        "another job method); runs on the serving forward pass."
    )

    def __init__(self) -> None:
        self._reasons: dict[tuple[str, str], str] = {}

    def unavailable_reason(self, model: LoadedModel) -> str:
        key = (str(model.directory), model.version)
        if key not in self._reasons:  # read the card once per model, not per request
            card = read_card(head_dir(model))
            self._reasons[key] = (
                check_card(card, model)
                if card is not None
                else (
                    f"no distilled head beside the model; create one with "
                    f"`limelight distill --model {model.directory}`"
                )
            )
        return self._reasons[key]

    def attribute(self, outputs: InlineOutputs, row: int, length: int) -> FloatArray:
        scores = outputs.extra.get(OUTPUT_NAME)
        if scores is None:
            raise FailedPrecondition("the runtime did not load a distilled head")
        return np.asarray(scores[row, :length], dtype=np.float32)
