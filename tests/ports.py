"""Loopback ports for tests that start real servers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it for a bound socket,
    which is then closed). Prefer binding to port 0 in the server itself where it can report
    the port it got; use this only for servers that must be told their port up front."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
