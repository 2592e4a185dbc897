"""Pick the job backend named by ``settings.jobs``."""

from __future__ import annotations

from limelight.core.jobs import JobBackend
from limelight.jobs.priority import InlineGate
from limelight.jobs.runner import JobRunner
from limelight.metrics import Metrics
from limelight.settings import Settings, job_backend_kind


def create_backend(
    settings: Settings,
    runner: JobRunner | None,
    metrics: Metrics | None = None,
    gate: InlineGate | None = None,
) -> JobBackend | None:
    """``sqlite`` → embedded backend with in-process workers; ``redis://…`` → enqueue-only
    backend (workers are ``limelight worker`` processes); ``off`` → None (no job API)."""
    kind = job_backend_kind(settings.jobs)  # the settings were checked with it
    if kind == "off":
        return None
    if kind == "sqlite":
        from limelight.jobs.sqlite_backend import SqliteJobBackend

        return SqliteJobBackend(settings, runner, metrics, gate)
    from limelight.jobs.redis_backend import RedisJobBackend

    # The sidecar only enqueues (the runner validates specs); `limelight worker` runs jobs.
    return RedisJobBackend(settings, metrics, runner=runner)
