"""Each caller's share of the inline backlog (``LIMELIGHT_MAX_PENDING_PER_CALLER``), so that one
tenant sending faster than the model serves cannot fill ``LIMELIGHT_MAX_PENDING`` for everyone.

A caller is who the API layer says is calling: a bearer token's identity or a client
certificate's subject; without auth every caller is the same anonymous one. In-process callers
(``None``) are not counted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from limelight.errors import InvalidArgument, ResourceExhausted


class CallerShares:
    """Inputs each caller has admitted and not yet answered, at most ``limit`` (None: no limit).

    A unary call or a batch is admitted whole or refused (RESOURCE_EXHAUSTED while the caller
    has too many waiting; INVALID_ARGUMENT for a batch no share could ever hold); a stream's
    input waits for its caller's room instead, which paces the stream rather than ending it."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}
        self._freed: asyncio.Event | None = None  # made inside the running loop

    def held(self, caller: str) -> int:
        return self._held.get(caller, 0)

    @contextlib.contextmanager
    def take(self, caller: str | None, n: int = 1) -> Iterator[None]:
        """Hold ``n`` of ``caller``'s share for the block, or refuse now."""
        if self.limit is None or caller is None or n == 0:
            yield
            return
        if n > self.limit:
            raise InvalidArgument(
                f"this call brings {n} inputs, more than the {self.limit} one caller may have "
                "waiting (LIMELIGHT_MAX_PENDING_PER_CALLER): send them in smaller calls, or as "
                "a stream (ExplainStream), which is paced instead"
            )
        held = self.held(caller)
        if held + n > self.limit:
            raise ResourceExhausted(
                f"too many of your inline requests are waiting ({held}, limit {self.limit} per "
                "caller); retry later"
            )
        self._held[caller] = held + n
        try:
            yield
        finally:
            self._give(caller, n)

    @contextlib.asynccontextmanager
    async def wait(self, caller: str | None) -> AsyncIterator[None]:
        """Hold one of ``caller``'s share for the block, waiting for room."""
        if self.limit is None or caller is None:
            yield
            return
        if self._freed is None:
            self._freed = asyncio.Event()
        while self.held(caller) >= self.limit:
            # Nothing runs between the check and the wait: a share given back in between
            # cannot be missed.
            self._freed.clear()
            await self._freed.wait()
        self._held[caller] = self.held(caller) + 1
        try:
            yield
        finally:
            self._give(caller, 1)

    def _give(self, caller: str, n: int) -> None:
        left = self._held[caller] - n
        if left:
            self._held[caller] = left
        else:
            del self._held[caller]  # a caller seen once is not kept for good
        if self._freed is not None:
            self._freed.set()  # the waiters look again
