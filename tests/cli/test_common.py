"""The CLI's shared job progress line."""

from __future__ import annotations

import pytest

from limelight.cli.common import JobProgressBar, job_status_line


@pytest.mark.parametrize(
    ("state", "message", "line"),
    [
        ("running", "16/32 path points", "running: 16/32 path points"),
        ("running", "running", "running"),  # said once, not "running running"
        ("queued", "", "queued"),
        ("", "32/32 path points", "32/32 path points"),  # a local run has no state
    ],
)
def test_job_status_line(state: str, message: str, line: str) -> None:
    assert job_status_line(state, message) == line


def test_job_bar_shows_percent_and_stage_without_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    with JobProgressBar("shapley 1234abcd") as bar:
        bar.show(float("nan"), "starting", "running")  # not a number: shown as 0 %
        bar.show(0.5, "8/16 permutations", "running")
        bar.show(1.5, "done", "succeeded")  # clamped: never past 100 %
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("shapley 1234abcd: 100%|")
    assert last.endswith("succeeded: done")
    assert "/s" not in last
