"""How far a build running in another process has got, for whoever waits on it.

A build in the background (the demo's distilled head, started by the sidecar's first start)
writes its progress bar's state into a small JSON file beside what it builds; the sidecar reads
it to tell a caller who asks for the unfinished result how long to wait, instead of only that
it is not there yet. The file is written whole and moved into place, so a reader never sees
half of it; a missing or unreadable file is "no news", never an error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildProgress:
    """One stage's progress bar, as last written."""

    stage: str
    index: int
    """The stage's place among the build's stages, from 1."""
    stages: int
    done: int
    total: int
    unit: str
    measured_since: float
    """Start of the window the rate is read over (seconds since the epoch): the last
    ``window_s`` of the stage, so that work found done already (labels cached by an interrupted
    build, counted off in a burst) soon stops inflating it."""
    measured_from: int
    """``done`` at ``measured_since``."""
    updated: float

    def seconds_left(self) -> float | None:
        """This stage's time left at its rate so far; None before its first step."""
        if self.done <= self.measured_from or self.updated <= self.measured_since:
            return None
        rate = (self.done - self.measured_from) / (self.updated - self.measured_since)
        return max(self.total - self.done, 0) / rate

    def describe(self) -> str:
        """E.g. "labels (stage 1 of 3): 2,310 of 8,200 texts, about 4 minutes left in it" (no
        stage number when the build has one stage)."""
        place = f" (stage {self.index} of {self.stages})" if self.stages > 1 else ""
        line = f"{self.stage}{place}: {self.done:,} of {self.total:,} {self.unit}"
        left = self.seconds_left()
        if left is not None:
            line += f", {about(left)} left in it"
        return line


def about(seconds: float) -> str:
    """A time left in words: "less than a minute", "about 4 minutes"."""
    if seconds < 60:
        return "less than a minute"
    minutes = math.ceil(seconds / 60)
    return f"about {minutes} minute{'s' if minutes > 1 else ''}"


class ProgressFile:
    """Writes a build's progress to ``path`` at most every ``interval_s`` (and at every new
    stage and every stage's end), its rate read over the last ``window_s``; removes it when
    closed."""

    def __init__(
        self,
        path: Path,
        stages: list[str],
        interval_s: float = 1.0,
        window_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.stages = stages
        self.interval_s = interval_s
        self.window_s = window_s
        self.clock = clock
        self._stage = ""
        self._points: deque[tuple[float, int]] = deque()  # (time, done) of this stage's writes
        self._written = -math.inf

    def update(self, stage: str, done: int, total: int, unit: str) -> None:
        now = self.clock()
        new_stage = stage != self._stage
        if new_stage:
            self._stage = stage
            self._points.clear()
        if not new_stage and done < total and now - self._written < self.interval_s:
            return
        self._written = now
        self._points.append((now, done))
        while len(self._points) > 2 and now - self._points[1][0] >= self.window_s:
            self._points.popleft()  # keep the oldest point still at least window_s back
        since, start = self._points[0]
        index = self.stages.index(stage) + 1 if stage in self.stages else len(self.stages)
        state = BuildProgress(
            stage=stage,
            index=index,
            stages=len(self.stages),
            done=done,
            total=total,
            unit=unit,
            measured_since=since,
            measured_from=start,
            updated=now,
        )
        partial = self.path.with_name(f".{os.getpid()}.{self.path.name}")
        with contextlib.suppress(OSError):  # progress is a courtesy: never fail a build on it
            partial.write_text(json.dumps(asdict(state)))
            os.replace(partial, self.path)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def read_progress(path: Path) -> BuildProgress | None:
    """The progress last written to ``path``; None when there is none or it cannot be read."""
    try:
        return BuildProgress(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def watch_build(
    child: subprocess.Popen[bytes],
    progress_paths: Sequence[Path],
    what: str,
    log_path: Path,
    interval_s: float = 60.0,
) -> threading.Thread:
    """Log how far the build in ``child`` has got every ``interval_s`` while it runs (from its
    progress file, when it says something new), then how it ended: the terminal that started a
    sidecar (``make serve``) shows the build's progress, not only where its log is. A child
    that builds several things in turn writes each one's progress to its own file, first to
    last in ``progress_paths``: the first one present is read. A daemon
    thread: it never keeps the sidecar from exiting."""

    def watch() -> None:
        said = ""
        while True:
            try:
                status = child.wait(timeout=interval_s)
            except subprocess.TimeoutExpired:
                progress = next(filter(None, map(read_progress, progress_paths)), None)
                line = progress.describe() if progress else ""
                if line and line != said:
                    log.info("%s: %s", what, line)
                    said = line
                continue
            if status == 0:
                log.info("%s: done", what)
            else:
                log.warning("%s stopped (exit status %d); its log: %s", what, status, log_path)
            return

    thread = threading.Thread(target=watch, name=f"watch {what}", daemon=True)
    thread.start()
    return thread
