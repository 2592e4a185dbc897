"""``limelight worker``: consume the Redis job stream and run jobs (one at a time per process).

A worker heartbeats by re-claiming its own pending entry (``XCLAIM … JUSTID``), which resets
the entry's idle time; entries idle longer than ``job_reclaim_idle_s`` belong to dead workers and
are taken over with ``XAUTOCLAIM``. Each start counts an attempt; a job whose workers died
``job_max_attempts`` times is FAILED with that reason.

Redis faults never kill a worker (each restart would reload the model): while Redis is
unreachable the worker waits and retries with capped exponential backoff, keeps a running job
going, writes its outcome once Redis is back, and reports ``ready`` False (and
``limelight_job_queue_up`` 0) in the meantime. A refusal (wrong credentials, an ACL without a
key or command) is logged once as an error that says what the user needs, and asked again
every ``REFUSED_S``: the user may be fixed live.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from limelight.core.jobs import JobSpec, JobState
from limelight.jobs.execution import JobHooks, Outcome, StopReason, execute
from limelight.jobs.redis_store import (
    CONNECTION_ERRORS,
    FAILOVER_ERRORS,
    FULL_ERRORS,
    GROUP,
    REFUSED_ERRORS,
    REFUSED_S,
    Keys,
    connection,
    ensure_group,
    is_missing_group,
    lua,
    refusal,
    ttl_ms,
)
from limelight.jobs.runner import JobRunner
from limelight.jobs.serialize import spec_from_dict
from limelight.metrics import JobMetrics
from limelight.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Everything that makes the worker wait for Redis rather than fail.
_WAIT_ERRORS = CONNECTION_ERRORS + REFUSED_ERRORS + FULL_ERRORS


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
        metrics: JobMetrics | None = None,
        *,
        name: str | None = None,
        backoff_max_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.metrics = metrics
        self.keys = Keys(settings.jobs_queue)
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        url, options = connection(settings)
        self.client: Any = redis.Redis.from_url(url, **options)
        self._claim = self.client.register_script(lua("claim"))
        self._progress = self.client.register_script(lua("progress"))
        self._finish = self.client.register_script(lua("finish"))
        self._abandon_script = self.client.register_script(lua("abandon"))
        self._presence = self.client.register_script(lua("presence"))
        self._announced = -float("inf")
        self._reclaim_from = "0-0"  # where the next XAUTOCLAIM scan of the pending list starts
        self._stop = threading.Event()
        self._abandon = threading.Event()
        self._ready = threading.Event()
        self.idle_ms = max(1, int(settings.job_reclaim_idle_s * 1000))
        self.backoff_max_s = backoff_max_s
        self.refused_retry_s = REFUSED_S
        """Pause before asking again after Redis refused this worker."""
        self.jobs_done = 0
        self._warned: str | None = None  # "unreachable", "refused", "full": logged this outage
        self.outages = 0
        """How many times Redis became unreachable while this worker ran."""

    @property
    def ready(self) -> bool:
        """True while the worker is connected to its queue and consuming."""
        return self._ready.is_set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Finish the current job, then return from ``run``."""
        self._stop.set()

    def abandon(self) -> None:
        """Stop the current job at its next checkpoint and re-queue it."""
        self._stop.set()
        self._abandon.set()

    def _set_ready(self, ready: bool) -> None:
        """``limelight_job_queue_up`` on the worker's metrics port follows the queue connection
        (a worker exports no ``limelight_ready``: that series, and its alert, are the
        sidecar's model)."""
        if ready:
            self._ready.set()
        else:
            self._ready.clear()
        if self.metrics is not None:
            self.metrics.job_queue_up.labels(backend="redis").set(1 if ready else 0)

    # --- Redis faults --------------------------------------------------------------------------

    def _lost_connection(self, what: str, exc: BaseException) -> None:
        """Note an unreachable or refusing queue (each logged once per outage)."""
        if isinstance(exc, FAILOVER_ERRORS):  # the next command dials the new primary
            self.client.connection_pool.disconnect()
        kind = "unreachable"
        if isinstance(exc, REFUSED_ERRORS):
            kind = "refused"
        elif isinstance(exc, FULL_ERRORS):
            kind = "full"
        if self._ready.is_set() or self._warned != kind:
            if self._ready.is_set():
                self.outages += 1
            self._warned = kind
            self._set_ready(False)
            if kind == "refused":
                log.error(
                    "worker %s: the job queue refused it (%s): %s; asking again every %g s",
                    self.name,
                    what,
                    refusal(exc, self.keys.prefix),
                    self.refused_retry_s,
                )
            elif kind == "full":
                log.error(
                    "worker %s: Redis is out of memory (%s: %s): waiting until it takes writes "
                    "again (finished results expire after LIMELIGHT_JOB_RESULT_TTL_S; or raise "
                    "its maxmemory)",
                    self.name,
                    what,
                    exc,
                )
            else:
                log.warning(
                    "worker %s: job queue unreachable (%s: %s); retrying", self.name, what, exc
                )

    def _reconnected(self) -> None:
        if not self._ready.is_set():
            log.info("worker %s: job queue reachable", self.name)
            self._warned = None
            self._set_ready(True)

    def _unreachable(self, what: str, exc: BaseException, delay: float) -> float:
        """Note an outage, wait ``delay`` (or until stopped); the next, longer delay."""
        self._lost_connection(what, exc)
        if isinstance(exc, REFUSED_ERRORS):
            self._stop.wait(self.refused_retry_s)
            return delay
        self._stop.wait(delay)
        return min(self.backoff_max_s, delay * 2)

    def _retry(self, what: str, call: Callable[[], T], *, until_stop: bool = True) -> T | None:
        """``call()`` until Redis answers; None when the worker is asked to stop first
        (``until_stop``) or abandons."""
        delay, failed = 0.05, False
        while True:
            try:
                result = call()
            except _WAIT_ERRORS as exc:
                if (until_stop and self._stop.is_set()) or self._abandon.is_set():
                    return None
                delay, failed = self._unreachable(what, exc, delay), True
            else:
                if failed:
                    self._reconnected()
                return result

    def _ensure_group(self) -> bool:
        return ensure_group(self.client, self.keys)

    def _announce(self, *, due_only: bool = True) -> None:
        """Tell sidecars this worker consumes the queue, for ``job_reclaim_idle_s`` (renewed
        every third of it, idle or busy): a queued job's status then says whether any worker
        will take it, and ``limelight_job_workers`` counts them."""
        now = time.monotonic()
        if due_only and now - self._announced < self.idle_ms / 3000:
            return
        self._presence(keys=[self.keys.workers], args=[self.name, self.idle_ms])
        self._announced = now

    # --- the loop ------------------------------------------------------------------------------

    def run(self, max_jobs: int | None = None) -> None:
        """Consume until ``request_stop`` (or ``max_jobs`` jobs were handled)."""
        block_ms = max(10, min(1000, self.idle_ms // 2))
        if self._retry("creating the consumer group", self._ensure_group) is None:
            return
        log.info("worker %s consuming %s", self.name, self.keys.stream)
        delay = 0.05
        while not self._stop.is_set():
            if max_jobs is not None and self.jobs_done >= max_jobs:
                break
            try:
                self._announce()
                entry = self._reclaim() or self._read(block_ms)
            except _WAIT_ERRORS as exc:
                delay = self._unreachable("reading the queue", exc, delay)
                continue
            except redis.ResponseError as exc:
                if not is_missing_group(exc):
                    raise
                # Redis restarted without its data: the stream and group are gone.
                log.warning("worker %s: consumer group missing; re-creating it", self.name)
                self._retry("creating the consumer group", self._ensure_group)
                continue
            self._reconnected()
            delay = 0.05
            if entry is not None:
                self._handle(*entry)
        self._set_ready(False)
        self._leave_group()

    def _leave_group(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self.client.zrem(self.keys.workers, self.name)
        try:
            pending = self.client.xpending_range(
                self.keys.stream, GROUP, min="-", max="+", count=1, consumername=self.name
            )
            if not pending:
                self.client.xgroup_delconsumer(self.keys.stream, GROUP, self.name)
        except redis.RedisError:
            pass

    def _reclaim(self) -> tuple[str, str] | None:
        """One entry of a dead worker (idle past the reclaim time), if any.

        XAUTOCLAIM looks at no more than ten pending entries per call (COUNT x 10): the scan
        goes on from where the last call stopped, or a dead worker's entry behind ten older
        ones still being worked on would wait for them to finish."""
        reply = self.client.xautoclaim(
            self.keys.stream, GROUP, self.name, self.idle_ms, start_id=self._reclaim_from, count=1
        )
        self._reclaim_from = reply[0] or "0-0"  # "0-0" once the scan went round
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
        # The same token on every try of this claim: a try whose reply was lost is not counted
        # again as an attempt (the claim script sees its own token).
        token = uuid.uuid4().hex
        reply = self._retry(
            "claiming a job",
            lambda: self._claim(
                keys=[keys.job(job_id), keys.depth, keys.stream],
                args=[
                    self.name,
                    repr(time.time()),
                    self.settings.job_max_attempts,
                    ttl_ms(self.settings),
                    GROUP,
                    entry,
                    keys.idem(""),
                    keys.events(job_id),
                    token,
                ],
            ),
        )
        if reply is None:  # stopping while Redis was down: the entry stays pending
            return
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
        remote = {"cancel": False, "lost": False, "checked": 0.0}
        beat_stop = threading.Event()

        def heartbeat() -> None:
            # Re-claiming our own entry resets its idle time: we are alive.
            interval = self.settings.job_reclaim_idle_s / 3
            failing = False  # one line per outage, not one per beat
            while not beat_stop.wait(interval):
                try:
                    self.client.xclaim(keys.stream, GROUP, self.name, 0, [entry], justid=True)
                    self._announce(due_only=False)
                except redis.RedisError as exc:
                    if not failing:
                        log.warning("worker %s: heartbeat failed: %s", self.name, exc)
                    failing = True
                else:
                    if failing:
                        log.info("worker %s: heartbeat back", self.name)
                    failing = False

        def poll(progress: str = "", message: str = "") -> None:
            remote["checked"] = time.monotonic()
            try:
                flag = self._progress(
                    keys=[keys.job(job_id)],
                    args=[self.name, progress, message, keys.events(job_id)],
                )
            except _WAIT_ERRORS as exc:
                # Keep computing: the outcome is written once Redis is back.
                self._lost_connection(f"progress of job {job_id}", exc)
                return
            self._reconnected()
            remote["cancel"] = flag == "1"
            remote["lost"] = flag == "lost"

        def check() -> StopReason | None:
            if time.monotonic() - float(remote["checked"]) > 0.1:
                poll()
            if remote["lost"]:
                return StopReason.LOST
            if remote["cancel"]:
                return StopReason.CANCELLED
            return StopReason.RELEASE if self._abandon.is_set() else None

        def write_progress(fraction: float, message: str) -> None:
            poll(repr(fraction), message)

        def settle(outcome: Outcome) -> bool:
            if outcome.state is JobState.QUEUED:
                status = self._retry(
                    "re-queueing a job",
                    lambda: self._abandon_script(
                        keys=[keys.job(job_id), keys.stream, keys.depth],
                        args=[self.name, GROUP, entry, keys.events(job_id)],
                    ),
                    until_stop=False,
                )
                if status == "ok":
                    log.info("job %s re-queued: worker %s stopping", job_id, self.name)
                elif status == "lost":
                    log.warning("job %s: another worker owns it now; not re-queued", job_id)
                else:  # Redis unreachable while abandoning: the entry stays pending
                    log.warning(
                        "job %s not handed back (Redis unreachable): another worker takes it "
                        "over once it has been idle %gs",
                        job_id,
                        self.settings.job_reclaim_idle_s,
                    )
                return status == "ok"
            assert outcome.state is not None
            return self._done(entry, job_id, outcome)

        beat = threading.Thread(target=heartbeat, name="limelight-heartbeat", daemon=True)
        beat.start()
        try:
            execute(
                self.runner,
                self.settings,
                job_id,
                spec,
                JobHooks(check, write_progress, settle, where="worker"),
                waited=waited,
                metrics=self.metrics,
            )
        finally:
            beat_stop.set()
            beat.join()

    def _done(self, entry: str, job_id: str, outcome: Outcome) -> bool:
        keys = self.keys
        assert outcome.state is not None
        args = [
            self.name,
            outcome.state.value,
            repr(time.time()),
            ttl_ms(self.settings),
            outcome.error,
            outcome.message,
            outcome.result,
            "1.0" if outcome.state is JobState.SUCCEEDED else "",
            GROUP,
            entry,
            keys.idem(""),
            keys.events(job_id),
        ]
        # An outcome is worth waiting for even while stopping; only abandon() gives it up
        # (the entry stays pending and another worker reclaims the job).
        status = self._retry(
            "writing a job outcome",
            lambda: self._finish(keys=[keys.job(job_id), keys.stream], args=args),
            until_stop=False,
        )
        if status == "lost":
            log.warning("job %s finished here but another worker owns it now", job_id)
        return status == "ok"
