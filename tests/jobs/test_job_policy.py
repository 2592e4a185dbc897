"""A job carries the over-long input policy it was accepted under (truncation, token limit,
window stride and aggregation), and whatever runs it applies that policy, not its own settings:
a `limelight worker` started without the sidecar's ``--truncation window`` must still explain
a long document whole, in the same windows, with the same prediction."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
from helpers import test_registry, wait_state, worker_thread

from limelight.core.jobs import InputPolicy, JobSpec, JobState
from limelight.core.types import Explanation
from limelight.errors import FailedPrecondition
from limelight.jobs.redis_backend import RedisJobBackend
from limelight.jobs.redis_worker import RedisWorker
from limelight.jobs.runner import JobRunner
from limelight.jobs.serialize import spec_from_dict, spec_to_dict
from limelight.models.loaded import LoadedModel, load_model
from limelight.settings import Settings

#: About 150 tokens: over the tiny model's 64 positions, so every policy has work to do.
SENTENCES = [
    "i love this film . great fun , very good acting .",
    "the plot was boring and bad . i hate it , awful .",
    "it is not a movie but a very boring film .",
]
LONG = " ".join(SENTENCES * 4)
#: The sidecar's settings: windows of 16 tokens sharing 4, logits' maximum per class.
SIDECAR = {"truncation": "window", "max_tokens": 16, "window_stride": 4}
AGGREGATION = "max"


@pytest.fixture
def sharp_model(tiny_model_dir: Path) -> LoadedModel:
    """The tiny random BERT with its classifier scaled up: its windows' logits differ enough
    that the mean and the maximum of them predict measurably different probabilities."""
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        model.model.classifier.weight.mul_(1000)
    return model


def _settings(tmp_path: Path, **kw: Any) -> Settings:
    return Settings(cache_dir=tmp_path, **kw)


def _sidecar_settings(tmp_path: Path, **kw: Any) -> Settings:
    return _settings(tmp_path, window_aggregation=AGGREGATION, **SIDECAR, **kw)


def _same_explanation(got: Explanation, want: Explanation) -> None:
    assert got.windows == want.windows
    assert got.truncated == want.truncated
    assert [(t.start, t.end, t.id) for t in got.tokens] == [
        (t.start, t.end, t.id) for t in want.tokens
    ]
    assert got.label == want.label
    np.testing.assert_allclose(got.probabilities, want.probabilities, rtol=1e-6, atol=0)
    np.testing.assert_allclose(got.attribution.scores, want.attribution.scores, rtol=1e-5)


def test_a_runner_applies_the_policy_the_job_was_accepted_under(
    sharp_model: LoadedModel, tmp_path: Path
) -> None:
    accepted = _sidecar_settings(tmp_path)
    sidecar = JobRunner(sharp_model, test_registry(), accepted)
    worker = JobRunner(sharp_model, test_registry(), _settings(tmp_path))  # truncate, 512
    spec = JobSpec(method="steps", text=LONG, policy=InputPolicy.of(accepted))

    want = sidecar.run(spec)
    assert want.windows > 2 and not want.truncated
    worker.validate(spec)
    _same_explanation(worker.run(spec), want)
    # The aggregation travels too: the worker's default "mean" would predict otherwise.
    unrecorded = replace(spec, policy=None)
    mean = JobRunner(sharp_model, test_registry(), _settings(tmp_path, **SIDECAR)).run(unrecorded)
    assert mean.windows == want.windows
    assert not np.allclose(mean.probabilities, want.probabilities, rtol=1e-4, atol=0)


def test_a_job_without_a_recorded_policy_runs_under_the_runners_own_settings(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    """Jobs journalled by the previous version carry no policy: as before, the settings of
    whatever runs them apply."""
    stored = spec_to_dict(JobSpec(method="steps", text=LONG))
    del stored["policy"]  # the previous version's form
    spec = spec_from_dict(json.loads(json.dumps(stored)))
    assert spec.policy is None
    truncating = JobRunner(tiny_model, test_registry(), _settings(tmp_path)).run(spec)
    assert truncating.truncated and truncating.windows == 0
    assert len(truncating.tokens) == tiny_model.max_tokens
    windowed = JobRunner(tiny_model, test_registry(), _sidecar_settings(tmp_path)).run(spec)
    assert windowed.windows > 2 and not windowed.truncated


def test_the_policy_survives_the_journal(tmp_path: Path) -> None:
    policy = InputPolicy.of(_sidecar_settings(tmp_path))
    spec = JobSpec(method="steps", text=LONG, policy=policy)
    back = spec_from_dict(json.loads(json.dumps(spec_to_dict(spec))))
    assert back.policy == policy == InputPolicy("window", 16, 4, AGGREGATION)


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        (InputPolicy("summarize", 16, 4, "mean"), "does not know that truncation policy"),
        (InputPolicy("window", 16, 4, "median"), "cannot apply those settings"),
        (InputPolicy("window", 16, 12, "mean"), "window_stride 12 must be between 0 and"),
    ],
)
def test_a_policy_the_runner_cannot_apply_is_refused_not_replaced(
    tiny_model: LoadedModel, tmp_path: Path, policy: InputPolicy, says: str
) -> None:
    runner = JobRunner(tiny_model, test_registry(), _settings(tmp_path))
    spec = JobSpec(method="steps", text=LONG, policy=policy)
    with pytest.raises(FailedPrecondition, match=says) as refused:
        runner.run(spec)
    assert f"accepted under truncation={policy.truncation!r}" in refused.value.message


@pytest.mark.asyncio
async def test_a_redis_worker_runs_the_job_as_the_sidecar_accepted_it(
    sharp_model: LoadedModel, redis_clean: str, tmp_path: Path
) -> None:
    """The audit's case: sidecar ``--truncation window``, worker on its defaults (truncate).
    The job recorded the sidecar's policy, so the worker's answer is the sidecar's."""
    accepted = _sidecar_settings(tmp_path, jobs=redis_clean)
    sidecar_runner = JobRunner(sharp_model, test_registry(), accepted)
    want = sidecar_runner.run(JobSpec(method="steps", text=LONG))
    worker_settings = _settings(tmp_path, jobs=redis_clean)
    assert worker_settings.truncation == "truncate"
    worker_runner = JobRunner(sharp_model, test_registry(), worker_settings)

    backend = RedisJobBackend(accepted, runner=sidecar_runner)
    await backend.start()
    try:
        recorded = await backend.submit(
            JobSpec(method="steps", text=LONG, policy=InputPolicy.of(accepted))
        )
        older = await backend.submit(JobSpec(method="steps", text=LONG))
        with worker_thread(RedisWorker(worker_settings, worker_runner, name="w-defaults")):
            done = await wait_state(backend, recorded.id)
            previous = await wait_state(backend, older.id)
    finally:
        await backend.stop(1)
    assert done.state is JobState.SUCCEEDED and done.result is not None
    _same_explanation(done.result, want)
    # A job stored without a policy (as the previous version stored them): the worker's own.
    assert previous.state is JobState.SUCCEEDED and previous.result is not None
    assert previous.result.truncated and previous.result.windows == 0


@pytest.mark.asyncio
async def test_a_worker_that_cannot_apply_the_recorded_policy_fails_the_job_saying_why(
    tiny_model: LoadedModel, redis_clean: str, tmp_path: Path
) -> None:
    settings = _settings(tmp_path, jobs=redis_clean)
    backend = RedisJobBackend(settings)  # a (newer) sidecar that validated it already
    await backend.start()
    try:
        job = await backend.submit(
            JobSpec(method="steps", text=LONG, policy=InputPolicy("summarize", 16, 4, "mean"))
        )
        runner = JobRunner(tiny_model, test_registry(), settings)
        with worker_thread(RedisWorker(settings, runner, name="w-older")):
            final = await wait_state(backend, job.id)
    finally:
        await backend.stop(1)
    assert final.state is JobState.FAILED and final.result is None
    assert "truncation='summarize'" in final.error
    assert "does not know that truncation policy" in final.error
    # Failed for good: not retried on another worker that would do the same.
    assert final.attempts == 1
    assert redis.Redis.from_url(redis_clean).xlen("limelight:stream") == 0
