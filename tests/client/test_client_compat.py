"""The SDK supports Python 3.10, whose asyncio raises its own ``asyncio.TimeoutError`` (not the
builtin, as from 3.11): every timed wait of the asyncio client goes through ``_streams.wait_for``,
which raises the builtin either way. Simulated here on the interpreter the suite runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from limelight_client import _streams


class AsyncioTimeoutError310(Exception):
    """What ``asyncio.TimeoutError`` is on Python 3.10: not a ``TimeoutError``."""


def test_wait_for_raises_the_builtin_timeout_error_as_on_310(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def wait_for_310(aw: Awaitable[Any], timeout: float | None) -> Any:
        if asyncio.iscoroutine(aw):
            aw.close()
        raise AsyncioTimeoutError310

    monkeypatch.setattr(asyncio, "TimeoutError", AsyncioTimeoutError310)
    monkeypatch.setattr(asyncio, "wait_for", wait_for_310)
    with pytest.raises(TimeoutError):
        asyncio.run(_streams.wait_for(asyncio.sleep(1), 0.01))


def test_wait_for_returns_what_it_waited_for() -> None:
    async def answer() -> int:
        return 42

    assert asyncio.run(_streams.wait_for(answer(), 1)) == 42
    with pytest.raises(TimeoutError):
        asyncio.run(_streams.wait_for(asyncio.sleep(1), 0.01))


def test_no_direct_asyncio_wait_for_in_the_sdk() -> None:
    package = Path(_streams.__file__).parent
    offenders = [
        path.name
        for path in package.glob("*.py")
        if path.name != "_streams.py" and "asyncio.wait_for(" in path.read_text()
    ]
    assert offenders == []
