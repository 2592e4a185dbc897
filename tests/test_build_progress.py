"""A build's progress file: written whole at most every interval and at each new stage, read
back as a line with the time left at the stage's own rate; gone when the build closes it."""

from __future__ import annotations

from pathlib import Path

from limelight.build_progress import ProgressFile, read_progress


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
