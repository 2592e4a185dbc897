"""Scale-out jobs on Redis: a hash per job, a Stream with a consumer group as the queue.

Layout (prefix ``limelight``; one Redis database per deployment, not Redis Cluster):

- ``<p>:job:<id>``  hash: state, spec (JSON), result (JSON), progress, message, attempts,
  timestamps, cancel flag, the consumer running it and its stream entry id. Finished jobs get
  ``PEXPIRE`` = result TTL.
- ``<p>:stream``    the queue (``XADD``), consumer group ``workers``; an entry is acknowledged and
  deleted when its job ends.
- ``<p>:idem:<key>`` idempotency key → job id (set with the job, expires with it).
- ``<p>:index``     sorted set of job ids by creation time (for listing; pruned lazily).
- ``<p>:depth``     queued jobs per method (queue bound and the queue-depth metric).
- ``<p>:events:<id>`` pub/sub channel: a message on every change (watchers re-read the hash).

Every transition is one Lua script, so it is atomic with respect to sidecars and workers.
A worker heartbeats by re-claiming its own pending entry (``XCLAIM … JUSTID``), which resets
the entry's idle time; entries idle longer than ``job_reclaim_idle_s`` belong to dead workers and
are taken over with ``XAUTOCLAIM``. Each start counts an attempt; a job whose workers died
``job_max_attempts`` times is FAILED with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import redis
import redis.asyncio as aioredis

from limelight.core.jobs import JobBackend, JobRecord, JobSpec, JobState
from limelight.errors import LimelightError, NotFound, ResourceExhausted, Unavailable
from limelight.jobs.runner import JobRunner
from limelight.jobs.serialize import (
    explanation_from_dict,
    explanation_to_dict,
    spec_from_dict,
    spec_to_dict,
)
from limelight.jobs.sqlite_backend import job_timeout, progress_due
from limelight.methods.base import JobCancelled
from limelight.metrics import Metrics
from limelight.settings import Settings

log = logging.getLogger(__name__)

GROUP = "workers"


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
    def event_prefix(self) -> str:
        return f"{self.prefix}:events:"

    @property
    def stream(self) -> str:
        return f"{self.prefix}:stream"

    @property
    def index(self) -> str:
        return f"{self.prefix}:index"

    @property
    def depth(self) -> str:
        return f"{self.prefix}:depth"


# KEYS: job, stream, idem, index, depth. ARGV: id, method, spec, created_at, queue_max,
# idempotency key, job key prefix.
_SUBMIT = """
if ARGV[6] ~= '' then
  local existing = redis.call('GET', KEYS[3])
  if existing and redis.call('EXISTS', ARGV[7] .. existing) == 1 then
    return {'existing', existing}
  end
end
local queued = 0
for _, n in ipairs(redis.call('HVALS', KEYS[5])) do queued = queued + tonumber(n) end
if queued >= tonumber(ARGV[5]) then return {'full', tostring(queued)} end
local entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'method', ARGV[2], 'state', 'queued',
  'spec', ARGV[3], 'created_at', ARGV[4], 'progress', '0', 'message', 'queued',
  'attempts', '0', 'error', '', 'cancel', '0', 'idem', ARGV[6], 'entry', entry)
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
if ARGV[6] ~= '' then redis.call('SET', KEYS[3], ARGV[1]) end
return {'created', ARGV[1]}
"""

# KEYS: job, stream, depth. ARGV: now, ttl, group, idem key prefix, events channel.
_CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'missing' end
if state == 'queued' then
  local f = redis.call('HMGET', KEYS[1], 'method', 'entry', 'idem')
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_at', ARGV[1],
    'message', 'cancelled')
  redis.call('HINCRBY', KEYS[3], f[1], -1)
  redis.call('XACK', KEYS[2], ARGV[3], f[2])
  redis.call('XDEL', KEYS[2], f[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if f[3] and f[3] ~= '' then redis.call('PEXPIRE', ARGV[4] .. f[3], ARGV[2]) end
elseif state == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1', 'message', 'cancelling')
end
redis.call('PUBLISH', ARGV[5], state)
return state
"""

