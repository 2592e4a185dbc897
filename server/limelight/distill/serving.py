"""The extra inline heads served beside a model: what the sidecar, the benchmarks, the ONNX
export and the evaluation hand to a runtime so that every one of them computes the same
outputs (today: the distilled explainer, when its card matches the model)."""

from __future__ import annotations

import logging

from limelight.distill.head import ExplainerHead, check_card, head_dir, load_head, read_card
from limelight.methods.distilled import OUTPUT_NAME
from limelight.models.loaded import LoadedModel

log = logging.getLogger(__name__)


def inline_heads(model: LoadedModel) -> dict[str, ExplainerHead]:
    """The extra inline heads found beside ``model`` by output name; a head whose card does
    not match the model is logged and left out (the model is then served without it)."""
    card = read_card(head_dir(model))
    if card is None:
        return {}
    reason = check_card(card, model)
    if reason:
        log.warning("not loading the distilled head: %s", reason)
        return {}
    return {OUTPUT_NAME: load_head(model)}
