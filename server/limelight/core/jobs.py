"""The job port: domain types and the backend interface the core service talks to.

Backends (embedded SQLite, Redis Streams) live in ``limelight.jobs`` and implement
``JobBackend``; the core and the API layer only see these types.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from limelight.core.types import Explanation, TargetSpec


class JobState(enum.Enum):
    """QUEUED → RUNNING → SUCCEEDED | FAILED | CANCELLED (RUNNING → QUEUED on a retry)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class JobSpec:
    """What a client asked for; parameters are already validated against the method."""

    method: str
    text: str
    text_pair: str | None = None
    target: TargetSpec | None = None
    params: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str = ""
    timeout_s: float = 0.0
    """0: the server's default."""


@dataclass
class JobRecord:
    id: str
    state: JobState
    spec: JobSpec
    created_at: float
    """Unix timestamps (seconds)."""
    started_at: float | None = None
    finished_at: float | None = None
    progress: float = 0.0
    message: str = ""
    attempts: int = 0
    result: Explanation | None = None
    error: str = ""


class JobBackend(ABC):
    """Durable job store + queue. All methods are called from the event loop."""

    @abstractmethod
    async def start(self) -> None:
        """Open storage, resume QUEUED/RUNNING jobs, start workers (if this backend runs any)."""

    @abstractmethod
    async def stop(self, grace_s: float) -> None:
        """Stop taking jobs; let running ones finish within ``grace_s`` or re-queue them."""

    @abstractmethod
    async def submit(self, spec: JobSpec) -> JobRecord:
        """Queue a job (or return the existing one for the same idempotency key)."""

    @abstractmethod
    async def get(self, job_id: str) -> JobRecord:
        """Raises NotFound for unknown or expired ids."""

    @abstractmethod
    async def cancel(self, job_id: str) -> JobRecord: ...

    @abstractmethod
    async def list(self, states: list[JobState] | None, limit: int) -> list[JobRecord]: ...

    @abstractmethod
    def watch(self, job_id: str) -> AsyncIterator[JobRecord]:
        """Yields the job on every change of state or progress, ending at a terminal state."""
