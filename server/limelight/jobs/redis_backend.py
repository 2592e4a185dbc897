"""Scale-out jobs on Redis, sidecar side: enqueue, read, cancel and watch.

Jobs run in ``limelight.jobs.redis_worker.RedisWorker`` processes; the key layout and the Lua
scripts are in ``limelight.jobs.redis_store``.

Redis faults: a command that cannot reach Redis raises ``Unavailable`` (clients retry it); the
client reconnects by itself on the next command, and ``watch`` rides out a Redis restart. A
refusal (credentials, ACL) is ``Unavailable`` too, without the details, which go to the log.
Watches learn of changes through one shared pub/sub subscription (``redis_events``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from typing import Any, ParamSpec, TypeVar

import redis
import redis.asyncio as aioredis

from limelight.core.jobs import (
    JobBackend,
    JobCursor,
    JobRecord,
    JobSpec,
    JobState,
    owned_by,
    scoped_key,
)
from limelight.errors import ResourceExhausted, Unavailable, redact_credentials
from limelight.jobs.execution import not_found, queue_full, reuse, watch_changes
from limelight.jobs.redis_events import JobEvents, cancel_until_done
from limelight.jobs.redis_store import (
    CONNECTION_ERRORS,
    FAILOVER_ERRORS,
    FULL_ERRORS,
    GROUP,
    REFUSED_ERRORS,
    REFUSED_S,
    Keys,
    connection,
    lua,
    owner_tag,
    record_from_hash,
    refusal,
    ttl_ms,
    warn_eviction_risk,
)
from limelight.jobs.runner import JobRunner
from limelight.jobs.serialize import spec_to_dict
from limelight.metrics import Metrics
from limelight.settings import Settings

log = logging.getLogger(__name__)

#: Connections of a sidecar's Redis client (its pub/sub subscription takes one).
POOL_SIZE = 100
#: Longest a call waits for one of them before it is UNAVAILABLE.
POOL_WAIT_S = 10.0
#: How long a count of the workers present answers reads of queued jobs.
WORKERS_FRESH_S = 1.0
#: Added to a queued job's message while no worker consumes the queue.
NO_WORKER = "no worker consumes this queue (start `limelight worker`)"

P = ParamSpec("P")
T = TypeVar("T")


def _unreachable(exc: BaseException) -> Unavailable:
    return Unavailable(f"the job queue is unreachable ({type(exc).__name__}); retry later")


def _redis_call(
    fn: Callable[P, Coroutine[Any, Any, T]],
) -> Callable[P, Coroutine[Any, Any, T]]:
    """Redis connection faults and refusals → Unavailable (the SDK retries UNAVAILABLE)."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except (*REFUSED_ERRORS, *FULL_ERRORS, *CONNECTION_ERRORS) as exc:
            backend = args[0]
            assert isinstance(backend, RedisJobBackend)
            await backend._lost(exc)
            # A refusal first: a wrong password is also a ConnectionError.
            if isinstance(exc, REFUSED_ERRORS):
                raise backend._refused(exc) from exc
            if isinstance(exc, FULL_ERRORS):
                backend._log_at_most_every(REFUSED_S, "the job queue is out of memory: %s", exc)
                raise ResourceExhausted(
                    "the job queue is full (Redis is out of memory); retry later"
                ) from exc
            raise _unreachable(exc) from exc

    return wrapper


