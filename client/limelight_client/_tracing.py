"""The caller's trace context for inputs sent on pooled streams, when OpenTelemetry is there.

A unary call carries its caller's W3C ``traceparent`` in gRPC metadata (put there by the
application's gRPC instrumentation, if it has one). A pooled stream ("lane", ``_lanes``) is
opened once and carries later calls of other callers, whose contexts its metadata cannot hold:
each input carries its own in ``ExplainRequest.trace_context``. The SDK does not depend on
OpenTelemetry; without ``opentelemetry-api`` installed (or with no span current) nothing is sent.
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
