"""Space-Saving bounds against exact counts, merging, and the sliding-window ring."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from limelight.drift.sketch import SketchRing, SpaceSaving


def zipf_stream(n: int, seed: int, vocab: int = 2000) -> list[tuple[str, float]]:
    rng = random.Random(seed)
    return [(f"t{min(int(rng.paretovariate(1.1)), vocab)}", rng.random() + 0.01) for _ in range(n)]


def exact_mass(stream: list[tuple[str, float]]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for token, weight in stream:
        out[token] += weight
    return dict(out)


def assert_bounds(sketch: SpaceSaving, exact: dict[str, float], tol: float = 1e-9) -> None:
    for token, mass in exact.items():
        est = sketch.estimate(token)
        assert est.lower - tol <= mass <= est.upper + tol, (token, mass, est)
        if token not in sketch:
            assert mass <= sketch.floor + tol
    assert sketch.total == pytest.approx(sum(exact.values()))


@pytest.mark.parametrize("capacity", [1, 8, 64, 512])
def test_bounds_hold_against_exact_counts(capacity: int) -> None:
    stream = zipf_stream(20_000, seed=capacity)
    sketch = SpaceSaving(capacity)
    for token, weight in stream:
        sketch.add(token, weight)
    exact = exact_mass(stream)
    assert len(sketch) <= capacity
    assert_bounds(sketch, exact)
    # Classic guarantee: over-estimate and untracked mass are at most total / capacity.
    assert sketch.floor <= sketch.total / capacity + 1e-9
    assert max(sketch.errors.values()) <= sketch.total / capacity + 1e-9
    # Mass is conserved by Space-Saving's counts.
    assert sum(sketch.counts.values()) == pytest.approx(sketch.total)
    # Every token heavier than total / capacity is tracked (no false negatives).
    for token, mass in exact.items():
        if mass > sketch.total / capacity:
            assert token in sketch


def test_top_tokens_match_exact_ranking() -> None:
    stream = zipf_stream(50_000, seed=3)
    sketch = SpaceSaving(128)
    for token, weight in stream:
        sketch.add(token, weight)
    exact = exact_mass(stream)
    top_exact = sorted(exact, key=lambda t: -exact[t])[:10]
    top_sketch = sorted(sketch.counts, key=lambda t: -sketch.counts[t])[:10]
    assert top_sketch[:5] == top_exact[:5]
    assert set(top_sketch) == set(top_exact)


def test_no_eviction_is_exact() -> None:
    sketch = SpaceSaving(10)
    for token, weight in [("a", 1.0), ("b", 2.0), ("a", 0.5)]:
        sketch.add(token, weight)
    assert sketch.floor == 0.0
    assert sketch.estimate("a").lower == sketch.estimate("a").upper == 1.5
    assert sketch.estimate("zzz").upper == 0.0
    assert sketch.other() == 0.0


def test_non_positive_weights_are_ignored() -> None:
    sketch = SpaceSaving(4)
    sketch.add("a", 0.0)
    sketch.add("b", -1.0)
    sketch.add("c", float("nan"))
    assert len(sketch) == 0 and sketch.total == 0.0


@pytest.mark.parametrize("capacity", [16, 100])
def test_merge_keeps_bounds(capacity: int) -> None:
    streams = [zipf_stream(5_000, seed=10 + i) for i in range(5)]
    sketches = []
    for stream in streams:
        s = SpaceSaving(capacity)
        for token, weight in stream:
            s.add(token, weight)
        sketches.append(s)
    exact = exact_mass([x for stream in streams for x in stream])
    for cap in (capacity, 5 * capacity):
        merged = SpaceSaving.merge(sketches, cap)
        assert len(merged) <= cap
        assert_bounds(merged, exact)
    # A merged sketch keeps working as a stream sketch (its heap is rebuilt on demand).
    more = zipf_stream(3_000, seed=99)
    for token, weight in more:
        merged.add(token, weight)
    both = exact_mass([x for stream in [*streams, more] for x in stream])
    assert len(merged) <= 5 * capacity
    assert_bounds(merged, both)


def test_json_round_trip() -> None:
    s = SpaceSaving(8)
    for token, weight in zipf_stream(1000, seed=1):
        s.add(token, weight)
    back = SpaceSaving.from_json(s.to_json())
    assert back.counts == s.counts and back.errors == s.errors
    assert (back.total, back.floor, back.capacity) == (s.total, s.floor, s.capacity)
    back.add("new", 1.0)  # the rebuilt heap works
    assert len(back) <= 8


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abcdefghijklmnop"), st.floats(0.001, 10.0)),
        min_size=1,
        max_size=300,
    ),
    st.integers(1, 12),
)
def test_bounds_property(stream: list[tuple[str, float]], capacity: int) -> None:
    sketch = SpaceSaving(capacity)
    for token, weight in stream:
        sketch.add(token, weight)
    assert_bounds(sketch, exact_mass(stream), tol=1e-6)


def test_ring_keeps_a_bounded_sliding_window() -> None:
    ring: SketchRing[list[int]] = SketchRing(window=100, slots=10, factory=list)
    for i in range(1000):
        ring.advance().append(i)
        ring.tick()
    kept = [x for part in ring.parts() for x in part]
    assert len(ring.parts()) == 10
    assert len(kept) == 100  # 1000 is a multiple of the slot size: every slot is full
    assert kept == list(range(1000 - len(kept), 1000))  # exactly the newest observations


def test_ring_window_size_between_slot_boundaries() -> None:
    ring: SketchRing[list[int]] = SketchRing(window=100, slots=10, factory=list)
    for i in range(1001):
        ring.advance().append(i)
        ring.tick()
    kept = [x for part in ring.parts() for x in part]
    assert kept == list(range(910, 1001))


@pytest.mark.parametrize("window", [1, 2, 7, 10, 11, 15, 19, 25, 99, 150, 505, 1000])
def test_ring_holds_between_90_and_100_percent_of_its_window(window: int) -> None:
    """Once filled, the ring holds the newest observations, at most ``window`` and more than
    90 % of it (docs/drift.md); it used to round the slot size up and hold up to 133 % (20 of a
    window of 15)."""
    ring: SketchRing[list[int]] = SketchRing(window=window, slots=10, factory=list)
    held = set()
    for i in range(25 * window + 7):
        ring.advance().append(i)
        ring.tick()
        kept = [x for part in ring.parts() for x in part]
        assert kept == list(range(i + 1 - len(kept), i + 1))  # the newest, in order
        assert len(ring.parts()) <= min(10, window)
        if i + 1 >= window:
            held.add(len(kept))
    assert max(held) == window
    assert min(held) > 0.9 * window
    assert min(held) == window - -(-window // min(10, window)) + 1  # as the docstring says


def test_a_slot_filling_says_so_every_window_over_slots() -> None:
    ring: SketchRing[list[int]] = SketchRing(window=25, slots=10, factory=list)
    filled = []
    for i in range(50):
        ring.advance().append(i)
        if ring.tick():
            filled.append(i + 1)
    # slots of 3, 3, 3, 3, 3, 2, 2, 2, 2, 2: any ten in a row add up to 25
    assert filled == [3, 6, 9, 12, 15, 17, 19, 21, 23, 25, 28, 31, 34, 37, 40, 42, 44, 46, 48, 50]
