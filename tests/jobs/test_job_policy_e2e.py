"""Sidecar ``truncation=window`` on a Redis queue, a worker on its own defaults (truncate):
the job is run the way the sidecar accepted it (needs SubmitJob to record the policy:
``ExplanationService.submit_job`` sets ``JobSpec.policy = InputPolicy.of(settings)``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis

from limelight.jobs.redis_worker import RedisWorker
from limelight.jobs.runner import JobRunner
from limelight.methods.base import MethodRegistry
from limelight.models.loaded import load_model
from limelight.settings import Settings
from limelight_client import Client
from tests.conftest import windowed

LIMIT, STRIDE = 32, 8
TEXT = " ".join(
    ["the service was slow but the food arrived warm and the staff apologised twice"] * 12
)


def test_a_worker_with_other_settings_runs_the_job_as_the_sidecar_accepted_it(
    start_sidecar: Callable[..., Any], random_bert_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    redis.Redis.from_url(redis_url).flushall()
    running = start_sidecar(model_dir=random_bert_dir, **windowed(LIMIT, STRIDE, jobs=redis_url))
    settings = Settings(cache_dir=tmp_path, jobs=redis_url)  # truncate, 512 tokens
    runner = JobRunner(load_model(random_bert_dir), MethodRegistry.load(settings), settings)
    worker = RedisWorker(settings, runner, name="w-defaults")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        with Client(running.target, timeout=120) as client:
            inline = client.explain(TEXT, method="normxlogit")
            done = client.submit(TEXT, "grad_x_input").result(timeout=300)
    finally:
        worker.request_stop()
        thread.join()
    assert inline.windows > 3
    assert done.windows == inline.windows and not done.truncated
    assert [(t.start, t.end) for t in done.tokens] == [(t.start, t.end) for t in inline.tokens]
    assert done.label == inline.label
    np.testing.assert_allclose(
        list(done.probabilities.values()), list(inline.probabilities.values()), rtol=1e-4
    )
