"""The MiniLM demo model ships a fitted LM head, so Decoded Grad-CAM runs on it; a serving
start fits it in the background instead of waiting for it."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from limelight.app import resolve_model_dir
from limelight.build_progress import ProgressFile
from limelight.core.jobs import JobSpec
from limelight.demo.build import fit_lm_head_in_background
from limelight.jobs.runner import JobRunner
from limelight.locks import file_lock, held_elsewhere
from limelight.methods.base import MethodRegistry
from limelight.models.lm_head import (
    FIT_STAGE,
    fitted_head_dir,
    fitting_lock,
    fitting_progress,
    has_fitted_head,
)
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


def _copy_without_lm_head(minilm_dir: Path, cache: Path) -> Path:
    """The cached demo model in another cache, as a first start finds it after the build
    stages that serving waits for: classifier and inline head, no LM head yet."""
    copy = cache / "models" / minilm_dir.name
    shutil.copytree(minilm_dir, copy, ignore=shutil.ignore_patterns(fitted_head_dir(copy).name))
    return copy


def test_a_serving_start_fits_the_lm_head_in_the_background(
    minilm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    copy = _copy_without_lm_head(minilm_dir, tmp_path / "cache")
    settings = Settings(cache_dir=tmp_path / "cache", jobs="off")
    caplog.set_level(logging.INFO, logger="limelight.demo.build")
    assert resolve_model_dir(settings, progress=False, serving=True) == copy
    # Returned without fitting it; a child process fits it.
    assert not has_fitted_head(copy)
    started = [r.getMessage() for r in caplog.records if "in the background" in r.getMessage()]
    assert len(started) == 1, caplog.text
    pid = int(re.search(r"pid (\d+)", started[0]).group(1))  # type: ignore[union-attr]
    os.kill(pid, signal.SIGTERM)  # stopped half-way (as Ctrl-C on `make serve` would)
    with contextlib.suppress(ChildProcessError):  # unless subprocess reaped it already
        os.waitpid(pid, 0)
    assert not has_fitted_head(copy)  # nothing half-written counts as fitted
    assert not held_elsewhere(fitting_lock(copy))  # the lock went with the process


def test_the_background_fit_completes_and_decoded_gradcam_becomes_available(
    minilm_dir: Path, tmp_path: Path
) -> None:
    copy = _copy_without_lm_head(minilm_dir, tmp_path / "cache")
    model = load_model(copy)
    method = MethodRegistry.load(Settings(jobs="off")).get("decoded_gradcam")
    assert "none was found" in method.unavailable_reason(model)
    child = fit_lm_head_in_background(copy, steps=3)
    assert child is not None
    assert child.wait() == 0
    assert has_fitted_head(copy)
    assert not fitting_progress(copy).exists()  # the fit's progress file went with it
    assert method.unavailable_reason(model) == ""  # no restart: looked up per job
    assert "decoded_gradcam is available" in (copy.parent / f".{copy.name}.lm-head.log").read_text()
    assert fit_lm_head_in_background(copy, steps=3) is None  # fitted: nothing to start


def test_decoded_gradcam_says_the_lm_head_is_being_fitted(minilm_dir: Path, tmp_path: Path) -> None:
    copy = _copy_without_lm_head(minilm_dir, tmp_path / "cache")
    model = load_model(copy)
    method = MethodRegistry.load(Settings(jobs="off")).get("decoded_gradcam")
    with file_lock(fitting_lock(copy)):  # what a fitting process holds
        reason = method.unavailable_reason(model)
        steps = ProgressFile(fitting_progress(copy), [FIT_STAGE])  # and what it writes
        steps.update(FIT_STAGE, 30, 300, "steps")
        reading = method.unavailable_reason(model)
        steps.close()
    assert "being fitted right now" in reason and "retry" in reason
    assert "masked-LM fit: 30 of 300 steps" in reading and "retry" in reading
    assert "none was found" in method.unavailable_reason(model)
