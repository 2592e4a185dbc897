"""JobRunner: encoding, prediction, target resolution and wrapping of one job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import reference_prediction, test_registry
from jobs_testing_methods import expected_scores

from limelight.core.jobs import JobSpec
from limelight.core.types import TargetSpec
from limelight.errors import FailedPrecondition, InvalidArgument
from limelight.jobs.runner import JobRunner
from limelight.methods.base import JobCancelled, JobMethod, MethodRegistry
from limelight.models.loaded import LoadedModel
from limelight.settings import Settings


def _runner(model: LoadedModel, tmp_path: Path, **kw: Any) -> JobRunner:
    return JobRunner(model, test_registry(), Settings(cache_dir=tmp_path, **kw))


def test_runs_predicted_target(tiny_model: LoadedModel, tmp_path: Path) -> None:
    text = "the movie was good , not boring"
    ids, probs = reference_prediction(tiny_model, text)
    progress: list[float] = []
    expl = _runner(tiny_model, tmp_path).run(
        JobSpec(method="steps", text=text, params={"steps": 3}),
        job_id="j1",
        report=lambda f, m: progress.append(f),
    )
    predicted = int(np.argmax(probs))
    assert expl.request_id == "j1"
    assert expl.label_index == predicted
    assert expl.label == tiny_model.labels[predicted]
    np.testing.assert_allclose(expl.probabilities, probs, rtol=1e-5, atol=1e-6)
    assert [t.id for t in expl.tokens] == ids
    assert expl.attribution.target_index == predicted
    np.testing.assert_array_equal(expl.attribution.scores, expected_scores(ids, predicted))
    assert expl.attribution.class_scores is not None
    assert expl.attribution.class_scores.shape == (len(ids), 2)
    assert expl.attribution.parameters == {"steps": 3, "sleep": 0.0}
    assert progress == [0.0, 1 / 3, 2 / 3]
    assert expl.model_version == tiny_model.version
    assert expl.timings.total_seconds >= expl.timings.attribute_seconds >= 0


@pytest.mark.parametrize(
    ("target", "index"), [(TargetSpec(label="negative"), 0), (TargetSpec(index=1), 1)]
)
def test_explicit_target(
    tiny_model: LoadedModel, tmp_path: Path, target: TargetSpec, index: int
) -> None:
    text = "i hate this film"
    ids, _ = reference_prediction(tiny_model, text)
    expl = _runner(tiny_model, tmp_path).run(JobSpec(method="steps", text=text, target=target))
    assert expl.attribution.target_index == index
    assert expl.attribution.target_label == tiny_model.labels[index]
    np.testing.assert_array_equal(expl.attribution.scores, expected_scores(ids, index))


def test_text_pair_and_truncation(tiny_model: LoadedModel, tmp_path: Path) -> None:
    runner = _runner(tiny_model, tmp_path, max_tokens=6)
    expl = runner.run(JobSpec(method="steps", text="the plot was boring", text_pair="i love it"))
    assert len(expl.tokens) == 6 and expl.truncated
    assert {t.segment for t in expl.tokens} == {0, 1}


def test_rejections(tiny_model: LoadedModel, tmp_path: Path) -> None:
    runner = _runner(tiny_model, tmp_path)
    with pytest.raises(InvalidArgument, match="unknown method"):
        runner.validate(JobSpec(method="nope", text="x"))
    with pytest.raises(InvalidArgument, match="inline"):
        runner.validate(JobSpec(method="normxlogit", text="x"))
    with pytest.raises(InvalidArgument, match="unknown label"):
        runner.validate(JobSpec(method="steps", text="x", target=TargetSpec(label="meh")))
    with pytest.raises(InvalidArgument, match="out of range"):
        runner.validate(JobSpec(method="steps", text="x", target=TargetSpec(index=5)))
    with pytest.raises(InvalidArgument, match="steps"):
        runner.validate(JobSpec(method="steps", text="x", params={"steps": 0}))
    with pytest.raises(InvalidArgument, match="empty to the model"):  # zero-width only
        runner.validate(JobSpec(method="steps", text="\u200b"))
    assert runner.validate(JobSpec(method="steps", text="x")) == {"steps": 4, "sleep": 0.0}


def test_should_stop_raises_cancelled(tiny_model: LoadedModel, tmp_path: Path) -> None:
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) >= 2

    with pytest.raises(JobCancelled):
        _runner(tiny_model, tmp_path).run(
            JobSpec(method="steps", text="good", params={"steps": 5}), should_stop=stop
        )
    assert len(calls) == 2


def test_real_job_methods_run(tiny_model: LoadedModel, tmp_path: Path) -> None:
    """Every built-in job method that exists and fits the tiny model runs through the runner."""
    registry = MethodRegistry.load()
    runner = JobRunner(tiny_model, registry, Settings(cache_dir=tmp_path))
    ran = []
    for method in registry:
        if not isinstance(method, JobMethod) or method.unavailable_reason(tiny_model):
            continue
        expl = runner.run(JobSpec(method=method.name, text="the acting was awful"))
        assert expl.attribution.scores.shape == (len(expl.tokens),)
        assert np.isfinite(expl.attribution.scores).all()
        ran.append(method.name)
    if not ran:
        pytest.skip("no built-in job method is available yet")


def test_a_job_for_another_model_version_is_refused_and_one_for_this_one_runs(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    runner = _runner(tiny_model, tmp_path)
    other = JobSpec(method="steps", text="good", model_name="old", model_version="0" * 16)
    with pytest.raises(FailedPrecondition, match="submitted to model old version 0000000000000000"):
        runner.run(other)
    mine = JobSpec(method="steps", text="good", model_version=tiny_model.version)
    assert runner.run(mine).model_version == tiny_model.version
    assert runner.run(JobSpec(method="steps", text="good")).model_version == tiny_model.version


def test_a_result_with_scores_that_are_not_finite_fails_the_job_saying_why() -> None:
    # A SLALOM fit driven out of range by its lr succeeded with inf and 1e32 scores; no
    # client can use those (nor write them as JSON).
    from limelight.core.types import Attribution
    from limelight.jobs.runner import _check_finite

    def attribution(**arrays: Any) -> Attribution:
        return Attribution(
            method="slalom",
            parameters={},
            target_index=0,
            target_label="rotten",
            scores=arrays.pop("scores", np.zeros(3, dtype=np.float32)),
            extra_scores=arrays,
            details={"warning": "the fit diverged; lower lr"},
        )

    _check_finite("slalom", attribution(value=np.ones(3, dtype=np.float32)))
    with pytest.raises(InvalidArgument, match=r"\(linearized\): the fit diverged; lower lr"):
        _check_finite("slalom", attribution(linearized=np.array([1.0, np.inf, 0.0])))
    with pytest.raises(InvalidArgument, match=r"not finite numbers \(scores\)"):
        _check_finite("slalom", attribution(scores=np.array([np.nan, 0.0, 0.0])))


def test_throughput_and_batched_methods_need_no_pad_token_id(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """GPT-2 declares no pad_token_id, and here its pad token ([SEP]) ends every text, so none
    can be declared at load: the throughput probe (8 rows, at submit) and the methods that run
    padded batches go through the base and the head, as the inline path does."""
    from limelight.models.loaded import load_model
    from tests.models.tiny_families import save_tiny

    directory = save_tiny(
        tmp_path / "gpt2", tokenizer_dir, "gpt2", tokenizer_values={"pad_token": "[SEP]"}
    )
    model = load_model(directory)
    assert model.config.pad_token_id is None
    settings = Settings(cache_dir=tmp_path / "cache")
    runner = JobRunner(model, MethodRegistry.load(settings), settings)
    assert runner.tokens_per_second() > 0
    cheap: dict[str, dict[str, Any]] = {
        "shapley": {"permutations": 2},
        "slalom": {"num_samples": 24, "epochs": 3, "batch_size": 8},
        "greedy_deletion": {},
        "greedy_insertion": {},
    }
    for method, params in cheap.items():
        spec = JobSpec(method=method, text="the acting was awful", params=params)
        runner.validate(spec)
        expl = runner.run(spec)
        assert np.isfinite(expl.attribution.scores).all(), method
