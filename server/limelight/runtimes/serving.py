"""The runtime the sidecar serves a model with, for everything that must see the same outputs
(evaluation, benchmarks, drift references): the extra inline heads found beside the model."""

from __future__ import annotations

from limelight.models.explainer_head import inline_heads
from limelight.models.loaded import LoadedModel
from limelight.runtimes.base import Runtime
from limelight.runtimes.torch_runtime import TorchRuntime


def torch_serving_runtime(model: LoadedModel) -> Runtime:
    """The torch runtime computing every extra output served beside ``model`` (its distilled
    head, when a valid one is there)."""
    return TorchRuntime(model, inline_heads(model))
