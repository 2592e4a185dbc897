"""Polling for a condition in tests, with a generous hang guard (not a speed limit)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

WAIT_S = 120.0
"""How long a poll waits for its condition before the test fails (generous: shared CI cores)."""


def wait_until(
    predicate: Callable[[], Any], interval: float = 0.02, timeout: float = WAIT_S
) -> Any:
    """Poll until ``predicate()`` is truthy and return its value; AssertionError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {predicate!r}")
        time.sleep(interval)


async def await_until(
    predicate: Callable[[], Any], interval: float = 0.02, timeout: float = WAIT_S
) -> Any:
    """``wait_until`` inside an event loop; ``predicate`` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {predicate!r}")
        await asyncio.sleep(interval)
