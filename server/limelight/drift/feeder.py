"""The drift monitor's own thread: answers hand their observation over and go.

Observing an answer is O(tokens) of Python (about 25 µs for a short review, 2 ms for a
4,000-token document). Done on the event loop before the answer is sent, every caller waited
for it and every other request's I/O waited behind it. The service instead hands each observed
answer to a :class:`DriftFeeder`, whose thread feeds the monitor when the process has a moment.

The queue is bounded in tokens (what an answer waiting in it holds in memory) and never blocks
the caller: when the monitor falls behind (a cheap model under more load than the process can
also observe), an answer that finds no room goes unobserved and is counted
(``limelight_drift_dropped_total``). Which answers that drops depends on the load at the time,
not on their words, so the window stays a sample of the traffic, as with
``LIMELIGHT_DRIFT_SAMPLE_RATE`` (docs/drift.md, "Sampling"); near full, a long answer finds no
room sooner than a short one.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

LINGER_S = 0.005
"""After a batch, the thread sleeps this long before it waits for the next answer, so that
under load it wakes (and takes the GIL from the event loop) once per batch, not per answer."""


class DropCounter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class DriftFeeder:
    """A bounded queue of observations and the one thread that runs them, in order: it takes
    everything queued at once, runs it, then lingers ``linger_s`` before waiting again.

    ``capacity``: the sizes (an answer's tokens) of the observations waiting add up to this at
    most (those being run not counted); one observation is taken whatever its size when nothing
    waits. ``dropped``: counted once per observation refused for want of room or because the
    feeder closed.
    """

    def __init__(
        self, capacity: int, dropped: DropCounter | None = None, linger_s: float = LINGER_S
    ) -> None:
        if capacity < 1:
            raise ValueError("a drift feeder needs a capacity of at least 1")
        self.capacity = capacity
        self.linger_s = linger_s
        self._dropped = dropped
        self._items: deque[Callable[[], object]] = deque()
        self._queued = 0
        """The sizes of the observations waiting, summed."""
        self._running = 0
        """Observations taken off the queue and not finished (one batch)."""
        self._closed = False
        self._closing = threading.Event()
        """Set by :meth:`close`: ends a linger at once."""
        lock = threading.Lock()
        self._work = threading.Condition(lock)
        """Notified when the queue gains its first observation or the feeder closes."""
        self._idle = threading.Condition(lock)
        """Notified when the queue runs empty (what :meth:`flush` waits for)."""
        self._thread = threading.Thread(target=self._run, name="drift-feeder", daemon=True)
        self._thread.start()

    def put(self, observe: Callable[[], object], size: int = 1) -> bool:
        """Queue ``observe`` (it feeds the monitor) of ``size`` (its answer's tokens); False,
        counted, if the queue has no room for it."""
        with self._work:
            room = not self._items or self._queued + size <= self.capacity
            if self._closed or not room:
                accepted = False
            else:
                self._items.append(observe)
                self._queued += size
                accepted = True
                if len(self._items) == 1:  # the thread only waits on an empty queue
                    self._work.notify()
        if not accepted and self._dropped is not None:
            self._dropped.inc()
        return accepted

    def pending(self) -> int:
        """Observations queued or being run."""
        with self._work:
            return len(self._items) + self._running

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has been observed; False if ``timeout`` ran out
        first (a report then reads the window as it stands)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._items and not self._running, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Refuse new observations, run the queued ones (up to ``timeout``) and stop."""
        with self._work:
            self._closed = True
            self._work.notify()
        self._closing.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        items, work, idle = self._items, self._work, self._idle
        while True:
            with work:
                work.wait_for(lambda: items or self._closed)
                if not items:
                    return  # closed, and everything queued was observed
                batch = list(items)
                items.clear()
                self._queued = 0
                self._running = len(batch)
            for observe in batch:
                try:
                    observe()
                except Exception:  # one bad observation must not stop the monitor
                    log.exception("drift observation failed")
            with idle:
                self._running = 0
                if not items:
                    idle.notify_all()
            if self.linger_s > 0:
                # Answers that come meanwhile are queued without waking this thread (nobody
                # waits on the condition): under load it wakes once per batch, not per answer.
                self._closing.wait(self.linger_s)
