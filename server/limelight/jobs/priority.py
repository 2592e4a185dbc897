"""Inline traffic before jobs: a gate the inline batcher holds while it runs forward passes.

The inline batcher calls ``enter()`` before and ``exit()`` after each forward pass; job workers
call ``wait_idle(timeout)`` at every checkpoint of a job method. A job therefore never starts
its next step while an inline batch is being computed, and inline latency stays close to what it
is without jobs. The wait is bounded so that a constant stream of inline traffic slows jobs down
but cannot starve them forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class InlineGate:
    """Thread-safe count of inline forward passes in progress."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._yields = 0

    def enter(self) -> None:
        """An inline forward pass starts."""
        with self._cond:
            self._active += 1

    def exit(self) -> None:
        """An inline forward pass ended."""
        with self._cond:
            if self._active <= 0:
                raise RuntimeError("InlineGate.exit() without a matching enter()")
            self._active -= 1
            if self._active == 0:
                self._cond.notify_all()

    @contextmanager
    def inline(self) -> Iterator[None]:
        """``with gate.inline(): forward(...)`` — enter/exit around one forward pass."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    @property
    def active(self) -> int:
        """Inline forward passes in progress now."""
        with self._cond:
            return self._active

    @property
    def yields(self) -> int:
        """How many times a job waited for inline traffic (for tests and debugging)."""
        with self._cond:
            return self._yields

    def wait_idle(self, timeout: float) -> bool:
        """Block until no inline pass runs, at most ``timeout`` seconds. True when idle."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            if self._active == 0:
                return True
            self._yields += 1
            while self._active > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True
