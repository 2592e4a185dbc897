"""The one job-execution core shared by every backend.

A backend claims a job, then hands it to ``execute``: it runs the job in the calling thread with
its timeout, throttled progress and stop checks, turns the result or exception into an
``Outcome`` (the next state, error and message), lets the backend write it, and records the
duration and outcome metrics. Backends only supply storage: how to journal progress, how to
learn that a job was cancelled or taken away, and how to write the outcome.

``watch_changes`` is the shared body of ``JobBackend.watch``.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from limelight import tracing
from limelight.core.jobs import JobRecord, JobSpec, JobState
from limelight.errors import InvalidArgument, LimelightError, NotFound, ResourceExhausted
from limelight.jobs.runner import JobRunner
from limelight.jobs.serialize import explanation_to_dict
from limelight.methods.base import JobCancelled
from limelight.metrics import JobMetrics
from limelight.settings import Settings

log = logging.getLogger(__name__)


def job_timeout(spec: JobSpec, settings: Settings) -> float:
    """The effective timeout of a job (seconds): its own, else the default, at most the ceiling."""
    timeout = spec.timeout_s if spec.timeout_s > 0 else settings.job_timeout_s
    return min(timeout, settings.job_timeout_max_s)


class StopReason(enum.Enum):
    """Why a running job stops before it finishes."""

    CANCELLED = "cancelled"
    """A client cancelled it."""
    TIMEOUT = "timeout"
    """It ran past its timeout."""
    RELEASE = "release"
    """The process is stopping: hand the job back to the queue (not a failed attempt)."""
    LOST = "lost"
    """Another worker owns it now (ours was presumed dead): write nothing."""


@dataclass(frozen=True)
class Outcome:
    """What became of one run of a job."""

    state: JobState | None
    """The terminal state, QUEUED for a hand-back, None when nothing is to be written."""
    message: str = ""
    error: str = ""
    result: str = ""
    """The explanation as JSON (SUCCEEDED only)."""


class ProgressThrottle:
    """Progress never goes backwards and is written at most every ``interval_s`` unless it moved
    by ``step`` or more: a method with thousands of tiny steps must not turn into thousands of
    writes and watch messages."""

    def __init__(self, interval_s: float = 0.1, step: float = 0.01) -> None:
        self.interval_s = interval_s
        self.step = step
        self.fraction = 0.0
        self._written = -1.0
        self._at = 0.0

    def update(self, fraction: float) -> float | None:
        """The clamped, monotone fraction when it is due to be written, else None."""
        fraction = max(min(1.0, max(0.0, float(fraction))), self.fraction)
        self.fraction = fraction
        now = time.monotonic()
        if fraction - self._written < self.step and now - self._at < self.interval_s:
            return None
        self._written, self._at = fraction, now
        return fraction


@dataclass
class JobHooks:
    """What a backend supplies to ``execute``."""

    check: Callable[[], StopReason | None]
    """Called at every checkpoint: a reason to stop, or None to go on (may block briefly, e.g.
    to yield to inline traffic)."""
    write_progress: Callable[[float, str], None]
    """Journal progress (already throttled)."""
    settle: Callable[[Outcome], bool]
    """Write the outcome; False when it could not be written (the store is closed, or the job
    is someone else's now)."""
    where: str = "server"
    """Where the details of an internal error are logged ("server", "worker")."""


def execute(
    runner: JobRunner,
    settings: Settings,
    job_id: str,
    spec: JobSpec,
    hooks: JobHooks,
    *,
    waited: float = 0.0,
    metrics: JobMetrics | None = None,
) -> Outcome:
    """Run one claimed job to its outcome and write it through ``hooks.settle``."""
    timeout = job_timeout(spec, settings)
    deadline = time.monotonic() + timeout
    stop: dict[str, StopReason | None] = {"reason": None}
    throttle = ProgressThrottle()

    def should_stop() -> bool:
        reason = hooks.check()
        if reason is None and time.monotonic() >= deadline:
            reason = StopReason.TIMEOUT
        if reason is not None and stop["reason"] is None:
            stop["reason"] = reason
        return reason is not None

    def report(fraction: float, message: str) -> None:
        due = throttle.update(fraction)
        if due is not None:
            hooks.write_progress(due, message[:500])

    started = time.perf_counter()
    outcome: Outcome
    with tracing.job_span(spec.method, job_id, spec.trace_context) as span:
        try:
            result = runner.run(spec, job_id, report, should_stop, queue_seconds=waited)
        except JobCancelled:
            outcome = _stopped(stop["reason"], deadline, timeout)
        except LimelightError as exc:
            log.info("job %s (%s) failed: %s", job_id, spec.method, exc.message)
            error = runner.redact(exc.message)
            outcome = Outcome(JobState.FAILED, message="failed", error=error)
        except Exception:
            log.exception("job %s (%s) failed", job_id, spec.method)
            error = f"internal error in method {spec.method} (details in the {hooks.where} log)"
            outcome = Outcome(JobState.FAILED, message="failed", error=error)
        else:
            outcome = Outcome(
                JobState.SUCCEEDED, message="done", result=json.dumps(explanation_to_dict(result))
            )
        tracing.job_outcome(span, _traced_outcome(outcome, stop["reason"]), outcome.error or "")
    written = outcome.state is not None and hooks.settle(outcome)
    if outcome.state is None:
        log.warning("job %s was taken over by another worker", job_id)
    if metrics is not None:
        metrics.job_duration.labels(spec.method).observe(time.perf_counter() - started)
        if written and outcome.state is not None and outcome.state.terminal:
            metrics.job_outcomes.labels(spec.method, outcome.state.value).inc()
    return outcome


def _traced_outcome(outcome: Outcome, reason: StopReason | None) -> str:
    """The job span's ``limelight.job.outcome``: the final state, a timeout told apart."""
    if outcome.state is None:
        return "lost"
    if outcome.state is JobState.QUEUED:
        return "requeued"
    if outcome.state is JobState.FAILED and (
        reason is StopReason.TIMEOUT or outcome.message.startswith("timed out")
    ):
        return "timed_out"
    return outcome.state.value


def _stopped(reason: StopReason | None, deadline: float, timeout: float) -> Outcome:
    if reason is None and time.monotonic() >= deadline:
        reason = StopReason.TIMEOUT
    if reason is StopReason.CANCELLED:
        return Outcome(JobState.CANCELLED, message="cancelled")
    if reason is StopReason.TIMEOUT:
        text = f"timed out after {timeout:g}s"
        return Outcome(JobState.FAILED, message=text, error=text)
    if reason is StopReason.LOST:
        return Outcome(None)
    # RELEASE, or a method that stopped on its own: hand the job back.
    return Outcome(JobState.QUEUED, message="re-queued: the server is shutting down")


async def watch_changes(
    get: Callable[[], Awaitable[JobRecord]],
    wait_change: Callable[[float], Awaitable[Any]],
    *,
    poll_s: float = 1.0,
) -> AsyncIterator[JobRecord]:
    """Yield the job whenever its state, progress or message changed, ending at a terminal
    state. ``wait_change(timeout)`` returns when a change may have happened; the timeout only
    guards against a lost wake-up."""
    last: tuple[Any, ...] | None = None
    while True:
        record = await get()
        now = (record.state, record.progress, record.message)
        if now != last:
            last = now
            yield record
        if record.state.terminal:
            return
        await wait_change(poll_s)


def not_found(job_id: str) -> NotFound:
    """Unknown, expired, and someone else's jobs all read the same."""
    shown = job_id if len(job_id) <= 64 else job_id[:64] + "…"
    return NotFound(
        f"job {shown!r} not found (unknown, expired after its TTL, or dropped as one of its "
        "owner's oldest finished jobs past the server's limit of jobs kept per owner)"
    )


def queue_full(settings: Settings, queued: int, *, per_owner: bool) -> ResourceExhausted:
    """SubmitJob's answer when the queue, or the caller's share of it, is full."""
    if per_owner:
        return ResourceExhausted(
            f"too many of your jobs are queued ({queued}, limit "
            f"{settings.job_queue_max_per_owner} per caller); retry once some have run"
        )
    return ResourceExhausted(
        f"job queue is full ({queued} queued, limit {settings.job_queue_max}); retry later"
    )


def reuse(existing: JobRecord, spec: JobSpec) -> JobRecord:
    """The job an idempotency key already names, if ``spec`` asks for the same work."""
    if not existing.spec.same_request(spec):
        raise InvalidArgument(
            f"idempotency key {spec.idempotency_key[:64]!r} was already used for a different "
            f"request (job {existing.id}); use a new key for new work"
        )
    return existing
