"""`limelight jobs list`'s table."""

from __future__ import annotations

from limelight.cli.jobs import jobs_table
from limelight_client.types import JobInfo, JobState


def test_a_long_message_is_cut_with_an_ellipsis_on_one_line() -> None:
    queued = "queued; no worker consumes this queue (start `limelight worker`)"
    failed = "out of memory\non layer 3 of 12 while computing the attention of a very long text"
    infos = [
        JobInfo(id="a" * 32, state=JobState.QUEUED, method="slalom", message=queued),
        JobInfo(id="b" * 32, state=JobState.FAILED, method="lrp", error=failed),
    ]
    rows = jobs_table(infos).splitlines()
    assert rows[0].split()[-1] == "MESSAGE"
    assert rows[1].endswith(queued)  # 64 characters: whole
    cell = rows[2][rows[0].index("MESSAGE") :]
    assert cell.startswith("out of memory on layer 3") and cell.endswith("…")
    assert len(cell) == 64
