"""Reading an HTTP request body: every way a client can send a broken one is its mistake
(``InvalidArgument``, a 400), never the server's (a 500 with a traceback in the log)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from limelight.errors import InvalidArgument

_UNREADABLE = web.RequestKey("limelight.body_unreadable", bool)


@dataclass
class BodyLimits:
    """How long a request body may take to arrive, and how many may be read at once: a client
    that announces a large body and sends it slowly (or never ends it) held its buffer for as
    long as it liked, and a few hundred such connections took gigabytes."""

    timeout_s: float
    slots: asyncio.Semaphore


BODY_LIMITS = web.AppKey("limelight.body_limits", BodyLimits)


def close_if_unread(request: web.Request, response: web.StreamResponse) -> None:
    """After a body ``read_body`` could not read, the stream is in no state for another
    request on the same connection: the answer closes it."""
    if request.get(_UNREADABLE):
        response.force_close()


async def read_body(request: web.Request) -> bytes:
    """The body's bytes. A body its ``Content-Encoding`` does not describe (gzip named over
    plain bytes), or one cut short, is refused; a body over the size limit stays aiohttp's 413."""
    limits = request.config_dict.get(BODY_LIMITS)
    try:
        if limits is None:
            return await request.read()
        async with asyncio.timeout(limits.timeout_s), limits.slots:
            return await request.read()
    except TimeoutError:
        request.content.feed_eof()
        request[_UNREADABLE] = True
        assert limits is not None
        raise InvalidArgument(
            f"the request body did not arrive within {limits.timeout_s:g} s "
            "(LIMELIGHT_HTTP_BODY_TIMEOUT_S)"
        ) from None
    except web.RequestPayloadError as exc:
        # Nothing more of it can be read: marked as ended, so that aiohttp does not try to
        # read the rest after the answer (and log that failure as its own), and the
        # connection closed after the answer (see ``close_if_unread``).
        request.content.feed_eof()
        request[_UNREADABLE] = True
        why = getattr(exc.__cause__, "message", None) or str(exc)
        raise InvalidArgument(f"the request body could not be read: {why}") from None


def parse_json(body: bytes) -> Any:
    """``body`` parsed as JSON."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # arrays nested thousands deep
        raise InvalidArgument("the request body is not valid JSON: nested too deep") from None
