"""`limelight jobs`: the list's table, a job's page, how a refused call ends."""

from __future__ import annotations

import pytest

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


def _finished_job() -> JobInfo:
    from limelight_client.types import Explanation, Token

    text = "电影 great"
    result = Explanation(
        label="fresh",
        label_index=1,
        labels=["rotten", "fresh"],
        probabilities={"rotten": 0.1, "fresh": 0.9},
        tokens=[Token("[UNK]", 100, 0, 2), Token("great", 2307, 3, 8)],
        scores=[-0.5, 1.0],
        method="lrp",
        target_label="fresh",
        target_index=1,
        text=text,
    )
    return JobInfo(
        id="e" * 32,
        state=JobState.SUCCEEDED,
        method="lrp",
        message="done … 电影",
        result=result,
    )


def test_a_stream_that_cannot_encode_the_tables_characters_gets_ascii_ones() -> None:
    """`jobs list`, `jobs show` and `jobs watch` ended with UnicodeEncodeError on an ASCII or
    Latin-1 standard output (the ellipsis of a cut message, the heat-map's bars): they print
    ``...`` and ``> # .`` there, and a character of the job's text as ``?``."""
    from limelight.cli.jobs import describe

    failed = "out of memory on layer 3 of 12 while computing the attention of a very long text"
    info = JobInfo(id="b" * 32, state=JobState.FAILED, method="lrp", error=failed)
    for encoding in ("ascii", "latin-1"):
        table = jobs_table([info, _finished_job()], encoding=encoding)
        table.encode(encoding)
        header, row, done = table.splitlines()
        cell = row[header.index("MESSAGE") :]
        assert cell.startswith("out of memory on layer 3") and cell.endswith("...")
        assert len(cell) == 64
        assert done.endswith("done ? ??")
        page = describe(_finished_job(), color=False, encoding=encoding)
        page.encode(encoding)
        lines = page.splitlines()
        assert "> fresh   " + "#" * 22 + "..  0.900" in lines, lines
        assert "??[-0.500] great[+1.000]" in lines
        assert 'against fresh: "??" -0.500' in lines
    shown = describe(_finished_job(), color=False, encoding="utf-8")
    assert "电影[-0.500] great[+1.000]" in shown and "▶ fresh" in shown


def test_a_job_call_the_sidecar_refuses_as_invalid_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """INVALID_ARGUMENT from the sidecar is a usage error (2), as the --help epilog says;
    anything else it answers stays 1."""
    import argparse
    import contextlib

    import grpc

    from limelight.cli import jobs
    from limelight_client.errors import InvalidArgument, NotFound

    monkeypatch.setattr(jobs, "client_from_args", lambda args: contextlib.nullcontext(None))
    args = argparse.Namespace(command="jobs", jobs_command="list", target="h:1", timeout=5.0)

    def refuse(client: object) -> int:
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "limit is 5000; 0 up to 1000")

    def missing(client: object) -> int:
        raise NotFound(grpc.StatusCode.NOT_FOUND, "job 'x' not found")

    assert jobs._call(args, refuse) == 2
    assert jobs._call(args, missing) == 1
    assert capsys.readouterr().err.splitlines() == [
        "limelight jobs list: error: INVALID_ARGUMENT: limit is 5000; 0 up to 1000",
        "limelight jobs list: error: NOT_FOUND: job 'x' not found",
    ]