# KEYS: job, depth, stream. ARGV: consumer, now, max_attempts, ttl, group, entry, idem prefix,
# events channel.
_CLAIM = """
local f = redis.call('HMGET', KEYS[1], 'state', 'method', 'attempts', 'cancel', 'idem')
local state = f[1]
if not state then
  redis.call('XACK', KEYS[3], ARGV[5], ARGV[6])
  redis.call('XDEL', KEYS[3], ARGV[6])
  return {'missing'}
end
local function finish(new_state, err, msg)
  redis.call('HSET', KEYS[1], 'state', new_state, 'finished_at', ARGV[2], 'error', err,
    'message', msg)
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  if f[5] and f[5] ~= '' then redis.call('PEXPIRE', ARGV[7] .. f[5], ARGV[4]) end
  redis.call('XACK', KEYS[3], ARGV[5], ARGV[6])
  redis.call('XDEL', KEYS[3], ARGV[6])
  redis.call('PUBLISH', ARGV[8], new_state)
end
if state == 'queued' then
  redis.call('HINCRBY', KEYS[2], f[2], -1)
elseif state == 'running' then
  if f[4] == '1' then
    finish('cancelled', '', 'cancelled')
    return {'cancelled', f[2]}
  end
  local attempts = tonumber(f[3])
  if attempts >= tonumber(ARGV[3]) then
    local reason = 'worker died ' .. attempts .. ' time' .. (attempts == 1 and '' or 's')
    finish('failed', reason, reason)
    return {'dead', f[2], reason}
  end
else
  redis.call('XACK', KEYS[3], ARGV[5], ARGV[6])
  redis.call('XDEL', KEYS[3], ARGV[6])
  return {'skip', state}
end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', ARGV[2], 'consumer', ARGV[1],
  'progress', '0', 'message', 'running', 'entry', ARGV[6])
redis.call('PUBLISH', ARGV[8], 'running')
local g = redis.call('HMGET', KEYS[1], 'spec', 'created_at')
return {'run', f[2], g[1], g[2], tostring(attempts)}
"""

# KEYS: job. ARGV: consumer, progress, message, events channel. Returns the cancel flag,
# or 'lost' when another worker owns the job now.
_PROGRESS = """
local f = redis.call('HMGET', KEYS[1], 'state', 'consumer', 'cancel')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return 'lost' end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'progress', ARGV[2], 'message', ARGV[3])
  redis.call('PUBLISH', ARGV[4], 'progress')
end
return f[3]
"""

# KEYS: job, stream. ARGV: consumer, state, now, ttl, error, message, result, progress, group,
# entry, idem prefix, events channel.
_FINISH = """
local f = redis.call('HMGET', KEYS[1], 'state', 'consumer', 'idem')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return 'lost' end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'finished_at', ARGV[3], 'error', ARGV[5],
  'message', ARGV[6])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[7]) end
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'progress', ARGV[8]) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if f[3] and f[3] ~= '' then redis.call('PEXPIRE', ARGV[11] .. f[3], ARGV[4]) end
redis.call('XACK', KEYS[2], ARGV[9], ARGV[10])
redis.call('XDEL', KEYS[2], ARGV[10])
redis.call('PUBLISH', ARGV[12], ARGV[2])
return 'ok'
"""

# KEYS: job, stream, depth. ARGV: consumer, group, entry, events channel.
# A stopping worker hands its job back: a fresh stream entry, attempt not counted.
_ABANDON = """
local f = redis.call('HMGET', KEYS[1], 'state', 'consumer', 'method', 'id')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return 'lost' end
local entry = redis.call('XADD', KEYS[2], '*', 'job', f[4])
redis.call('HSET', KEYS[1], 'state', 'queued', 'progress', '0', 'entry', entry,
  'message', 're-queued: its worker stopped', 'consumer', '')
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
redis.call('HINCRBY', KEYS[3], f[3], 1)
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
redis.call('PUBLISH', ARGV[4], 'queued')
return 'ok'
"""


def _ttl_ms(settings: Settings) -> int:
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


