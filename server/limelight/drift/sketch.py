"""Bounded-memory heavy hitters with weights: a Space-Saving sketch and a sliding-window ring.

:class:`SpaceSaving` keeps at most ``capacity`` tokens with a count and an error. For every
token the true (weighted) mass lies in ``[count - error, count]``; a token that is not tracked
has a true mass of at most :attr:`SpaceSaving.floor`. Both ``error`` and ``floor`` are at most
``total / capacity`` for a sketch fed by :meth:`~SpaceSaving.add`, and merging keeps the
bounds valid (floors add up). Mass that the sketch cannot attribute to a tracked token with
certainty is the "other" bucket: ``total - sum(lower bounds)``.

:class:`SketchRing` is a sliding window: a ring of sub-window sketches. Adding goes to the
newest slot; when it is full, the oldest slot is dropped. Memory is ``slots x capacity``; the
window spans more than ``1 - 1 / slots`` of its size and at most its size.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

OTHER = "<other>"
"""Name of the bucket holding mass not attributed to a tracked token."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """A tracked token's mass: the truth lies in ``[lower, upper]``."""

    token: str
    lower: float
    upper: float

    @property
    def mid(self) -> float:
        return 0.5 * (self.lower + self.upper)


def json_number(data: dict[str, object], key: str) -> float:
    """``data[key]`` as a float; ValueError unless it is a finite number >= 0 (or such a
    numeric string): every number a drift file holds is a count or a sum of masses."""
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{key} must be a number, not {type(value).__name__}")
    number = float(value)
    if not (0.0 <= number < math.inf):  # also refuses NaN
        raise ValueError(f"{key} must be a finite number >= 0, not {value!r}")
    return number


def json_int(data: dict[str, object], key: str) -> int:
    """``data[key]`` as an int; ValueError unless it is an integer >= 0 (or such a string)."""
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{key} must be an integer, not {type(value).__name__}")
    number = int(json_number(data, key))
    if number != float(value):
        raise ValueError(f"{key} must be an integer, not {value!r}")
    return number


