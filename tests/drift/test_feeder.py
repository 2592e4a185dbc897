"""The drift monitor's thread: observations run in order, off the caller's thread; a full
queue refuses (and counts) instead of blocking; flush and close wait for what was queued."""

from __future__ import annotations

import threading
from functools import partial

import pytest
from prometheus_client import CollectorRegistry, Counter

from limelight.drift.feeder import DriftFeeder

WAIT_S = 30.0
"""A hang guard, not a speed limit: each wait below ends as soon as the thread gets there."""


def test_observations_run_in_order_on_the_feeder_thread() -> None:
    feeder = DriftFeeder(capacity=100)
    seen: list[tuple[int, str]] = []

    def observe(i: int) -> None:
        seen.append((i, threading.current_thread().name))

    for i in range(50):
        assert feeder.put(partial(observe, i))
    assert feeder.flush(WAIT_S)
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"drift-feeder"}
    assert feeder.pending() == 0
    feeder.close(WAIT_S)


class HeldFeeder:
    """A feeder with a drop counter, whose thread one observation can hold busy (its queue
    then empty) until :meth:`let_go`."""

    def __init__(self, capacity: int) -> None:
        self.registry = CollectorRegistry()
        dropped = Counter("dropped", "refused observations", registry=self.registry)
        self.feeder = DriftFeeder(capacity=capacity, dropped=dropped)
        self._started, self._release = threading.Event(), threading.Event()

    def hold(self, size: int = 1) -> None:
        self._started.clear()
        self._release.clear()
        assert self.feeder.put(self._held, size=size)
        assert self._started.wait(WAIT_S)  # running: taken off the queue

    def _held(self) -> None:
        self._started.set()
        self._release.wait(WAIT_S)

    def let_go(self) -> None:
        self._release.set()
        assert self.feeder.flush(WAIT_S)

    def dropped(self) -> float | None:
        return self.registry.get_sample_value("dropped_total")


def test_a_full_queue_refuses_and_counts_without_blocking() -> None:
    held = HeldFeeder(capacity=2)
    feeder = held.feeder
    ran: list[int] = []
    held.hold()
    assert feeder.put(partial(ran.append, 1))
    assert feeder.put(partial(ran.append, 2))
    assert not feeder.put(partial(ran.append, 3))  # full: refused at once
    assert not feeder.put(partial(ran.append, 4))
    assert held.dropped() == 2
    assert feeder.pending() == 3
    assert not feeder.flush(0.05)  # still held
    held.let_go()
    assert ran == [1, 2]
    feeder.close(WAIT_S)


def test_the_capacity_counts_sizes_and_one_of_any_size_passes_alone() -> None:
    held = HeldFeeder(capacity=100)
    feeder = held.feeder
    ran: list[str] = []
    held.hold(size=500)  # nothing waited: taken whatever its size
    assert feeder.put(partial(ran.append, "long"), size=500)  # alone in the queue: taken
    assert not feeder.put(partial(ran.append, "short"), size=1)  # no room left
    held.let_go()
    held.hold()
    assert feeder.put(partial(ran.append, "a"), size=60)
    assert not feeder.put(partial(ran.append, "b"), size=41)  # 101 > 100
    assert feeder.put(partial(ran.append, "c"), size=40)  # exactly full
    held.let_go()
    assert ran == ["long", "a", "c"]
    assert held.dropped() == 2
    feeder.close(WAIT_S)


def test_a_failing_observation_is_logged_and_the_next_ones_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    feeder = DriftFeeder(capacity=10)
    ran: list[int] = []

    def fail() -> None:
        raise ValueError("3 tokens but 2 scores")

    feeder.put(fail)
    feeder.put(lambda: ran.append(1))
    assert feeder.flush(WAIT_S)
    assert ran == [1]
    assert "drift observation failed" in caplog.text
    feeder.close(WAIT_S)


def test_close_runs_what_was_queued_and_refuses_the_rest() -> None:
    feeder = DriftFeeder(capacity=10)
    release = threading.Event()
    ran: list[int] = []
    feeder.put(lambda: release.wait(WAIT_S))
    for i in range(5):
        feeder.put(partial(ran.append, i))
    release.set()
    feeder.close(WAIT_S)
    assert ran == list(range(5))
    assert not feeder.put(lambda: ran.append(99))
    assert ran == list(range(5))


def test_answers_that_come_while_it_lingers_are_taken_in_one_batch() -> None:
    feeder = DriftFeeder(capacity=10, linger_s=600.0)  # close() ends the linger
    batch_sizes: list[int] = []

    def observe() -> None:
        batch_sizes.append(feeder._running)

    feeder.put(observe)
    assert feeder.flush(WAIT_S)
    for _ in range(3):  # the thread sleeps: queued without waking it
        feeder.put(observe)
    assert feeder.pending() == 3
    assert batch_sizes == [1]
    feeder.close(WAIT_S)
    assert batch_sizes == [1, 3, 3, 3]


def test_capacity_must_hold_one() -> None:
    with pytest.raises(ValueError):
        DriftFeeder(capacity=0)
