"""The caller's trace context, when OpenTelemetry is there.

Every call carries it as W3C ``traceparent`` metadata (``ClientBase._call_metadata``; an
application's gRPC instrumentation, if it has one, puts its own client span's there instead).
A pooled stream ("lane", ``_lanes``) is opened once and carries later calls of other callers,
whose contexts its metadata cannot hold: each of their inputs carries its own in
``ExplainRequest.trace_context``. The SDK does not depend on OpenTelemetry; without
``opentelemetry-api`` installed (or with no span current) nothing is sent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping
from typing import Any


@functools.cache
def _injector() -> Callable[[MutableMapping[str, str]], Any] | None:
    try:
        from opentelemetry.propagate import inject
    except ImportError:
        return None
    return inject


def trace_context() -> dict[str, str]:
    """The current OpenTelemetry context as W3C headers, through the application's configured
    propagators; empty without OpenTelemetry or outside any span."""
    inject = _injector()
    if inject is None:
        return {}
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier
