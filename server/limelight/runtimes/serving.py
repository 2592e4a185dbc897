"""The runtime the sidecar serves a model with, for everything that must see the same outputs
(evaluation, benchmarks, drift references): the extra inline outputs found beside the model."""

from __future__ import annotations

from pathlib import Path

from limelight.models.explainer_head import inline_heads
from limelight.models.lexicon_table import load_lexicon
from limelight.models.loaded import LoadedModel
from limelight.runtimes.base import Runtime
from limelight.runtimes.lexicon import LexiconRuntime
from limelight.runtimes.torch_runtime import TorchRuntime


def with_lexicon(runtime: Runtime, model: LoadedModel, cache_dir: Path | None = None) -> Runtime:
    """``runtime``, looking tokens up in the lexicon table too when one built for ``model``
    lies beside it or in ``cache_dir`` (``limelight lexicon``, ``LIMELIGHT_LEXICON_BUILD``)."""
    table = load_lexicon(model, cache_dir)
    return runtime if table is None else LexiconRuntime(runtime, table)


def torch_serving_runtime(model: LoadedModel, cache_dir: Path | None = None) -> Runtime:
    """The torch runtime computing every extra output served beside ``model``: its distilled
    head and its lexicon table (beside it or in ``cache_dir``), when valid ones are there."""
    return with_lexicon(TorchRuntime(model, inline_heads(model)), model, cache_dir)
