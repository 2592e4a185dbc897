"""How the inline bench times explain against the plain forward: alternating pairs, the median
of per-pair ratios, short calls repeated until the pairs fill a minimum time. A clock that only
the timed calls advance makes every figure exact."""

from __future__ import annotations

import pytest

from limelight.evaluation import benchmark


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def step(self, name: str, seconds: float) -> None:
        self.calls.append(name)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(benchmark.time, "perf_counter", fake)
    return fake


def test_pairs_alternate_and_the_ratio_is_the_median_of_the_pairs(clock: Clock) -> None:
    # The machine slows down half-way: the first call takes 1 then 3 s, the second 2 then 6 s.
    # Separate medians would mix the two phases; every pair's ratio is still exactly 2.
    costs = {"forward": [1.0] * 4 + [3.0] * 5, "explain": [2.0] * 4 + [6.0] * 5}

    def timed(name: str) -> None:
        clock.step(name, costs[name].pop(0))

    first, second, ratio = benchmark.paired_seconds(
        lambda: timed("forward"), lambda: timed("explain"), repeats=7, min_seconds=0, warmup=2
    )
    assert ratio == 2.0
    assert (first, second) == (3.0, 6.0)
    timed_calls = clock.calls[4:]  # after the warm-up pairs
    assert len(timed_calls) == 14
    pairs = [tuple(timed_calls[i : i + 2]) for i in range(0, 14, 2)]
    assert pairs[0] == ("explain", "forward") and pairs[1] == ("forward", "explain")
    assert all(set(p) == {"forward", "explain"} for p in pairs)
    assert pairs[0::2] == [pairs[0]] * 4 and pairs[1::2] == [pairs[1]] * 3


def test_short_calls_repeat_until_the_minimum_time(clock: Clock) -> None:
    def tiny() -> None:
        clock.step("tiny", 0.001)

    benchmark.paired_seconds(tiny, tiny, repeats=3, min_seconds=0.5, warmup=0)
    assert len(clock.calls) >= 500  # 0.5 s of 1 ms calls, far more than three pairs
    clock.calls.clear()
    benchmark.paired_seconds(tiny, tiny, repeats=3, min_seconds=0.0, warmup=0)
    assert len(clock.calls) == 6


def test_the_after_idle_baseline_sleeps_before_each_call_and_times_only_the_call(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(benchmark.time, "sleep", lambda s: clock.step(f"sleep {s}", s))
    costs = [5.0, 1.0, 2.0, 3.0]  # the warm-up call, then the timed ones

    def call() -> None:
        clock.step("call", costs.pop(0))

    assert benchmark.median_seconds(call, repeats=3, warmup=1, idle_s=0.25) == 2.0
    assert clock.calls == ["call"] + ["sleep 0.25", "call"] * 3
    clock.calls.clear()
    costs[:] = [1.0, 4.0]
    assert benchmark.median_seconds(call, repeats=1, warmup=1) == 4.0  # back to back
    assert clock.calls == ["call", "call"]
