"""Progress of long work (model builds, labelling, evaluation, calibration), drawn for whoever
reads it.

On a terminal it is a tqdm bar redrawn in place (in a notebook, tqdm's widget). Standard error
redirected to a file or a pipe — a log, CI, the log of a build the sidecar started in the
background — gets plain lines instead, one every ``interval_s`` and one at the end
(``shapley labels: 2,310 of 8,200 texts (28 %), 3:05 elapsed, about 8 minutes left``): a
redrawn bar would land there frame by frame, thousands of carriage returns and cursor moves.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, Generic, TextIO, TypeVar

from limelight.build_progress import about

T = TypeVar("T")

#: Seconds between two plain progress lines: a ten-minute build writes twenty.
PLAIN_INTERVAL_S = 30.0


def progress_bar(
    iterable: Iterable[T] | None = None,
    *,
    total: float | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
    file: TextIO | None = None,
    tty: bool | None = None,
    interval_s: float = PLAIN_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
    **tqdm_options: Any,
) -> Any:
    """A progress bar with tqdm's interface (``update``, ``n``, ``total``, ``set_description``,
    ``set_postfix``, ``close``, iteration, ``with``): tqdm's own where ``file`` (default standard
    error) is a terminal or a notebook shows it, else a :class:`PlainProgress`. ``tty`` decides
    otherwise; ``enabled=False`` draws nothing either way. ``tqdm_options`` go to the drawn
    bar only (e.g. ``dynamic_ncols``)."""
    from tqdm.autonotebook import tqdm as auto_tqdm
    from tqdm.std import tqdm as terminal_tqdm

    stream = file if file is not None else sys.stderr
    notebook = auto_tqdm is not terminal_tqdm  # in a notebook's kernel: its widget
    drawn = (notebook or _isatty(stream)) if tty is None else tty
    if drawn or not enabled:
        bar_class = auto_tqdm if notebook else terminal_tqdm
        return bar_class(
            iterable,
            total=total,
            desc=desc or None,
            unit=unit,
            disable=not enabled,
            file=stream,
            **tqdm_options,
        )
    return PlainProgress(
        iterable, total=total, desc=desc, unit=unit, file=stream, interval_s=interval_s,
        clock=clock,
    )  # fmt: skip


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or bare stream
        return False


class PlainProgress(Generic[T]):
    """Progress as plain lines: the first when it starts, then at most one every ``interval_s``
    and the last when it closes. The subset of tqdm's interface the commands use."""

    def __init__(
        self,
        iterable: Iterable[T] | None = None,
        *,
        total: float | None = None,
        desc: str = "",
        unit: str = "it",
        file: TextIO | None = None,
        interval_s: float = PLAIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.iterable = iterable
        if total is None and isinstance(iterable, Sized):
            total = len(iterable)
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = 0
        self.file = file if file is not None else sys.stderr
        self.interval_s = interval_s
        self.clock = clock
        self.postfix = ""
        self._start = clock()
        self._printed_at = -math.inf
        self._printed_n: float | None = None
        self._closed = False
        self._print()

    def update(self, n: float = 1) -> None:
        self.n += n  # type: ignore[assignment]  # tqdm's counts may be fractional too
        self.refresh(whenever=False)

    def refresh(self, whenever: bool = True) -> None:
        """Print the current line if ``interval_s`` has passed since the last one (tqdm's
        ``refresh`` draws at once; here that would print a line per call)."""
        del whenever  # an explicit refresh follows the same rule: a log wants no flood
        if self.clock() - self._printed_at >= self.interval_s:
            self._print()

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        if desc and desc != self.desc:
            self.desc = desc
            self._printed_at = -math.inf  # a new stage gets its own line at its next step

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(dict(ordered_dict) if ordered_dict else {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def line(self) -> str:
        """E.g. ``labels: 2,310 of 8,200 texts (28 %), 3:05 elapsed, about 8 minutes left``."""
        elapsed = self.clock() - self._start
        if self.total:
            # Floored: 320 of 321 is not "100 %".
            percent = 100 if self.n >= self.total else math.floor(100 * self.n / self.total)
            unit = _counted(self.unit, self.total)
            text = f"{self.n:,.0f} of {self.total:,.0f} {unit} ({percent:.0f} %)"
        else:
            text = f"{self.n:,.0f} {_counted(self.unit, self.n)}"
        text += f", {_clock(elapsed)} elapsed"
        if self.total and 0 < self.n < self.total and elapsed > 0:
            text += f", {about((self.total - self.n) * elapsed / self.n)} left"
        if self.postfix:
            text += f", {self.postfix}"
        return f"{self.desc}: {text}" if self.desc else text

    def _print(self) -> None:
        self._printed_at = self.clock()
        self._printed_n = self.n
        print(self.line(), file=self.file, flush=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.n != self._printed_n:  # the last line says where it ended
            self._print()

    def __iter__(self) -> Iterator[T]:
        if self.iterable is None:
            raise TypeError("PlainProgress made without an iterable")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> PlainProgress[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Units whose plural is not the unit and an "s" (tqdm's units are short: "it", "expl").
_PLURALS = {"it": "items", "expl": "explanations", "batch": "batches"}


def _plural(unit: str) -> str:
    return _PLURALS.get(unit, unit if unit.endswith("s") else unit + "s")


def _counted(unit: str, count: float) -> str:
    """``unit`` as ``count`` of it reads: "1 text", "0 texts", "2 texts" ("1 of 1 text": the
    noun goes with the total). tqdm's short "it" is "item" alone."""
    if count == 1:
        return {"it": "item", "expl": "explanation"}.get(unit, unit)
    return _plural(unit)


def _clock(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour), as tqdm writes elapsed time."""
    s = int(seconds)
    hours, rest = divmod(s, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
