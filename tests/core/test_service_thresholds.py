"""Label thresholds set for a model that has none to apply them to are said to be ignored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from limelight.app import build_application
from limelight.metrics import Metrics
from limelight.settings import Settings


def test_thresholds_for_a_single_label_model_are_logged_as_ignored(
    bert_tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def settings(**thresholds: Any) -> Settings:
        return Settings(model_dir=bert_tiny_dir, jobs="off", metrics_port=0, **thresholds)

    with caplog.at_level("WARNING", logger="limelight.core.service"):
        build_application(settings(), Metrics())
        assert not [r for r in caplog.records if "threshold" in r.getMessage()]
        # an unknown label too: a softmax model reads no thresholds, so this is no error
        given = settings(label_thresholds={"toxic": 0.3}, label_threshold=0.4)
        service = build_application(given, Metrics()).service
    assert service.thresholds == []
    said = [r.getMessage() for r in caplog.records if "threshold" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("label_threshold and label_thresholds: ")
    assert "single label classification model" in said[0] and said[0].endswith("ignored")
