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
