"""Job changes announced over one pub/sub connection per process, for every watch.

Every change of a job publishes a message on its events channel (``Keys.events``). A watch used
to subscribe with a pub/sub connection of its own, held for as long as the watch lasted: the
Redis client's pool (100 connections by default) then capped the watches a sidecar could hold
at once, and the hundredth left no connection for submits and reads — every job RPC answered
UNAVAILABLE. Here one task holds one pattern subscription to every job's channel and wakes the
watches of the job a message names; a watch costs an ``asyncio.Event`` and the short reads of
its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import redis

from limelight.jobs.redis_store import CONNECTION_ERRORS, REFUSED_ERRORS, REFUSED_S, Keys

log = logging.getLogger(__name__)

#: How long the subscriber waits for a message before it looks again (and health-checks the
#: connection); not a latency: messages are handled as they come.
IDLE_S = 10.0
#: Pause before subscribing again after the connection broke.
RECONNECT_S = 0.2


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


class JobEvents:
    """Wakes the watchers of a job whenever its events channel gets a message.

    The subscriber task starts with the first watch (inside the running loop). When its
    connection breaks it wakes every watcher — a change may be missed while it is away, and a
    watcher's own read finds out whether Redis is reachable — and subscribes again."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self._client = client
        self._prefix = keys.events("")
        self._pattern = _glob_escape(self._prefix) + "*"
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def watched(self) -> int:
        """Jobs with at least one watcher."""
        return len(self._watchers)

    @contextlib.contextmanager
    def listening(self, job_id: str) -> Iterator[asyncio.Event]:
        """An event set on every message about ``job_id`` (the caller clears it) while the
        block runs."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="job-events")
        changed = asyncio.Event()
        self._watchers.setdefault(job_id, set()).add(changed)
        try:
            yield changed
        finally:
            watchers = self._watchers.get(job_id)
            if watchers is not None:
                watchers.discard(changed)
                if not watchers:
                    del self._watchers[job_id]

    def _wake(self, job_id: str) -> None:
        for changed in self._watchers.get(job_id, ()):
            changed.set()

    def _wake_all(self) -> None:
        for watchers in self._watchers.values():
            for changed in watchers:
                changed.set()

    async def _run(self) -> None:
        refused = False
        while True:
            pause = RECONNECT_S
            pubsub = self._client.pubsub()
            try:
                await pubsub.psubscribe(self._pattern)
                self._wake_all()  # a change may have come while nothing was subscribed
                while True:
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=IDLE_S
                    )
                    if refused:  # a refusal is the first reply read, so not this time
                        log.info("job events: subscribed to %s", self._pattern)
                        refused = False
                    channel = message.get("channel") if message else None
                    if isinstance(channel, str) and channel.startswith(self._prefix):
                        self._wake(channel[len(self._prefix) :])
            except redis.RedisError as exc:
                if isinstance(exc, CONNECTION_ERRORS) and not isinstance(exc, REFUSED_ERRORS):
                    log.debug("job events: subscription lost (%s); subscribing again", exc)
                else:
                    # Such as NOPERM: an ACL must grant the pattern literally
                    # (``&prefix:events:*``); or a password that stopped working.
                    if not refused:
                        log.warning(
                            "job events: Redis refused the subscription to %s (%s); WatchJob "
                            "polls each job every second instead (the README's Redis ACL "
                            "grants it)",
                            self._pattern,
                            exc,
                        )
                    # Watches poll their job meanwhile (``watch_changes``): nothing waits on it.
                    refused, pause = True, REFUSED_S
                self._wake_all()
            finally:
                with contextlib.suppress(redis.RedisError, OSError):
                    await pubsub.aclose()
            await asyncio.sleep(pause)

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_until_done(task)
        self._wake_all()


async def cancel_until_done(task: asyncio.Task[Any] | None, again_s: float = 1.0) -> None:
    """Cancel ``task`` and wait for it to end, cancelling it again every ``again_s``: redis-py
    may turn a cancellation that lands inside a command (over TLS, mid-read) into a connection
    error, which a loop that outlives connection errors takes in its stride, and a single
    cancel would then leave shutdown waiting on that loop for ever."""
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=again_s)
    if task is not None and not task.cancelled():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            task.result()  # retrieved: asyncio logs an exception nobody read as an error
