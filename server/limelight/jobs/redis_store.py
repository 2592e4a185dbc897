"""What the Redis backend (sidecar side) and the Redis workers share: the key layout, the
consumer group, the Lua scripts and reading a job hash.

Layout (prefix ``limelight``; one Redis database per deployment, not Redis Cluster):

- ``<p>:job:<id>``  hash: state, spec (JSON, with its owner), result (JSON), progress, message,
  attempts, timestamps, cancel flag, the consumer running it and its stream entry id. Finished
  jobs get ``PEXPIRE`` = result TTL.
- ``<p>:stream``    the queue (``XADD``), consumer group ``workers``; an entry is acknowledged and
  deleted when its job ends.
- ``<p>:idem:<key>`` idempotency key (scoped by owner) → job id (expires with the job).
- ``<p>:index``     sorted set of job ids by creation time (for listing; pruned lazily).
- ``<p>:depth``     queued jobs per method (queue bound and the queue-depth metric).
- ``<p>:events:<id>`` pub/sub channel: a message on every change (watchers re-read the hash).

Every transition is one Lua script (``lua/*.lua``), so it is atomic with respect to sidecars
and workers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from limelight.core.jobs import JobRecord, JobState
from limelight.jobs.serialize import explanation_from_dict, spec_from_dict
from limelight.settings import Settings

GROUP = "workers"

#: Errors that mean "Redis is not reachable right now" (down, restarting, loading its data).
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.BusyLoadingError,
)


@dataclass(frozen=True)
class Keys:
    prefix: str = "limelight"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def idem(self, key: str) -> str:
        return f"{self.prefix}:idem:{key}"

    def events(self, job_id: str) -> str:
        return f"{self.prefix}:events:{job_id}"

    @property
    def job_prefix(self) -> str:
        return f"{self.prefix}:job:"

    @property
    def stream(self) -> str:
        return f"{self.prefix}:stream"

    @property
    def index(self) -> str:
        return f"{self.prefix}:index"

    @property
    def depth(self) -> str:
        return f"{self.prefix}:depth"


def lua(name: str) -> str:
    """The text of ``lua/<name>.lua`` (package data)."""
    return resources.files("limelight.jobs").joinpath("lua", f"{name}.lua").read_text("utf-8")


def client_options() -> dict[str, Any]:
    """Connection options of every Redis client: reconnect on the next command after a
    connection error, with a short bounded retry so that a down Redis answers quickly (callers
    map the error to UNAVAILABLE and clients retry)."""
    return {
        "decode_responses": True,
        "socket_connect_timeout": 2.0,
        "socket_timeout": 10.0,
        "retry": Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2),
        "health_check_interval": 10,
    }


def ttl_ms(settings: Settings) -> int:
    return max(1, int(settings.job_result_ttl_s * 1000))


def _float(value: Any) -> float | None:
    return float(value) if value not in (None, "") else None


def record_from_hash(data: dict[str, str], with_result: bool = True) -> JobRecord:
    """A JobRecord from a job hash (``decode_responses=True``)."""
    result = None
    if with_result and data.get("result"):
        result = explanation_from_dict(json.loads(data["result"]))
    return JobRecord(
        id=data["id"],
        state=JobState(data["state"]),
        spec=spec_from_dict(json.loads(data["spec"])),
        created_at=float(data["created_at"]),
        started_at=_float(data.get("started_at")),
        finished_at=_float(data.get("finished_at")),
        progress=float(data.get("progress") or 0.0),
        message=data.get("message", ""),
        attempts=int(data.get("attempts") or 0),
        result=result,
        error=data.get("error", ""),
    )


def is_missing_group(exc: redis.ResponseError) -> bool:
    """The stream or its consumer group is gone (e.g. Redis restarted without persistence)."""
    return "NOGROUP" in str(exc)
