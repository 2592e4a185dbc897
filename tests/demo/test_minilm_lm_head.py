"""The MiniLM demo model ships a fitted LM head, so Decoded Grad-CAM runs on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from limelight.core.jobs import JobSpec
from limelight.jobs.runner import JobRunner
from limelight.methods.base import MethodRegistry
from limelight.models.lm_head import fitted_head_dir
from limelight.models.loaded import load_model
from limelight.settings import Settings


def test_decoded_gradcam_runs_on_the_default_demo_model(minilm_dir: Path) -> None:
    assert fitted_head_dir(minilm_dir).exists()
    model = load_model(minilm_dir)
    settings = Settings(jobs="off")
    methods = MethodRegistry.load(settings)
    assert methods.get("decoded_gradcam").unavailable_reason(model) == ""
    result = JobRunner(model, methods, settings).run(
        JobSpec(method="decoded_gradcam", text="a gorgeous, witty, seductive movie")
    )
    scores = result.attribution.scores
    assert np.isfinite(scores).all() and scores.shape == (len(result.tokens),)
    assert (scores >= 0).all() and scores.max() > 0  # ReLU of the summed term
