"""The job port: domain types and the backend interface the core service talks to.

Backends (embedded SQLite, Redis Streams) live in ``limelight.jobs`` and implement
``JobBackend``; the core and the API layer only see these types.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from limelight.core.types import Explanation, TargetSpec
from limelight.errors import InvalidArgument

if TYPE_CHECKING:
    from limelight.settings import Settings


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
class InputPolicy:
    """How the server that accepted a job reads over-long text: its truncation policy, token
    limit and windows. Recorded with the job so that whatever runs it (a ``limelight worker``
    started with other settings) explains the text the way it was accepted, rather than cut a
    document the sidecar explains whole or window it differently."""

    truncation: str
    """``truncate``, ``reject`` or ``window``; a plain string because a job may come from a
    newer server with a policy this one does not know (the runner refuses such a job)."""
    max_tokens: int
    window_stride: int
    window_aggregation: str

    @classmethod
    def of(cls, settings: Settings) -> InputPolicy:
        return cls(
            truncation=settings.truncation,
            max_tokens=settings.max_tokens,
            window_stride=settings.window_stride,
            window_aggregation=settings.window_aggregation,
        )


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
    trace_context: dict[str, str] = field(default_factory=dict)
    """W3C trace context (``traceparent``) of the submitting request, when tracing is on."""
    owner: str = ""
    """The principal that submitted it (a token identity or a client certificate subject;
    empty without authentication). Only its owner can read, watch, list or cancel a job, and
    idempotency keys are scoped by owner."""
    model_name: str = ""
    model_version: str = ""
    """The model the job was submitted to (its name and content hash; empty in journals
    written before they were recorded: any model). A sidecar or worker serving another version
    fails the job rather than explain the text with a model the caller did not ask: the
    prediction it answered came from the model submitted to."""
    policy: InputPolicy | None = None
    """The over-long input policy the job was accepted under (``InputPolicy.of`` the accepting
    server's settings); None in journals written before it was recorded, and from in-process
    callers: the settings of whatever runs the job."""

    def same_request(self, other: JobSpec) -> bool:
        """Whether ``other`` asks for the same work (what an idempotency key must bind)."""
        return (self.method, self.text, self.text_pair, self.target, self.params) == (
            other.method,
            other.text,
            other.text_pair,
            other.target,
            other.params,
        ) and self.timeout_s == other.timeout_s


def scoped_key(owner: str, key: str) -> str:
    """An idempotency key as stored: scoped by owner (unchanged without one)."""
    return f"{owner}\x00{key}" if owner and key else key


def owned_by(record: JobRecord, owner: str | None) -> bool:
    """Whether ``owner`` may see ``record`` (None: unchecked, for in-process callers)."""
    return owner is None or record.spec.owner == owner


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
    no_worker: bool = False
    """QUEUED on a queue that no live worker consumes (the Redis backend with no `limelight
    worker` running): it waits until one starts. Never stored; set when the job is read."""


@dataclass(frozen=True)
class JobCursor:
    """Where a page of ``JobBackend.list`` ended. Jobs are listed newest first by
    ``(created_at, id)``, so a cursor made of the last one's stays put when jobs are added or
    expire: the next page starts right after it, with nothing repeated or skipped."""

    created_at: float
    id: str

    @classmethod
    def of(cls, record: JobRecord) -> JobCursor:
        return cls(record.created_at, record.id)

    def before(self, created_at: float, job_id: str) -> bool:
        """Whether a job with this ``created_at`` and id comes after the cursor."""
        return created_at < self.created_at or (created_at == self.created_at and job_id < self.id)

    def token(self) -> str:
        """Opaque to clients (``ListJobsResponse.next_page_token``)."""
        raw = json.dumps([self.created_at, self.id], separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def from_token(cls, token: str) -> JobCursor:
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            created_at, job_id = json.loads(raw)
            if isinstance(created_at, bool) or not isinstance(created_at, (int, float)):
                raise ValueError(created_at)
            if not isinstance(job_id, str) or not math.isfinite(created_at):
                raise ValueError(job_id)
        except (ValueError, TypeError, OverflowError, binascii.Error):  # Overflow: 400 digits
            raise InvalidArgument("page_token is not a page token of this server") from None
        return cls(float(created_at), job_id)


class JobBackend(ABC):
    """Durable job store + queue. All methods are called from the event loop."""

    def describe(self) -> str:
        """Where jobs go and what runs them, for the start-up log (never a credential)."""
        return type(self).__name__

    @abstractmethod
    async def start(self) -> None:
        """Open storage, resume QUEUED/RUNNING jobs, start workers (if this backend runs any)."""

    @abstractmethod
    async def stop(self, grace_s: float) -> None:
        """Stop taking jobs; let running ones finish within ``grace_s`` or re-queue them."""

    @abstractmethod
    async def submit(self, spec: JobSpec) -> JobRecord:
        """Queue a job (or return the existing one for the same owner and idempotency key;
        InvalidArgument when that key was used for a different request)."""

    @abstractmethod
    async def get(self, job_id: str, owner: str | None = None) -> JobRecord:
        """Raises NotFound for unknown or expired ids, and for jobs of another ``owner``
        (None: any owner)."""

    @abstractmethod
    async def cancel(self, job_id: str, owner: str | None = None) -> JobRecord: ...

    @abstractmethod
    async def list(
        self,
        states: list[JobState] | None,
        limit: int,
        owner: str | None = None,
        after: JobCursor | None = None,
    ) -> list[JobRecord]:
        """Up to ``limit`` jobs (results left out), newest first by ``(created_at, id)``;
        with ``after``, only those that come after it."""

    @abstractmethod
    def watch(self, job_id: str, owner: str | None = None) -> AsyncIterator[JobRecord]:
        """Yields the job on every change of state or progress, ending at a terminal state."""


# --- resource bounds -----------------------------------------------------------------------------

_BYTES = 4
"""float32 activations."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of an encoder that bound the memory of one input row."""

    layers: int
    hidden: int
    heads: int

    def row_bytes(self, tokens: int, backward: bool) -> int:
        """Activation memory of one row of ``tokens`` tokens: an upper estimate.

        Per layer and token about 12 hidden-size vectors (attention projections, the 4x-wide
        feed-forward, norms) and per head and token pair 2 attention maps (scores,
        probabilities). A backward pass keeps every layer's activations (and their gradients);
        a forward pass without gradients keeps about two layers alive at a time.
        """
        tokens = max(1, int(tokens))
        per_layer = 12 * self.hidden * tokens + 2 * max(1, self.heads) * tokens * tokens
        layers = max(1, self.layers) + 1 if backward else 2
        return per_layer * layers * _BYTES


def rows_within(memory_mb: float, shape: ModelShape, tokens: int, backward: bool) -> int:
    """How many rows of ``tokens`` tokens one pass may hold within ``memory_mb`` (0: not even
    one)."""
    return int(memory_mb * 1024 * 1024) // shape.row_bytes(tokens, backward)
