"""Loopback ports picked up front, for servers that must be told their port before they bind
(the test suite's servers, `limelight bench --rpc http`'s HTTP port)."""

from __future__ import annotations

import functools
import itertools
import os
import random
import socket
from pathlib import Path

# Ports the kernel hands out for outgoing connections and bind(0) (Linux default 32768-60999).
# A port picked inside that range can be taken by any client socket between the check and the
# server's bind (CI lost a metrics port that way), so ports are picked below it instead, where
# only an explicit bind can take them.
_FALLBACK_EPHEMERAL_LOW = 32768
_LOWEST = 10000


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


@functools.cache  # one order per process, read on first use (not at import)
def _candidates() -> itertools.cycle[int]:
    high = _ephemeral_low()
    if high - _LOWEST < 1000:  # an unusual range: fall back to whatever the kernel gives
        return itertools.cycle([0])
    ports = list(range(_LOWEST, high))
    # Each process walks its own shuffled order, so concurrent processes rarely try the
    # same port, and one process never hands out a port twice before the whole range is used.
    random.Random(os.getpid()).shuffle(ports)
    return itertools.cycle(ports)


def _bindable(port: int) -> int | None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return None
        return int(s.getsockname()[1])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, from outside the kernel's ephemeral
    range so that outgoing connections cannot take it before the server binds it. Prefer binding
    to port 0 in the server itself where it can report the port it got; use this only for
    servers that must be told their port up front."""
    for _ in range(1000):
        port = _bindable(next(_candidates()))
        if port is not None:
            return port
    raise RuntimeError("no free loopback port found below the ephemeral range")
