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


def test_the_model_column_tells_jobs_of_two_models_apart() -> None:
    """A Redis queue shared across a rollout lists jobs of both versions: each row names its
    model with a short hash; `jobs show` gives the whole one; older servers' jobs read ``-``."""
    from limelight.cli.jobs import describe

    old = JobInfo(
        id="a" * 32, state=JobState.QUEUED, method="lrp", model_name="m", model_version="1" * 64
    )
    new = JobInfo(
        id="b" * 32, state=JobState.QUEUED, method="lrp", model_name="m", model_version="2" * 64
    )
    unknown = JobInfo(id="c" * 32, state=JobState.QUEUED, method="lrp")
    header, *rows = jobs_table([old, new, unknown]).splitlines()
    column = header.index("MODEL")
    assert [row[column:].split()[0] for row in rows] == ["m@11111111", "m@22222222", "-"]
    assert f"model      m@{'2' * 64}" in describe(new).splitlines()


def test_what_a_submitter_chose_cannot_drive_the_readers_terminal() -> None:
    """A job's key and parameters are whatever its submitter sent, and `jobs show` printed the
    key raw: an escape sequence in it cleared the reader's screen and set the window title."""
    from limelight.cli.jobs import describe

    attack = "k\x1b]0;PWNED\x07\x1b[2J\x9b31m\u202e"
    info = JobInfo(
        id="d" * 32,
        state=JobState.FAILED,
        method=f"lrp{attack}",
        idempotency_key=attack,
        parameters={"note": attack},
        message=attack,
        error=attack,
    )
    for shown in (describe(info, color=False), jobs_table([info])):
        assert not any(c in shown for c in "\x1b\x07\x9b\u202e"), repr(shown)
        assert "PWNED" in shown  # the text is still there to read