class RedisJobBackend(JobBackend):
    """The sidecar side: enqueue, read, cancel and watch. Jobs run in ``RedisWorker``s.

    ``runner`` (optional) only validates specs before they are queued.
    """

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        runner: JobRunner | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.runner = runner
        self.keys = Keys(settings.jobs_queue)
        self._client: aioredis.Redis | None = None
        self._depth_methods: set[str] = set()
        self._stopping = False
        self._submit: Any = None
        self._cancel: Any = None
        self._workers: tuple[int, float] | None = None  # (present, when counted: monotonic)
        self._depth_task: asyncio.Task[None] | None = None
        self._connect_task: asyncio.Task[None] | None = None
        self._events: JobEvents | None = None
        self.depth_interval_s = 5.0
        """How often the queue-depth gauge is refreshed even when no RPC touches the queue."""
        self.watch_reconnect_s = 60.0
        """How long ``watch`` waits for an unreachable Redis before it gives up (UNAVAILABLE)."""
        self.refused_retry_s = REFUSED_S
        """After a refusal at start (``jobs_refused_at_start=serve``): how often to ask again."""
        self._error_logged = -REFUSED_S
        self.prune_slice = 500
        """How many index entries each queue check looks at for jobs that expired."""
        self._prune_from = 0  # the rank in the index where the next look starts

    def describe(self) -> str:
        return (
            f"queued in Redis at {redact_credentials(self.settings.jobs)}, queue "
            f"{self.settings.jobs_queue!r}, for `limelight worker` processes to run"
        )

    @property
    def client(self) -> Any:  # redis-py's stubs type replies as bytes | str | …
        if self._client is None:
            raise Unavailable("job store is not connected")
        return self._client

    async def start(self) -> None:
        """Connect; a queue that refuses the credentials or the ACL is an error (a mistake in
        the deployment), one that is unreachable or full is not: inline explanations do not need
        it, so the sidecar serves them while job calls fail until Redis answers."""
        # A burst of calls (a wake of every watcher) waits for a free connection instead of
        # failing with "Too many connections" once the pool's 100 are in use.
        url, options = connection(self.settings, for_asyncio=True)
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=POOL_SIZE, timeout=POOL_WAIT_S, **options
        )
        self._client = aioredis.Redis.from_pool(pool)
        self._submit = self._client.register_script(lua("submit"))
        self._cancel = self._client.register_script(lua("cancel"))
        where = redact_credentials(self.settings.jobs)
        try:
            await self._connect()
        except REFUSED_ERRORS as exc:
            if self.settings.jobs_refused_at_start == "stop":
                client, self._client = self._client, None
                with contextlib.suppress(redis.RedisError, OSError):
                    await client.aclose()
                raise Unavailable(f"the job queue at {where}: {refusal(exc)}") from exc
            self._refused(exc)
            log.warning(
                "serving inline explanations without the job queue at %s; job calls fail "
                "until it accepts this sidecar (asked again every %.0f s)",
                where,
                self.refused_retry_s,
            )
            self._connect_task = asyncio.create_task(
                self._connect_when_reachable(where, first_delay=self.refused_retry_s)
            )
        except (*CONNECTION_ERRORS, *FULL_ERRORS) as exc:
            await self._lost(exc)
            log.warning(
                "the job queue at %s is %s (%s): serving inline explanations without it; job "
                "calls fail until it answers",
                where,
                "out of memory" if isinstance(exc, FULL_ERRORS) else "unreachable",
                exc,
            )
            self._connect_task = asyncio.create_task(self._connect_when_reachable(where))
        self._stopping = False
        # Gauges, and the index's pruning: with or without metrics.
        self._depth_task = asyncio.create_task(self._depth_loop())

    async def _connect(self) -> None:
        await self.client.ping()
        await self._ensure_group()  # for KEDA's lag before any worker ran
        await self._refresh_depth()
        await self._workers_present(fresh=True)
        self._queue_up(True)
        try:
            memory_info = await self.client.info("memory")
        except redis.exceptions.NoPermissionError:  # INFO is @dangerous
            memory_info = None
        warn_eviction_risk(memory_info)

    async def _connect_when_reachable(self, where: str, first_delay: float = 0.5) -> None:
        """Try again, with backoff, until the queue that failed at start answers."""
        delay = first_delay
        while True:
            await asyncio.sleep(delay)
            try:
                await self._connect()
            except REFUSED_ERRORS as exc:
                self._refused(exc)
                delay = self.refused_retry_s
            except (*CONNECTION_ERRORS, *FULL_ERRORS) as exc:
                await self._lost(exc)
                delay = min(5.0, delay * 2)
            else:
                log.info("the job queue at %s answers: job calls work again", where)
                return

    async def _ensure_group(self) -> None:
        try:
            await self.client.xgroup_create(self.keys.stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _depth_loop(self) -> None:
        # Workers drain the queue without calling the sidecar: poll so the gauge stays current
        # (and the index free of expired jobs).
        while True:
            await asyncio.sleep(self.depth_interval_s)
            try:
                await self._refresh_depth()
                await self._prune_index()
                await self._workers_present(fresh=True)
                # A write: a full or refusing Redis answers reads, but takes no jobs.
                await self._ensure_group()
            except (redis.RedisError, Unavailable) as exc:
                log.debug("job queue check failed: %s", exc)
                self._queue_up(False)
            else:
                self._queue_up(True)

    async def stop(self, grace_s: float) -> None:
        # Jobs live in Redis and run in workers: nothing to drain here.
        self._stopping = True
        for task in (self._depth_task, self._connect_task):
            await cancel_until_done(task)
        self._depth_task = self._connect_task = None
        if self._events is not None:
            await self._events.close()
            self._events = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _prune_index(self) -> int:
        """Drop from the index (what ``list`` reads) the ids of jobs whose keys expired, a slice
        of it per call, going round. ``list`` prunes only the pages it reads, newest first, so
        without this each job ever finished would leave its id in Redis for good. Returns how
        many ids were dropped."""
        index = self.keys.index
        ids = await self.client.zrangebyscore(
            index, "-inf", "+inf", start=self._prune_from, num=self.prune_slice
        )
        if not ids:
            self._prune_from = 0
            return 0
        pipe = self.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.exists(self.keys.job(job_id))
        gone = [job_id for job_id, kept in zip(ids, await pipe.execute(), strict=True) if not kept]
        if gone:
            await self.client.zrem(index, *gone)
        # Ranks past the removed ids move down by as many; a short slice was the end: go round.
        full = len(ids) == self.prune_slice
        self._prune_from = self._prune_from + len(ids) - len(gone) if full else 0
        return len(gone)

    async def _refresh_depth(self) -> None:
        if self.metrics is None:
            return
        counts = {m: int(n) for m, n in (await self.client.hgetall(self.keys.depth)).items()}
        self._depth_methods |= set(counts)
        for method in self._depth_methods:
            self.metrics.job_queue_depth.labels(method=method).set(max(0, counts.get(method, 0)))

    @_redis_call
    async def submit(self, spec: JobSpec) -> JobRecord:
        if self._stopping:
            raise Unavailable("the server is shutting down")
        if self.runner is not None:
            spec = replace(spec, params=self.runner.validate(spec))
        job_id = uuid.uuid4().hex
        keys = self.keys
        key = scoped_key(spec.owner, spec.idempotency_key)
        tag = owner_tag(spec.owner)
        per_owner = self.settings.job_queue_max_per_owner
        outcome, value = await self._submit(
            keys=[
                keys.job(job_id),
                keys.stream,
                keys.idem(key),
                keys.index,
                keys.depth,
                keys.owner(tag),
            ],
            args=[
                job_id,
                spec.method,
                json.dumps(spec_to_dict(spec)),
                repr(time.time()),
                self.settings.job_queue_max,
                key,
                keys.job_prefix,
                tag,
                "" if per_owner is None else per_owner,
                self.settings.job_retain_max,
                keys.idem_prefix,
            ],
        )
        if outcome in ("full", "owner_full"):
            raise queue_full(self.settings, int(value), per_owner=outcome == "owner_full")
        if outcome == "existing":
            return reuse(await self._get(value), spec)
        await self._refresh_depth()
        return await self._get(value)

    async def _get(self, job_id: str, owner: str | None = None) -> JobRecord:
        data = await self.client.hgetall(self.keys.job(job_id))
        if not data:
            raise not_found(job_id)
        record = record_from_hash(data)
        if not owned_by(record, owner):
            raise not_found(job_id)
        return await self._noted(record, data.get("entry"))

    async def _workers_present(self, fresh: bool = False) -> int:
        """How many workers' announcements (``lua/presence.lua``) still hold, by Redis's clock;
        while none does, how many consumers of the stream's group Redis saw within the reclaim
        horizon (``_consumers_seen``: workers from before the announcements, during a rolling
        update). A count younger than ``WORKERS_FRESH_S`` is reused unless ``fresh``. Reads
        only: a full Redis still answers it."""
        now = time.monotonic()
        if not fresh and self._workers is not None and now - self._workers[1] < WORKERS_FRESH_S:
            return self._workers[0]
        seconds, micros = await self.client.time()
        clock_ms = int(seconds) * 1000 + int(micros) // 1000
        present = int(await self.client.zcount(self.keys.workers, clock_ms, "+inf"))
        if not present:
            present = await self._consumers_seen(clock_ms)
        self._count_workers(present, now)
        return present

    def _count_workers(self, present: int, when: float) -> None:
        """Remember a count (and show it on ``limelight_job_workers``): the gauge and the
        jobs' ``no_worker`` come from the same count."""
        self._workers = (present, when)
        if self.metrics is not None:
            self.metrics.job_workers.labels(backend="redis").set(present)

    def _horizon_ms(self) -> int:
        """How long a worker may stay silent and still count as alive: the reclaim time, after
        which other workers take its running job over (its heartbeat renews it every third)."""
        return max(1, int(self.settings.job_reclaim_idle_s * 1000))

    async def _consumers_seen(self, clock_ms: int) -> int:
        """How many consumers of the stream's group Redis saw within ``_horizon_ms`` of
        ``clock_ms`` (its own clock): live workers of unknown version. Workers released before
        the announcements (2026-12-06) consume the stream without writing to ``<p>:workers``;
        one running a job re-claims its entry every third of the reclaim time, which Redis
        counts as seeing it. An idle one is seen only while it gets entries on Redis before 7.2
        (later versions count its waiting reads too); it takes a queued job within a second,
        and is counted from then on. ``XINFO STREAM … FULL`` rather than ``XINFO CONSUMERS``:
        KEDA's scaler needs it already, so the least-privilege ACL grants it. ``COUNT 1``: the
        consumers come whole, their entries one each. Only asked while no worker announces
        itself, so its cost (one line per consumer) is paid only then."""
        try:
            info = await self.client.execute_command(
                "XINFO STREAM", self.keys.stream, "FULL", "COUNT", 1, full=True
            )
        except redis.ResponseError as exc:
            if isinstance(exc, REFUSED_ERRORS) or "no such key" not in str(exc).lower():
                raise
            return 0  # no stream (Redis restarted without its data): no consumer either
        horizon = self._horizon_ms()
        for group in info.get("groups") or []:
            if not isinstance(group, dict) or group.get("name") != GROUP:
                continue
            consumers = [c for c in group.get("consumers") or [] if isinstance(c, dict)]
            return sum(1 for c in consumers if clock_ms - int(c.get("seen-time", 0)) < horizon)
        return 0

    async def _holder_alive(self, entry: str | None) -> bool:
        """Whether the consumer holding a running job's stream entry (``XPENDING``) touched it
        within ``_horizon_ms``: its worker heartbeats by re-claiming it, whatever its version."""
        if not entry:
            return False
        try:
            held = await self.client.xpending_range(self.keys.stream, GROUP, entry, entry, 1)
        except redis.ResponseError as exc:
            if isinstance(exc, REFUSED_ERRORS):
                raise
            return False  # no stream or group (Redis restarted without its data)
        return bool(held) and int(held[0]["time_since_delivered"]) < self._horizon_ms()

    async def _noted(self, record: JobRecord, entry: str | None = None) -> JobRecord:
        """A queued job says so when no worker would take it: the queue works, but nothing
        consumes it (no `limelight worker` started, or every one gone). So does a running one
        then: its worker is gone too (a live worker announces itself, busy or not, and an older
        one that does not still re-claims its job's stream ``entry``), and it stays RUNNING
        until a worker starts and reclaims it."""
        if record.state not in (JobState.QUEUED, JobState.RUNNING):
            return record
        try:
            present = await self._workers_present()
            if not present and record.state is JobState.RUNNING:
                if await self._holder_alive(entry):
                    # Its worker lives (it may have started a moment ago, or be one that does
                    # not announce itself): the count says so too.
                    self._count_workers(1, time.monotonic())
                    return record
                # Another worker may have started a moment ago: no count from before it.
                present = await self._workers_present(fresh=True)
        except redis.RedisError as exc:  # the job's own read succeeded: answer that
            log.debug("counting the job workers failed: %s", exc)
            return record
        if present:
            return record
        if record.state is JobState.RUNNING:
            message = f"{record.message}; its worker is gone, and {NO_WORKER} to run it again"
        else:
            message = f"{record.message}; {NO_WORKER}".lstrip("; ")
        return replace(record, message=message, no_worker=True)

    @_redis_call
    async def get(self, job_id: str, owner: str | None = None) -> JobRecord:
        return await self._get(job_id, owner)

    @_redis_call
    async def cancel(self, job_id: str, owner: str | None = None) -> JobRecord:
        if owner is not None:
            await self._get(job_id, owner)
        keys = self.keys
        state = await self._cancel(
            keys=[keys.job(job_id), keys.stream, keys.depth],
            args=[
                repr(time.time()),
                ttl_ms(self.settings),
                GROUP,
                keys.idem(""),
                keys.events(job_id),
                uuid.uuid4().hex,  # the same on every try of this call
            ],
        )
        if state == "missing":
            raise not_found(job_id)
        record = await self._get(job_id)
        if state == "queued" and self.metrics is not None:
            self.metrics.job_outcomes.labels(record.spec.method, "cancelled").inc()
        await self._refresh_depth()
        return record

    @_redis_call
    async def list(
        self,
        states: list[JobState] | None,
        limit: int,
        owner: str | None = None,
        after: JobCursor | None = None,
    ) -> list[JobRecord]:
        """Newest first by ``(created_at, id)`` (the index's score and member); results are
        left out (read one job with ``get``). Reads the index a page at a time from the
        cursor and drops the ids of jobs that expired. An owner's listing reads that owner's
        index, not every tenant's jobs."""
        wanted = set(states or [])
        index = self.keys.index
        if owner is not None:
            mine = self.keys.owner(owner_tag(owner))
            # An owner whose jobs all predate its index (sidecars before 2026-12-07) is listed
            # from the shared index, filtered, until those expire.
            if await self.client.exists(mine):
                index = mine
        out: list[JobRecord] = []
        page = max(limit, 100)
        cursor = after
        while len(out) < limit:
            if cursor is None:
                top, skip = "+inf", 0
            else:
                top = repr(cursor.created_at)
                # Members with the cursor's own score come in reverse id order: skip those
                # at or before it (usually just the cursor's job itself).
                tied = await self.client.zrangebyscore(index, top, top)
                skip = sum(1 for job_id in tied if job_id >= cursor.id)
            batch = await self.client.zrevrangebyscore(
                index, top, "-inf", start=skip, num=page, withscores=True
            )
            if not batch:
                break
            pipe = self.client.pipeline(transaction=False)
            for job_id, _ in batch:
                pipe.hgetall(self.keys.job(job_id))
            gone = []
            for (job_id, _), data in zip(batch, await pipe.execute(), strict=True):
                if not data:
                    gone.append(job_id)
                    continue
                record = record_from_hash(data, with_result=False)
                if (not wanted or record.state in wanted) and owned_by(record, owner):
                    out.append(await self._noted(record, data.get("entry")))
            job_id, score = batch[-1]
            cursor = JobCursor(float(score), job_id)
            if gone:  # expired jobs: prune the index as we go
                await self.client.zrem(index, *gone)
        await self._refresh_depth()
        return out[:limit]

    async def watch(self, job_id: str, owner: str | None = None) -> AsyncIterator[JobRecord]:
        outage: dict[str, float | None] = {"since": None}

        def unreachable(exc: BaseException) -> None:
            """Remember when the outage began; give up after ``watch_reconnect_s``."""
            since = outage["since"]
            if since is None:
                outage["since"] = since = time.monotonic()
                log.warning("watch %s: job queue unreachable (%s); reconnecting", job_id, exc)
            if time.monotonic() - since > self.watch_reconnect_s:
                raise _unreachable(exc) from exc

        async def get() -> JobRecord:
            while True:
                try:
                    record = await self._get(job_id, owner)
                    outage["since"] = None
                    return record
                except REFUSED_ERRORS as exc:
                    raise self._refused(exc) from exc
                except CONNECTION_ERRORS as exc:
                    await self._lost(exc)
                    unreachable(exc)
                    await asyncio.sleep(0.2)

        # Listening before the first read, so that no change slips in between.
        with self._job_events().listening(job_id) as changed:

            async def wait_change(timeout: float) -> None:
                # The timeout only guards against a missed message; changes arrive by pub/sub.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout)
                changed.clear()

            async for record in watch_changes(get, wait_change):
                yield record

    def _queue_up(self, up: bool) -> None:
        if self.metrics is not None:
            self.metrics.job_queue_up.labels(backend="redis").set(1 if up else 0)

    async def _lost(self, exc: BaseException) -> None:
        """The queue failed a command: down on the gauge until it answers again (the depth
        refresh looks every ``depth_interval_s``). After a failover error, close the pool's
        connections: the next command dials the address again and reaches the new primary."""
        self._queue_up(False)
        if isinstance(exc, FAILOVER_ERRORS) and self._client is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                await self._client.connection_pool.disconnect()

    def _refused(self, exc: BaseException) -> Unavailable:
        """A refusal for the client (no details) and the log."""
        self._queue_up(False)
        reason = refusal(exc, self.keys.prefix)
        self._log_at_most_every(REFUSED_S, "the job queue refused this sidecar: %s", reason)
        return Unavailable("the job queue refused this sidecar's Redis user (its log says why)")

    def _log_at_most_every(self, seconds: float, message: str, *args: object) -> None:
        """An error for the log, at most one per ``seconds``: every job call fails alike until
        someone fixes Redis, and one line says it."""
        now = time.monotonic()
        if now - self._error_logged >= seconds:
            self._error_logged = now
            log.error(message, *args)

    def _job_events(self) -> JobEvents:
        if self._events is None:
            self._events = JobEvents(self.client, self.keys)
        return self._events