def _ensure_group(client: Any, keys: Keys) -> None:
    try:
        client.xgroup_create(keys.stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class RedisJobBackend(JobBackend):
    """The sidecar side: enqueue, read, cancel and watch. Jobs run in ``RedisWorker``s.

    ``runner`` (optional) only validates specs before they are queued.
    """

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        runner: JobRunner | None = None,
        *,
        prefix: str = "limelight",
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.runner = runner
        self.keys = Keys(prefix)
        self._client: aioredis.Redis | None = None
        self._depth_methods: set[str] = set()
        self._stopping = False
        self._submit: Any = None
        self._cancel: Any = None
        self._depth_task: asyncio.Task[None] | None = None
        self.depth_interval_s = 5.0
        """How often the queue-depth gauge is refreshed even when no RPC touches the queue."""

    @property
    def client(self) -> Any:  # redis-py's stubs type replies as bytes | str | …
        if self._client is None:
            raise Unavailable("job store is not connected")
        return self._client

    async def start(self) -> None:
        self._client = aioredis.Redis.from_url(self.settings.jobs, decode_responses=True)
        try:
            await self._client.ping()
            try:
                await self._client.xgroup_create(self.keys.stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        except redis.ConnectionError as exc:
            raise Unavailable(f"cannot reach the job queue at {self.settings.jobs}: {exc}") from exc
        self._submit = self._client.register_script(_SUBMIT)
        self._cancel = self._client.register_script(_CANCEL)
        self._stopping = False
        await self._refresh_depth()
        if self.metrics is not None:
            self._depth_task = asyncio.create_task(self._depth_loop())

    async def _depth_loop(self) -> None:
        # Workers drain the queue without calling the sidecar: poll so the gauge stays current.
        while True:
            await asyncio.sleep(self.depth_interval_s)
            try:
                await self._refresh_depth()
            except (redis.RedisError, Unavailable) as exc:
                log.debug("queue depth refresh failed: %s", exc)

    async def stop(self, grace_s: float) -> None:
        # Jobs live in Redis and run in workers: nothing to drain here.
        self._stopping = True
        if self._depth_task is not None:
            self._depth_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._depth_task
            self._depth_task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _refresh_depth(self) -> None:
        if self.metrics is None:
            return
        counts = {m: int(n) for m, n in (await self.client.hgetall(self.keys.depth)).items()}
        self._depth_methods |= set(counts)
        for method in self._depth_methods:
            self.metrics.job_queue_depth.labels(method=method).set(max(0, counts.get(method, 0)))

    async def submit(self, spec: JobSpec) -> JobRecord:
        if self._stopping:
            raise Unavailable("the server is shutting down")
        if self.runner is not None:
            spec = replace(spec, params=self.runner.validate(spec))
        job_id = uuid.uuid4().hex
        keys = self.keys
        outcome, value = await self._submit(
            keys=[
                keys.job(job_id),
                keys.stream,
                keys.idem(spec.idempotency_key),
                keys.index,
                keys.depth,
            ],
            args=[
                job_id,
                spec.method,
                json.dumps(spec_to_dict(spec)),
                repr(time.time()),
                self.settings.job_queue_max,
                spec.idempotency_key,
                keys.job_prefix,
            ],
        )
        if outcome == "full":
            raise ResourceExhausted(
                f"job queue is full ({value} queued, limit {self.settings.job_queue_max}); "
                "retry later"
            )
        await self._refresh_depth()
        return await self.get(value)

    async def get(self, job_id: str) -> JobRecord:
        data = await self.client.hgetall(self.keys.job(job_id))
        if not data:
            raise NotFound(f"job {job_id!r} not found (unknown, or expired after its TTL)")
        return record_from_hash(data)

    async def cancel(self, job_id: str) -> JobRecord:
        keys = self.keys
        state = await self._cancel(
            keys=[keys.job(job_id), keys.stream, keys.depth],
            args=[
                repr(time.time()),
                _ttl_ms(self.settings),
                GROUP,
                keys.idem(""),
                keys.events(job_id),
            ],
        )
        if state == "missing":
            raise NotFound(f"job {job_id!r} not found (unknown, or expired after its TTL)")
        record = await self.get(job_id)
        if state == "queued" and self.metrics is not None:
            self.metrics.job_outcomes.labels(record.spec.method, "cancelled").inc()
        await self._refresh_depth()
        return record

    async def list(self, states: list[JobState] | None, limit: int) -> list[JobRecord]:
        """Newest first; results are left out (read one job with ``get``)."""
        limit = max(1, min(int(limit) if limit else 100, 1000))
        wanted = set(states or [])
        out: list[JobRecord] = []
        start, page = 0, max(limit, 100)
        while len(out) < limit:
            ids = await self.client.zrevrange(self.keys.index, start, start + page - 1)
            if not ids:
                break
            start += len(ids)
            pipe = self.client.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(self.keys.job(job_id))
            gone = []
            for job_id, data in zip(ids, await pipe.execute(), strict=True):
                if not data:
                    gone.append(job_id)
                    continue
                record = record_from_hash(data, with_result=False)
                if not wanted or record.state in wanted:
                    out.append(record)
            if gone:  # expired jobs: prune the index as we go
                await self.client.zrem(self.keys.index, *gone)
                start -= len(gone)
        await self._refresh_depth()
        return out[:limit]

    async def watch(self, job_id: str) -> AsyncIterator[JobRecord]:  # type: ignore[override]
        pubsub = self.client.pubsub()
        await pubsub.subscribe(self.keys.events(job_id))
        try:
            last: tuple[Any, ...] | None = None
            while True:
                record = await self.get(job_id)
                now = (record.state, record.progress, record.message)
                if now != last:
                    last = now
                    yield record
                if record.state.terminal:
                    return
                # The timeout only guards against a missed message; changes arrive by pub/sub.
                await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        finally:
            await pubsub.unsubscribe()
            await pubsub.aclose()


class RedisWorker:
    """Consumes the job stream and runs jobs in the calling thread (one job at a time).

    Run one per process (``limelight worker --workers N`` starts N processes). ``request_stop``
    makes ``run`` return after the current job; ``abandon`` hands the current job back to the
    queue at its next checkpoint.
    """

    def __init__(
        self,
        settings: Settings,
        runner: JobRunner,
        metrics: Metrics | None = None,
        *,
        name: str | None = None,
        prefix: str = "limelight",
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.metrics = metrics
        self.keys = Keys(prefix)
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.client: Any = redis.Redis.from_url(settings.jobs, decode_responses=True)
        self._claim = self.client.register_script(_CLAIM)
        self._progress = self.client.register_script(_PROGRESS)
        self._finish = self.client.register_script(_FINISH)
        self._abandon_script = self.client.register_script(_ABANDON)
        self._stop = threading.Event()
        self._abandon = threading.Event()
        self.idle_ms = max(1, int(settings.job_reclaim_idle_s * 1000))
        self.jobs_done = 0

    def request_stop(self) -> None:
        """Finish the current job, then return from ``run``."""
        self._stop.set()

    def abandon(self) -> None:
        """Stop the current job at its next checkpoint and re-queue it."""
        self._stop.set()
        self._abandon.set()

    def run(self, max_jobs: int | None = None) -> None:
        """Consume until ``request_stop`` (or ``max_jobs`` jobs were handled)."""
        _ensure_group(self.client, self.keys)
        block_ms = max(10, min(1000, self.idle_ms // 2))
        log.info("worker %s consuming %s", self.name, self.keys.stream)
        while not self._stop.is_set():
            if max_jobs is not None and self.jobs_done >= max_jobs:
                break
            try:
                entry = self._reclaim() or self._read(block_ms)
            except redis.ConnectionError as exc:
                log.warning("worker %s: queue unreachable (%s); retrying", self.name, exc)
                self._stop.wait(1.0)
                continue
            if entry is not None:
                self._handle(*entry)
        self._leave_group()

    def _leave_group(self) -> None:
        try:
            pending = self.client.xpending_range(
                self.keys.stream, GROUP, min="-", max="+", count=1, consumername=self.name
            )
            if not pending:
                self.client.xgroup_delconsumer(self.keys.stream, GROUP, self.name)
        except redis.RedisError:
            pass

    def _reclaim(self) -> tuple[str, str] | None:
        """One entry of a dead worker (idle past the reclaim time), if any."""
        reply = self.client.xautoclaim(
            self.keys.stream, GROUP, self.name, self.idle_ms, start_id="0-0", count=1
        )
        claimed = reply[1]
        deleted = reply[2] if len(reply) > 2 else []
        if deleted:  # entries deleted while pending (e.g. a cancelled job): clear the PEL
            self.client.xack(self.keys.stream, GROUP, *deleted)
        for entry_id, fields in claimed:
            if fields and "job" in fields:
                log.warning("worker %s reclaims job %s", self.name, fields["job"])
                return entry_id, fields["job"]
            self.client.xack(self.keys.stream, GROUP, entry_id)
        return None

    def _read(self, block_ms: int) -> tuple[str, str] | None:
        reply = self.client.xreadgroup(
            GROUP, self.name, {self.keys.stream: ">"}, count=1, block=block_ms
        )
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                if fields and "job" in fields:
                    return entry_id, fields["job"]
                self.client.xack(self.keys.stream, GROUP, entry_id)
        return None

    def _handle(self, entry: str, job_id: str) -> None:
        keys = self.keys
        ttl = _ttl_ms(self.settings)
        reply = self._claim(
            keys=[keys.job(job_id), keys.depth, keys.stream],
            args=[
                self.name,
                repr(time.time()),
                self.settings.job_max_attempts,
                ttl,
                GROUP,
                entry,
                keys.idem(""),
                keys.events(job_id),
            ],
        )
        kind = reply[0]
        if kind in ("missing", "skip"):
            return
        self.jobs_done += 1
        if kind in ("cancelled", "dead"):
            if kind == "dead":
                log.error("job %s: %s; giving up", job_id, reply[2])
            if self.metrics is not None:
                outcome = "cancelled" if kind == "cancelled" else "failed"
                self.metrics.job_outcomes.labels(reply[1], outcome).inc()
            return
        _, method, spec_json, created_at, _attempts = reply
        spec = spec_from_dict(json.loads(spec_json))
        waited = max(0.0, time.time() - float(created_at))
        if self.metrics is not None:
            self.metrics.job_wait.labels(method).observe(waited)
        self._execute(entry, job_id, spec, waited)

    def _execute(self, entry: str, job_id: str, spec: JobSpec, waited: float) -> None:
        keys = self.keys
        timeout = job_timeout(spec, self.settings)
        deadline = time.monotonic() + timeout
        remote = {"cancel": False, "lost": False, "checked": 0.0}
        beat_stop = threading.Event()

        def heartbeat() -> None:
            # Re-claiming our own entry resets its idle time: we are alive.
            interval = self.settings.job_reclaim_idle_s / 3
            while not beat_stop.wait(interval):
                try:
                    self.client.xclaim(keys.stream, GROUP, self.name, 0, [entry], justid=True)
                except redis.RedisError as exc:
                    log.warning("worker %s: heartbeat failed: %s", self.name, exc)

        def poll(progress: str = "", message: str = "") -> None:
            flag = self._progress(
                keys=[keys.job(job_id)],
                args=[self.name, progress, message, keys.events(job_id)],
            )
            remote["checked"] = time.monotonic()
            remote["cancel"] = flag == "1"
            remote["lost"] = flag == "lost"

        def should_stop() -> bool:
            if time.monotonic() - float(remote["checked"]) > 0.1:
                poll()
            return (
                bool(remote["cancel"])
                or bool(remote["lost"])
                or self._abandon.is_set()
                or time.monotonic() >= deadline
            )

        last = {"fraction": 0.0, "written": -1.0, "at": 0.0}

        def report(fraction: float, message: str) -> None:
            fraction = max(min(1.0, max(0.0, float(fraction))), last["fraction"])
            last["fraction"] = fraction
            if progress_due(fraction, last):
                poll(repr(fraction), message[:500])

        beat = threading.Thread(target=heartbeat, name="limelight-heartbeat", daemon=True)
        beat.start()
        started = time.perf_counter()
        outcome: str | None = None
        try:
            result = self.runner.run(spec, job_id, report, should_stop, queue_seconds=waited)
        except JobCancelled:
            if remote["lost"]:
                log.warning("job %s was taken over by another worker", job_id)
            elif remote["cancel"]:
                outcome = self._done(entry, job_id, JobState.CANCELLED, message="cancelled")
            elif time.monotonic() >= deadline:
                reason = f"timed out after {timeout:g}s"
                outcome = self._done(entry, job_id, JobState.FAILED, error=reason, message=reason)
            else:
                self._abandon_script(
                    keys=[keys.job(job_id), keys.stream, keys.depth],
                    args=[self.name, GROUP, entry, keys.events(job_id)],
                )
                log.info("job %s re-queued: worker %s stopping", job_id, self.name)
        except LimelightError as exc:
            outcome = self._done(
                entry, job_id, JobState.FAILED, error=exc.message, message="failed"
            )
        except Exception:
            log.exception("job %s (%s) failed", job_id, spec.method)
            error = f"internal error in method {spec.method} (details in the worker log)"
            outcome = self._done(entry, job_id, JobState.FAILED, error=error, message="failed")
        else:
            outcome = self._done(
                entry,
                job_id,
                JobState.SUCCEEDED,
                message="done",
                result=json.dumps(explanation_to_dict(result)),
                progress="1.0",
            )
        finally:
            beat_stop.set()
            beat.join()
        if self.metrics is not None:
            self.metrics.job_duration.labels(spec.method).observe(time.perf_counter() - started)
            if outcome is not None:
                self.metrics.job_outcomes.labels(spec.method, outcome).inc()

    def _done(
        self,
        entry: str,
        job_id: str,
        state: JobState,
        *,
        message: str,
        error: str = "",
        result: str = "",
        progress: str = "",
    ) -> str | None:
        keys = self.keys
        status = self._finish(
            keys=[keys.job(job_id), keys.stream],
            args=[
                self.name,
                state.value,
                repr(time.time()),
                _ttl_ms(self.settings),
                error,
                message,
                result,
                progress,
                GROUP,
                entry,
                keys.idem(""),
                keys.events(job_id),
            ],
        )
        if status == "lost":
            log.warning("job %s finished here but another worker owns it now", job_id)
            return None
        return state.value
