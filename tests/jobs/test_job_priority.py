"""The inline gate: jobs wait at checkpoints while inline forward passes run."""

from __future__ import annotations

import threading

import pytest

from limelight.jobs.priority import InlineGate


def test_idle_gate_does_not_wait() -> None:
    gate = InlineGate()
    assert gate.wait_idle(0.0) is True
    assert gate.yields == 0


def test_busy_gate_times_out_then_opens_on_exit() -> None:
    gate = InlineGate()
    gate.enter()
    gate.enter()
    assert gate.active == 2
    assert gate.wait_idle(0.01) is False
    gate.exit()
    assert gate.wait_idle(0.0) is False  # one pass still running
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(gate.wait_idle(600)))
    waiter.start()
    gate.exit()
    waiter.join()
    assert result == [True]
    assert gate.active == 0


def test_context_manager_and_unbalanced_exit() -> None:
    gate = InlineGate()
    with gate.inline():
        assert gate.active == 1
    assert gate.active == 0
    with pytest.raises(RuntimeError):
        gate.exit()
