"""`free_port`: ports for servers that must be told their port before they bind."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest

from limelight.api import ports
from limelight.api.ports import free_port


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_ports_come_from_below_the_ephemeral_range_and_can_be_bound() -> None:
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)  # no port handed out twice in a row
    for port in ports:
        assert 1024 <= port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free a moment ago, still free


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        spare = free_port()
        # The next candidates are the held port, then a free one: the held one is passed over.
        order = itertools.cycle([taken, spare])
        monkeypatch.setattr(ports, "_candidates", lambda: order)
        assert free_port() == spare
