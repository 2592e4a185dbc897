"""What the Redis backend (sidecar side) and the Redis workers share: the key layout, the
consumer group, the Lua scripts and reading a job hash.

Layout (``<p>``: the queue's name, ``Settings.jobs_queue``, by default ``limelight``; one queue
per model, any number of queues in one Redis database; not Redis Cluster):

- ``<p>:job:<id>``  hash: state, spec (JSON, with its owner), result (JSON), progress, message,
  attempts, timestamps, cancel flag, the consumer running it and its stream entry id. Finished
  jobs get ``PEXPIRE`` = result TTL.
- ``<p>:stream``    the queue (``XADD``), consumer group ``workers``; an entry is acknowledged and
  deleted when its job ends.
- ``<p>:idem:<key>`` idempotency key (scoped by owner) → job id (expires with the job).
- ``<p>:index``     sorted set of job ids by creation time (for listing; pruned lazily).
- ``<p>:depth``     queued jobs per method (queue bound and the queue-depth metric).
- ``<p>:owner:<tag>`` sorted set of one owner's job ids by creation time (``owner_tag``: a hash
  of the owner), for its retain limit (``Settings.job_retain_max``; written since 2026-12-07)
  and its listing (an owner's ``ListJobs`` reads its own jobs, not every tenant's).
- ``<p>:events:<id>`` pub/sub channel: a message on every change (watchers re-read the hash).
- ``<p>:workers``   sorted set of the workers consuming the stream, each scored with the time
  (Redis's clock) until which its last announcement holds (``lua/presence.lua``). Workers from
  before it (2026-12-06) never write to it: while it holds no live worker, sidecars count the
  group's consumers that Redis saw within the reclaim time instead (``RedisJobBackend``).

Every transition is one Lua script (``lua/*.lua``), so it is atomic with respect to sidecars
and workers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.credentials import CredentialProvider
from redis.retry import Retry

from limelight.core.jobs import JobRecord, JobState
from limelight.errors import InvalidArgument
from limelight.jobs.serialize import explanation_from_dict, spec_from_dict
from limelight.settings import Settings

log = logging.getLogger(__name__)

GROUP = "workers"

#: Errors of a failover: the node this connection reaches is a replica now (READONLY), or a
#: replica that lost its primary (MASTERDOWN). A managed Redis moves its address to the new
#: primary, but open connections stay on the old node: the callers close their pool's.
FAILOVER_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ReadOnlyError,
    redis.exceptions.MasterDownError,
)
#: Errors that mean "Redis is not reachable right now" (down, restarting, loading its data,
#: failing over).
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.BusyLoadingError,
    *FAILOVER_ERRORS,
)

#: Errors that mean "Redis answered, and said no": wrong credentials, or an ACL user without a
#: key, channel or command Limelight uses. Not transient: a person has to fix the user (the
#: README's Redis ACL). ``AuthenticationError`` is also a ``ConnectionError``: test this first.
REFUSED_ERRORS: tuple[type[Exception], ...] = (
    redis.AuthenticationError,
    redis.exceptions.AuthenticationWrongNumberOfArgsError,
    redis.exceptions.NoPermissionError,
)
#: Redis at its ``maxmemory`` with the ``noeviction`` policy refuses every write: job calls are
#: RESOURCE_EXHAUSTED, workers wait (finished results expire after the job result TTL).
FULL_ERRORS: tuple[type[Exception], ...] = (redis.exceptions.OutOfMemoryError,)
#: Pause before asking again after a refusal: the user may be fixed while Limelight runs
#: (``ACL SETUSER``, a rotated Secret), and asking more often only fills the log.
REFUSED_S = 30.0


def acl_rules(prefix: str = "limelight") -> str:
    """The ACL a Limelight user needs: its keys, its job-event channels (granted as written:
    Redis matches a subscription pattern against the ACL literally), the ordinary commands, and
    ``INFO`` (itself ``@dangerous``) to check the eviction policy."""
    return f"~{prefix}:* &{prefix}:events:* +@all -@dangerous +info"


def refusal(exc: BaseException, prefix: str = "limelight") -> str:
    """What a refusal means and what to do about it, in one line (no credentials in it)."""
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return (
            f"Redis refused a command ({exc}): the queue's user needs the ACL "
            f"{acl_rules(prefix)} (README: Redis credentials, ACL and TLS)"
        )
    return f"Redis refused the credentials ({exc}): check the user and password of the address"


@dataclass(frozen=True)
class Keys:
    prefix: str = "limelight"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def idem(self, key: str) -> str:
        return f"{self.idem_prefix}{key}"

    def owner(self, tag: str) -> str:
        return f"{self.prefix}:owner:{tag}"

    @property
    def idem_prefix(self) -> str:
        return f"{self.prefix}:idem:"

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

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"


def owner_tag(owner: str) -> str:
    """An owner as a key and hash field: a fixed-length digest, since owners are token
    identities or certificate subjects (any characters, any length)."""
    return hashlib.sha256(owner.encode("utf-8")).hexdigest()[:32]


def lua(name: str) -> str:
    """The text of ``lua/<name>.lua`` (package data)."""
    return resources.files("limelight.jobs").joinpath("lua", f"{name}.lua").read_text("utf-8")


class PasswordFile(CredentialProvider):
    """The queue's user (from its address) with the password in a file — a mounted Secret —
    read at every new connection, so a rotated password takes effect without a restart
    (connections already authenticated stay so)."""

    def __init__(self, username: str | None, path: Path) -> None:
        self.username = username
        self.path = path

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        try:
            password = self.path.read_text().rstrip("\r\n")
        except OSError as exc:
            # A refusal, not an outage: a person has to fix the file or the Secret.
            raise redis.AuthenticationError(
                f"cannot read the password file {self.path}: {exc.strerror or exc}"
            ) from None
        return (self.username, password) if self.username else (password,)

    async def get_credentials_async(self) -> tuple[str] | tuple[str, str]:
        return self.get_credentials()


def connection(settings: Settings, for_asyncio: bool = False) -> tuple[str, dict[str, Any]]:
    """The queue's address and the options of every Redis client on it: ``client_options``,
    and with ``jobs_password_file`` the password from that file (the address then carries at
    most the user name). ``for_asyncio``: for a ``redis.asyncio`` client."""
    url, options = settings.jobs, client_options(for_asyncio)
    if settings.jobs_password_file is None:
        return url, options
    parts = urlsplit(url)
    if parts.password:
        raise InvalidArgument(
            "the job queue's password is in its address and in jobs_password_file: keep one"
        )
    host = parts.netloc.rsplit("@", 1)[-1]
    options["credential_provider"] = PasswordFile(
        unquote(parts.username) if parts.username else None, Path(settings.jobs_password_file)
    )
    return urlunsplit(parts._replace(netloc=host)), options


def client_options(for_asyncio: bool = False) -> dict[str, Any]:
    """Connection options of every Redis client: a command that meets a connection error is
    sent again on a new connection, twice at most with a short backoff, so that a dropped
    connection (a Redis restart, a proxy's idle timeout) costs no call and a down Redis answers
    quickly (callers map the error to UNAVAILABLE and clients retry). A command may so run
    twice when its reply was lost: the job scripts recognise their own second run. ``for_asyncio``:
    for a ``redis.asyncio`` client, which awaits its retry policy (given the synchronous one,
    it never retried)."""
    backoff = ExponentialBackoff(cap=0.2, base=0.02)
    return {
        "decode_responses": True,
        "socket_connect_timeout": 2.0,
        "socket_timeout": 10.0,
        "retry": AsyncRetry(backoff, retries=2) if for_asyncio else Retry(backoff, retries=2),
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


def warn_eviction_risk(memory_info: dict[str, Any] | None) -> None:
    """Warn when Redis (its ``INFO memory``; None: the user may not ask) may evict any key when
    full: queued jobs and the stream itself could vanish. ``noeviction`` (or ``volatile-*``:
    only keys with a TTL, which here are finished jobs) keep the queue."""
    if memory_info is None:
        log.info(
            "the job queue's user may not run INFO, so its eviction policy goes unchecked "
            "(grant +info: README, Redis credentials, ACL and TLS)"
        )
        return
    policy = str(memory_info.get("maxmemory_policy", ""))
    if policy.startswith("allkeys-"):
        log.warning(
            "Redis evicts any key when full (maxmemory-policy %s): queued jobs can be lost; "
            "set maxmemory-policy noeviction (or a volatile-* policy)",
            policy,
        )


def check_access(settings: Settings) -> None:
    """Ask the queue once for what every worker needs first (its consumer group, created if
    missing). Raises a ``REFUSED_ERRORS`` or ``CONNECTION_ERRORS`` error."""
    url, options = connection(settings)
    client = redis.Redis.from_url(url, **options)
    try:
        client.ping()
        ensure_group(client, Keys(settings.jobs_queue))
        try:
            memory_info = client.info("memory")
        except redis.exceptions.NoPermissionError:  # INFO is @dangerous
            memory_info = None
        warn_eviction_risk(memory_info)
    finally:
        client.close()


def ensure_group(client: Any, keys: Keys) -> bool:
    """Create the workers' consumer group (and the stream) unless it exists."""
    try:
        client.xgroup_create(keys.stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    return True


def is_missing_group(exc: redis.ResponseError) -> bool:
    """The stream or its consumer group is gone (e.g. Redis restarted without persistence)."""
    return "NOGROUP" in str(exc)
