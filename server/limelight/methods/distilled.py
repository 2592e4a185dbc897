"""The distilled inline explainer: job-quality attributions in the serving pass.

See docs/distillation.md.

A small head trained by `limelight distill` on a job method's attributions (the teacher) runs
on the same forward pass as the prediction; this method only reads its output.
"""

from __future__ import annotations

from limelight.build_progress import read_progress
from limelight.errors import FailedPrecondition
from limelight.locks import held_elsewhere
from limelight.methods.base import ExtraOutputMethod
from limelight.models.explainer_head import (
    OUTPUT_NAME,
    building_lock,
    building_progress,
    check_card,
    check_head_readable,
    head_dir,
    read_card,
)
from limelight.models.loaded import LoadedModel

__all__ = ["OUTPUT_NAME", "DistilledExplainer"]


class DistilledExplainer(ExtraOutputMethod):
    name = "distilled"
    description = (
        "A small head distilled from an expensive teacher (Shapley values, greedy deletion or "
        "another job method); runs on the serving forward pass."
    )
    output = OUTPUT_NAME
    needs = "a distilled head"

    def unavailable_reason(self, model: LoadedModel) -> str:
        reason = super().unavailable_reason(model)  # the files, read once per model
        # Not cached: the build ends (or fails) without a head appearing to clear the cache.
        if reason == self._missing(model) and held_elsewhere(building_lock(model.directory)):
            progress = read_progress(building_progress(model.directory))
            return (
                "the distilled head is being built right now by another process (the demo "
                "build, in the background"
                + (f"; {progress.describe()}" if progress else "")
                + "); the sidecar serves it when it is done, without a restart: retry then"
            )
        return reason

    def check_model(self, model: LoadedModel) -> str:
        card = read_card(head_dir(model))
        if card is None:
            return self._missing(model)
        why = check_card(card, model)
        if why:
            return why
        try:  # a card that fits, weights cut short by a copy: name the file to mend
            check_head_readable(model)
        except FailedPrecondition as exc:
            return exc.message
        return ""

    @staticmethod
    def _missing(model: LoadedModel) -> str:
        return (
            f"no distilled head beside the model; create one with "
            f"`limelight distill --model {model.directory}`"
        )
