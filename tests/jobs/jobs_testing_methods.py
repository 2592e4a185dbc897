"""Job methods for the job tests: deterministic scores, checkpoints, blocking and crashing.

Importable by worker subprocesses (``--method jobs_testing_methods:BlockMethod`` with this
folder on PYTHONPATH).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from limelight.core.types import Encoded
from limelight.methods.base import JobContext, JobMethod, MethodOutput, Param


def expected_scores(encoded_ids: list[int], target: int) -> np.ndarray:
    """What StepMethod/BlockMethod return: an independent formula of the input and target."""
    ids = np.asarray(encoded_ids, dtype=np.float32)
    return (ids * 0.5 + target).astype(np.float32)


class StepMethod(JobMethod):
    """Reports ``steps`` checkpoints, then returns ``expected_scores``."""

    name = "steps"
    description = "test method: checkpoints in steps"
    params: ClassVar[Mapping[str, Param]] = {
        "steps": Param(int, 4, minimum=1, maximum=10_000),
        "sleep": Param(float, 0.0, minimum=0.0, maximum=10.0),
    }

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        steps = int(params["steps"])
        for i in range(steps):
            ctx.checkpoint(i / steps, f"step {i + 1}/{steps}")
            if params["sleep"]:
                time.sleep(float(params["sleep"]))
        n = len(encoded)
        scores = expected_scores(encoded.input_ids, target)
        classes = np.stack([expected_scores(encoded.input_ids, c) for c in range(2)], axis=1)
        return MethodOutput(
            scores=scores,
            class_scores=classes,
            extra_scores={"ones": np.ones(n, dtype=np.float32)},
            details={"steps": steps, "array": np.arange(3)},
        )


class BlockMethod(JobMethod):
    """Checkpoints until the file ``release`` exists (and writes ``started`` when it starts)."""

    name = "block"
    description = "test method: blocks until a file appears"
    params: ClassVar[Mapping[str, Param]] = {
        "release": Param(str, ""),
        "started": Param(str, ""),
    }

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        if params["started"]:
            Path(params["started"]).parent.mkdir(parents=True, exist_ok=True)
            with open(params["started"], "a") as fh:
                fh.write(f"{os.getpid()}\n")
        i = 0
        while not (params["release"] and os.path.exists(params["release"])):
            ctx.checkpoint(min(0.9, i / 100), "waiting for release")
            i += 1
            time.sleep(0.02)
        ctx.checkpoint(0.95, "released")
        return MethodOutput(scores=expected_scores(encoded.input_ids, target))


class LateReportMethod(JobMethod):
    """Checkpoints once and writes ``started``; reports progress once after the file
    ``cancelled`` exists (a report racing a cancel: sent before the worker has seen the flag),
    writes ``reported``, waits for ``resume``, then checkpoints until cancelled."""

    name = "late_report"
    description = "test method: a progress report after a cancel request"
    params: ClassVar[Mapping[str, Param]] = {
        "cancelled": Param(str, ""),
        "reported": Param(str, ""),
        "resume": Param(str, ""),
        "started": Param(str, ""),
    }

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        ctx.checkpoint(0.1, "running")
        Path(params["started"]).write_text("1")
        for name in ("cancelled", "resume"):
            while not os.path.exists(params[name]):
                time.sleep(0.01)
            if name == "cancelled":
                ctx.report(0.5, "a late report")
                Path(params["reported"]).write_text("1")
        while True:
            ctx.checkpoint(0.6, "still running")
            time.sleep(0.01)


class CrashMethod(JobMethod):
    """Kills its own process (a worker that dies mid-job, every time)."""

    name = "crash"
    description = "test method: kill -9 of the worker running it"

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        ctx.checkpoint(0.1, "about to die")
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


class BrokenMethod(JobMethod):
    """Raises an unexpected exception."""

    name = "broken"
    description = "test method: raises"

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        raise ZeroDivisionError("secret internal detail")


class MissingFileMethod(JobMethod):
    """Fails as a method whose file beside the model is missing: its message names the file."""

    name = "missing_file"
    description = "test method: fails naming a file beside the model"

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        from limelight.errors import FailedPrecondition

        raise FailedPrecondition(f"no table at {ctx.model.directory / 'table.npy'}; build one")