class SpaceSaving:
    """Weighted Space-Saving (Metwally et al.) over string tokens with positive weights."""

    __slots__ = ("_heap", "_heap_stale", "capacity", "counts", "errors", "floor", "total")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.counts: dict[str, float] = {}
        self.errors: dict[str, float] = {}
        self.total = 0.0
        self.floor = 0.0
        """Upper bound of the mass of any token that is not tracked."""
        # Min-heap of (count, token), one entry per tracked token. A count that grows leaves
        # its entry as it was (a lower bound): growing a tracked token, the common case, is a
        # dict update, and only an eviction pays to bring stale entries up to date.
        self._heap: list[tuple[float, str]] = []
        self._heap_stale = False

    def __len__(self) -> int:
        return len(self.counts)

    def __contains__(self, token: object) -> bool:
        return token in self.counts

    def add(self, token: str, weight: float) -> None:
        """Add ``weight`` (> 0) to ``token``; non-positive weights are ignored."""
        if not weight > 0.0:
            return
        self.total += weight
        counts = self.counts
        current = counts.get(token)
        if current is not None:
            counts[token] = current + weight
        elif len(counts) < self.capacity:
            # An untracked token may already hold up to `floor` (0 until something was dropped).
            counts[token] = self.floor + weight
            self.errors[token] = self.floor
            heapq.heappush(self._heap, (self.floor + weight, token))
        else:
            if self._heap_stale:
                self._rebuild_heap()
            smallest, victim = self._pop_min()
            del counts[victim]
            del self.errors[victim]
            # The newcomer inherits the victim's count as its possible over-estimate.
            self.floor = base = max(self.floor, smallest)
            counts[token] = base + weight
            self.errors[token] = base
            heapq.heappush(self._heap, (base + weight, token))

    def _pop_min(self) -> tuple[float, str]:
        """The tracked token with the smallest count (ties: the smallest token), off the heap.

        Every entry is at most its token's count, so the first entry that is up to date is
        the smallest count; a stale one goes back with its count."""
        heap = self._heap
        counts = self.counts
        while True:
            count, token = heap[0]
            current = counts[token]
            if current == count:
                heapq.heappop(heap)
                return count, token
            heapq.heapreplace(heap, (current, token))

    def _rebuild_heap(self) -> None:
        self._heap = [(c, t) for t, c in self.counts.items()]
        heapq.heapify(self._heap)
        self._heap_stale = False

    def estimate(self, token: str) -> Estimate:
        """Bounds of ``token``'s mass (``[0, floor]`` when it is not tracked)."""
        count = self.counts.get(token)
        if count is None:
            return Estimate(token, 0.0, self.floor)
        return Estimate(token, count - self.errors[token], count)

    def items(self) -> Iterator[Estimate]:
        for token, count in self.counts.items():
            yield Estimate(token, count - self.errors[token], count)

    def other(self) -> float:
        """Mass not attributed with certainty to a tracked token (the "other" bucket)."""
        tracked = sum(c - self.errors[t] for t, c in self.counts.items())
        return max(self.total - tracked, 0.0)

    def copy(self) -> SpaceSaving:
        out = SpaceSaving(self.capacity)
        out.counts = dict(self.counts)
        out.errors = dict(self.errors)
        out.total = self.total
        out.floor = self.floor
        out._heap = list(self._heap)
        out._heap_stale = self._heap_stale
        return out

    @classmethod
    def merge(cls, sketches: Iterable[SpaceSaving], capacity: int | None = None) -> SpaceSaving:
        """Combine sketches of disjoint streams; keep the ``capacity`` largest counts.

        A token missing from a sketch gets that sketch's floor as count and as error, so the
        bounds ``[count - error, count]`` stay valid; the result's floor is the sum of floors,
        or the largest count dropped by truncation if that is higher.
        """
        parts = list(sketches)
        if not parts:
            raise ValueError("nothing to merge")
        cap = capacity if capacity is not None else max(p.capacity for p in parts)
        floors = sum(p.floor for p in parts)
        # count(t) = sum over parts of (its count there, or that part's floor)
        #          = floors + sum over parts tracking t of (count - floor); errors likewise.
        # One pass over the entries instead of one lookup per token and part.
        counts: dict[str, float] = {}
        errors: dict[str, float] = {}
        for p in parts:
            f = p.floor
            p_errors = p.errors
            for token, c in p.counts.items():
                counts[token] = counts.get(token, floors) + (c - f)
                errors[token] = errors.get(token, floors) + (p_errors[token] - f)
        out = cls(cap)
        out.total = sum(p.total for p in parts)
        out.floor = floors
        if len(counts) > cap:
            ranked = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)
            out.floor = max(floors, ranked[cap][1])
            counts = dict(ranked[:cap])
            errors = {t: errors[t] for t in counts}
        out.counts = counts
        out.errors = errors
        out._heap_stale = True  # merged sketches are mostly read: build the heap on first need
        return out

    def to_json(self) -> dict[str, object]:
        tokens = sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return {
            "capacity": self.capacity,
            "total": self.total,
            "floor": self.floor,
            "tokens": [[t, c, self.errors[t]] for t, c in tokens],
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> SpaceSaving:
        capacity = json_int(data, "capacity")
        out = cls(capacity)
        out.total = json_number(data, "total")
        out.floor = json_number(data, "floor")
        rows = data["tokens"]
        if not isinstance(rows, list) or len(rows) > capacity:
            raise ValueError("sketch tokens must be a list of at most `capacity` rows")
        for row in rows:
            token, count, error = row
            count, error = float(count), float(error)
            if not (0.0 <= error <= count < math.inf):
                raise ValueError(f"bad sketch row for {token!r}: count {count}, error {error}")
            out.counts[str(token)] = count
            out.errors[str(token)] = error
        out._rebuild_heap()
        return out


T = TypeVar("T")


class SketchRing(Generic[T]):
    """A sliding window of ``slots`` sub-windows whose sizes add up to ``window`` observations.

    Holds any per-slot state built by ``factory`` (e.g. a group of sketches and counters).
    Slot sizes take turns between ``window // slots`` and one more, so that any ``slots``
    consecutive slots hold exactly ``window`` observations. A new slot opens (and the oldest
    is dropped) when an observation arrives and the newest slot is full, so once it has
    filled the window spans between ``window - ceil(window / slots) + 1`` and ``window``
    observations: more than 90 % of ``window`` with 10 slots, and exactly ``window`` when it is
    at most ``slots`` (one observation per slot). Use :meth:`advance` to get the slot for an
    observation, then :meth:`tick`.
    """

    def __init__(self, window: int, slots: int, factory: Callable[[], T]) -> None:
        if window < 1 or slots < 1:
            raise ValueError("window and slots must be positive")
        slots = min(slots, window)
        base, extra = divmod(window, slots)
        self.sizes = [base + 1 if i < extra else base for i in range(slots)]
        """The size of each slot, by its position in the turn (they add up to ``window``)."""
        self.slots = slots
        self._factory = factory
        self._ring: list[T] = [factory()]
        self._opened = 0
        """Slots opened so far, less one: the newest slot's position in the turn."""
        self._filled = 0

    @property
    def per_slot(self) -> int:
        """Observations the newest slot holds when full."""
        return self.sizes[self._opened % self.slots]

    def advance(self) -> T:
        """The slot the next observation goes to (opening a new one when the newest is full)."""
        if self._filled >= self.per_slot:
            self._filled = 0
            self._opened += 1
            self._ring.append(self._factory())
            if len(self._ring) > self.slots:
                self._ring.pop(0)
        return self._ring[-1]

    def tick(self) -> bool:
        """Count one observation in the newest slot; True when that filled it."""
        self._filled += 1
        return self._filled == self.per_slot

    def parts(self) -> list[T]:
        return list(self._ring)
