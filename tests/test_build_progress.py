"""A build's progress file: written whole at most every interval and at each new stage, read
back as a line with the time left at the stage's own rate; gone when the build closes it; logged
by the process that started the build while it runs, and how it ended."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from limelight.build_progress import ProgressFile, read_progress, watch_build


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_written_per_interval_and_stage_and_read_back_with_the_time_left(
    tmp_path: Path,
) -> None:
    path, clock = tmp_path / "progress.json", Clock()
    progress = ProgressFile(path, ["labels", "training"], interval_s=1.0, clock=clock)
    assert read_progress(path) is None
    progress.update("labels", 300, 1_300, "texts")  # 300 found cached: not part of the rate
    first = read_progress(path)
    assert first is not None and first.seconds_left() is None
    assert first.describe() == "labels (stage 1 of 2): 300 of 1,300 texts"
    clock.now += 0.5
    progress.update("labels", 350, 1_300, "texts")
    assert read_progress(path) == first  # within the interval: not written
    clock.now += 59.5
    progress.update("labels", 400, 1_300, "texts")  # 100 texts a minute from the baseline
    state = read_progress(path)
    assert state is not None and state.seconds_left() == 540.0
    assert (
        state.describe() == "labels (stage 1 of 2): 400 of 1,300 texts, about 9 minutes left in it"
    )
    clock.now += 0.1
    progress.update("training", 1, 30, "epochs")  # a new stage is written at once
    state = read_progress(path)
    assert state is not None
    assert (state.stage, state.index, state.measured_from) == ("training", 2, 1)
    clock.now += 2.0
    progress.update("training", 29, 30, "epochs")
    assert "less than a minute left" in read_progress(path).describe()  # type: ignore[union-attr]
    progress.close()
    assert not path.exists() and not list(tmp_path.iterdir())  # no partial file left behind


def test_the_rate_is_read_over_the_last_window_so_a_burst_of_cached_work_fades(
    tmp_path: Path,
) -> None:
    path, clock = tmp_path / "progress.json", Clock()
    progress = ProgressFile(path, ["labels"], interval_s=1.0, window_s=30.0, clock=clock)
    done = 0
    for _ in range(5):  # cached labels counted off at 500 a second
        done += 500
        clock.now += 1.0
        progress.update("labels", done, 10_000, "texts")
    for _ in range(60):  # then labelled at 10 a second
        done += 10
        clock.now += 1.0
        progress.update("labels", done, 10_000, "texts")
    state = read_progress(path)
    assert state is not None and state.updated - state.measured_since == 30.0
    assert state.seconds_left() == (10_000 - done) / 10


def test_an_unreadable_progress_file_is_no_news(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    path.write_text("{not json")
    assert read_progress(path) is None
    path.write_text('{"stage": "labels"}')
    assert read_progress(path) is None


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "limelight.build_progress"]


def _wait_for(caplog: pytest.LogCaptureFixture, count: int) -> list[str]:
    deadline = time.monotonic() + 60  # a guard against a hang, not a speed requirement
    while len(_lines(caplog)) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return _lines(caplog)


@pytest.mark.parametrize("status", [0, 3])
def test_the_starting_process_logs_each_new_progress_line_and_how_the_build_ended(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, status: int
) -> None:
    caplog.set_level(logging.INFO, logger="limelight.build_progress")
    path, then, clock = tmp_path / "progress.json", tmp_path / "then.json", Clock()
    # The build: a real child process that exits with the status it reads.
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.exit(int(sys.stdin.readline()))"],
        stdin=subprocess.PIPE,
    )
    try:
        watcher = watch_build(
            child, [path, then], "build of m", tmp_path / "m.log", interval_s=0.01
        )
        progress = ProgressFile(path, ["labels", "training"], clock=clock)
        progress.update("labels", 10, 100, "texts")
        assert _wait_for(caplog, 1) == ["build of m: labels (stage 1 of 2): 10 of 100 texts"]
        time.sleep(0.1)  # several polls of the same state: said once
        assert len(_lines(caplog)) == 1
        progress.update("training", 1, 5, "epochs")
        assert _wait_for(caplog, 2)[1] == "build of m: training (stage 2 of 2): 1 of 5 epochs"
        progress.close()  # then the child builds the next thing, with a progress file of its own
        ProgressFile(then, ["fit"], clock=clock).update("fit", 3, 300, "steps")
        assert _wait_for(caplog, 3)[2] == "build of m: fit: 3 of 300 steps"  # one stage: no number
        assert child.stdin is not None
        child.stdin.write(f"{status}\n".encode())
        child.stdin.close()
        watcher.join(timeout=60)
        assert not watcher.is_alive()
    finally:
        child.kill()
        child.wait()
    ended = _lines(caplog)[3:]
    if status == 0:
        assert ended == ["build of m: done"]
    else:
        assert ended == [f"build of m stopped (exit status 3); its log: {tmp_path / 'm.log'}"]
        assert caplog.records[-1].levelno == logging.WARNING
