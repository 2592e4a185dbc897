"""Shared helpers of the job tests (imported as a plain module: tests/jobs is on sys.path)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jobs_testing_methods import BlockMethod, BrokenMethod, CrashMethod, StepMethod

from limelight.core.jobs import JobBackend, JobRecord, JobState
from limelight.methods.base import MethodRegistry
from limelight.methods.normxlogit import NormXLogit
from limelight.models.loaded import LoadedModel


def test_registry() -> MethodRegistry:
    return MethodRegistry(
        {
            m.name: m
            for m in (StepMethod(), BlockMethod(), CrashMethod(), BrokenMethod(), NormXLogit())
        }
    )


test_registry.__test__ = False  # type: ignore[attr-defined]


async def wait_state(
    backend: JobBackend, job_id: str, states: set[JobState] | None = None
) -> JobRecord:
    """Follow ``watch`` until the job reaches one of ``states`` (default: any terminal)."""
    async for record in backend.watch(job_id):
        if (states is None and record.state.terminal) or (states and record.state in states):
            return record
    return await backend.get(job_id)


def wait_until(predicate: Callable[[], Any], interval: float = 0.02) -> Any:
    """Poll until ``predicate()`` is truthy (the test timeout bounds it)."""
    while True:
        value = predicate()
        if value:
            return value
        time.sleep(interval)


async def await_until(predicate: Callable[[], Any], interval: float = 0.02) -> Any:
    while True:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)


def reference_prediction(model: LoadedModel, text: str) -> tuple[list[int], np.ndarray]:
    """Token ids and softmax probabilities computed straight from the HF model."""
    enc = model.tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        logits = model.model(**enc).logits[0]
    return enc["input_ids"][0].tolist(), torch.softmax(logits, -1).numpy()


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("go")
