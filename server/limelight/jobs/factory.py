"""Pick the job backend named by ``settings.jobs``."""

from __future__ import annotations

from limelight.core.jobs import JobBackend
from limelight.errors import InvalidArgument, redact_credentials
from limelight.jobs.priority import InlineGate
from limelight.jobs.runner import JobRunner
from limelight.metrics import Metrics
from limelight.settings import Settings


def create_backend(
    settings: Settings,
    runner: JobRunner | None,
    metrics: Metrics | None = None,
    gate: InlineGate | None = None,
) -> JobBackend | None:
    """``sqlite`` → embedded backend with in-process workers; ``redis://…`` → enqueue-only
    backend (workers are ``limelight worker`` processes); ``off`` → None (no job API)."""
    spec = settings.jobs.strip()
    if spec in ("off", "", "none"):
        return None
    if spec == "sqlite":
        from limelight.jobs.sqlite_backend import SqliteJobBackend

        return SqliteJobBackend(settings, runner, metrics, gate)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from limelight.jobs.redis_backend import RedisJobBackend

        # The sidecar only enqueues (the runner validates specs); `limelight worker` runs jobs.
        return RedisJobBackend(settings, metrics, runner=runner)
    raise InvalidArgument(
        f"unknown job backend {redact_credentials(spec)!r}: use sqlite, redis://… or off"
    )
