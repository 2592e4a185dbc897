"""The CLI's shared helpers: the job progress line, top tokens, targets without a port."""

from __future__ import annotations

import math

import pytest

from limelight.cli.common import (
    JobProgressBar,
    client_error_line,
    job_status_line,
    top_token_lines,
)
from limelight_client.types import Explanation, Token


@pytest.mark.parametrize(
    ("state", "message", "line"),
    [
        ("running", "16/32 path points", "running: 16/32 path points"),
        ("running", "running", "running"),  # said once, not "running running"
        ("queued", "", "queued"),
        # A message that begins with the state says it: not "queued: queued; no worker …".
        ("queued", "queued; no worker", "queued; no worker"),
        ("queued", "re-queued: its worker stopped", "queued: re-queued: its worker stopped"),
        ("", "32/32 path points", "32/32 path points"),  # a local run has no state
    ],
)
def test_job_status_line(state: str, message: str, line: str) -> None:
    assert job_status_line(state, message) == line


def test_job_bar_shows_percent_and_stage_without_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    with JobProgressBar("shapley 1234abcd", tty=True) as bar:
        bar.show(float("nan"), "starting", "running")  # not a number: shown as 0 %
        bar.show(0.5, "8/16 permutations", "running")
        bar.show(1.5, "done", "succeeded")  # clamped: never past 100 %
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("shapley 1234abcd: 100%|")
    assert last.endswith("succeeded: done")
    assert "/s" not in last


def test_job_progress_off_a_terminal_is_one_line_per_state(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Redirected (a log, CI), no bar frames: a line when the state changes."""
    with JobProgressBar("slalom 1f2e3d4c") as bar:  # capsys: standard error is no terminal
        bar.show(0.0, "queued; no worker consumes this queue", "queued")
        bar.show(0.0, "queued; no worker consumes this queue", "queued")
        for epoch in range(1, 4):
            bar.show(epoch / 3, f"fitting SLALOM: epoch {epoch}/3", "running")
        bar.show(1.0, "done", "succeeded")
    assert capsys.readouterr().err.splitlines() == [
        "slalom 1f2e3d4c: queued; no worker consumes this queue",
        "slalom 1f2e3d4c: running: fitting SLALOM: epoch 1/3",
        "slalom 1f2e3d4c: succeeded: done",
    ]
    # A run in this process has no states: its first stage and its last.
    with JobProgressBar("lrp") as bar:
        for step in ("starting", "layer 1/2", "layer 2/2", "done"):
            bar.show(0.5, step)
    assert capsys.readouterr().err.splitlines() == ["lrp: starting", "lrp: done"]
    with JobProgressBar("lrp", quiet=True) as bar:
        bar.show(0.5, "starting", "running")
    assert capsys.readouterr().err == ""


def _explained(words: list[str], scores: list[float]) -> Explanation:
    tokens = [Token("[CLS]", 101, 0, 0, special=True)]
    start = 0
    for i, w in enumerate(words):  # the words' places in "w0 w1 w2 ..."
        tokens.append(Token(w, 1000 + i, start, start + len(w)))
        start += len(w) + 1
    tokens.append(Token("[SEP]", 102, 0, 0, special=True))
    return Explanation(
        label="fresh",
        label_index=1,
        labels=["rotten", "fresh"],
        probabilities={"rotten": 0.1, "fresh": 0.9},
        tokens=tokens,
        scores=[9.0, *scores, 9.0],  # the special tokens' scores are never listed
        method="distilled",
        target_label="fresh",
        target_index=1,
    )


def test_top_tokens_list_support_and_opposition_apart() -> None:
    words = ["a", "gorgeous", "film", "weak", ",", "moving", "odd"]
    scores = [-0.1, 2.0, 0.2, -1.5, -0.3, 1.0, math.nan]
    lines = top_token_lines(_explained(words, scores), 2)
    # the strongest evidence against comes first, ahead of weakly negative tokens
    assert lines == [
        'for fresh: "gorgeous" +2.000, "moving" +1.000',
        'against fresh: "weak" -1.500, "," -0.300',
    ]


def test_top_tokens_of_a_method_without_negative_scores() -> None:
    lines = top_token_lines(_explained(["a", "b"], [0.5, 0.0]), 5)
    assert lines == ['for fresh: "a" +0.500']
    assert top_token_lines(_explained(["a"], [-0.5]), 5) == [
        "for fresh: none",
        'against fresh: "a" -0.500',
    ]
    assert top_token_lines(_explained(["a"], [-0.5]), 0) == []  # --top 0: the heat-map alone


def test_tiny_scores_are_listed_as_the_heat_map_writes_them() -> None:
    """An untrained model's Shapley values of 3e-4 were listed as "-0.000"; the list now uses
    the heat-map's format (exponent form below a largest magnitude of 0.001)."""
    lines = top_token_lines(_explained(["x", "y"], [-2.26e-4, -3.06e-4]), 5)
    assert lines == ["for fresh: none", 'against fresh: "y" -3.06e-04, "x" -2.26e-04']


def test_a_token_text_that_occurs_more_than_once_says_which_occurrence() -> None:
    """Two "the" in one list (or one "the" of several in the text) would read as one token
    listed twice; each says which occurrence it is, in text order."""
    words = ["the", "plot", ",", "the", "acting", ",", "the", "end", "1", "2", "3", "4"]
    scores = [0.5, 1.0, -0.2, 0.4, 2.0, -0.6, -0.1, 0.0, 0.0, 0.0, 0.0, 0.0]
    words += ["x"] * 11  # an 11th occurrence reads "11th", not "11st"
    scores += [0.0] * 10 + [0.05]
    lines = top_token_lines(_explained(words, scores), 4)
    assert lines == [
        'for fresh: "acting" +2.000, "plot" +1.000, "the" (1st of 3) +0.500, '
        '"the" (2nd of 3) +0.400',
        'against fresh: "," (2nd of 2) -0.600, "," (1st of 2) -0.200, "the" (3rd of 3) -0.100',
    ]
    assert top_token_lines(_explained(words, scores), 5)[0].endswith('"x" (11th of 11) +0.050')


@pytest.mark.parametrize(
    ("target", "no_port"),
    [
        ("localhost", True),
        ("[::1]", True),
        ("10.0.0.7", True),
        ("localhost:50051", False),
        ("[::1]:50051", False),
        ("unix:/run/limelight.sock", False),
        ("dns:///limelight:50051", False),
    ],
)
def test_a_target_without_a_port_is_told_apart(target: str, no_port: bool) -> None:
    from limelight.cli.common import _no_port

    assert _no_port(target) is no_port


def test_a_sidecar_that_answers_unavailable_is_not_called_unreachable() -> None:
    """UNAVAILABLE with no connection reason came from something that answered (a sidecar
    whose job queue is down, or that drains): the line says it is unavailable and why, not that
    nothing could be reached."""
    import grpc

    from limelight_client.errors import Unavailable

    answered = Unavailable(grpc.StatusCode.UNAVAILABLE, "the job queue is unreachable")
    assert client_error_line(answered, "host:50051") == (
        "the sidecar at host:50051 is unavailable: the job queue is unreachable"
    )


def test_listed_tokens_show_the_inputs_own_characters_and_nothing_a_terminal_acts_on() -> None:
    # An uncased tokenizer says "good" for "Good" and "[UNK]" for each emoji: the lists show
    # what the user wrote, tell the two emoji apart (not "(1st of 2)"), and a word cut from
    # the input with a control character in it (``by_words`` keeps what the tokenizer
    # dropped) is made harmless.
    text = "Good \U0001f4a9 and \U0001f600 de\x1bcent \u202egood\x9b"
    pieces = [("good", 0, 4), ("[UNK]", 5, 6), ("and", 7, 10), ("[UNK]", 11, 12)]
    pieces += [("decent", 13, 20), ("good", 21, 27)]
    tokens = [Token(t, 1000 + i, start, end) for i, (t, start, end) in enumerate(pieces)]
    explanation = Explanation(
        label="fresh",
        label_index=1,
        labels=["rotten", "fresh"],
        probabilities={"rotten": 0.1, "fresh": 0.9},
        tokens=tokens,
        scores=[3.0, 2.0, 0.0, 1.0, 0.5, 0.25],
        method="distilled",
        target_label="fresh",
        target_index=1,
        text=text,
    )
    assert top_token_lines(explanation, 6) == [
        'for fresh: "Good" +3.000, "\U0001f4a9" +2.000, "\U0001f600" +1.000, '
        '"de\ufffdcent" +0.500, "\ufffdgood\ufffd" +0.250'
    ]


def test_a_json_flag_that_does_not_decode_is_told_what_its_variable_is(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve --label-thresholds '{bad'`` names the flag, the decoder's reason and how the
    value is written, in the words LIMELIGHT_LABEL_THRESHOLDS gets for the same value."""
    from limelight.cli.main import build_parser, main

    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["serve", "--label-thresholds", "{bad"])
    assert stopped.value.code == 2
    flag = capsys.readouterr().err.strip().splitlines()[-1]
    said = "cannot be parsed (Expecting property name enclosed in double quotes"
    assert flag.startswith(f"limelight serve: error: argument --label-thresholds: {said}"), flag
    monkeypatch.setenv("LIMELIGHT_LABEL_THRESHOLDS", "{bad")
    assert main(["serve", "--port", "0", "--metrics-port", "0", "--jobs", "off"]) == 2
    variable = capsys.readouterr().err.strip().splitlines()[-1]
    prefix = "limelight serve: error: invalid setting label_thresholds: LIMELIGHT_LABEL_THRESHOLDS "
    assert variable.startswith(prefix), variable
    assert flag.split("--label-thresholds: ", 1)[1] == variable.removeprefix(prefix)
    assert variable.endswith("; lists and mappings are written as JSON")


class _Terminal:
    """A stream that says it is a terminal."""

    encoding = "utf-8"

    def isatty(self) -> bool:
        return True


def test_term_dumb_gets_no_colour_unless_it_is_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TERM=dumb`` (Emacs' shell, some IDE consoles) takes no escape codes: colour stays off
    when it is auto; ``--color always`` and FORCE_COLOR still force it."""
    from limelight.cli.common import use_color

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert use_color("auto", _Terminal()) is True
    monkeypatch.setenv("TERM", "dumb")
    assert use_color("auto", _Terminal()) is False
    assert use_color("always", _Terminal()) is True
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert use_color("auto", _Terminal()) is True
    assert use_color("never", _Terminal()) is False


def test_the_color_flag_says_what_turns_colour_off() -> None:
    from limelight.cli.main import _leaf_parsers, build_parser

    explain = next(p for p in _leaf_parsers(build_parser()) if p.prog == "limelight explain")
    said = " ".join(explain.format_help().split())
    assert "unless NO_COLOR is set or TERM is dumb (FORCE_COLOR forces it)" in said


def test_a_deadline_names_the_sidecar_and_the_flag_that_set_it() -> None:
    """gRPC's "DEADLINE_EXCEEDED: Deadline Exceeded" said neither where nor what to do."""
    import grpc

    from limelight_client.errors import DeadlineExceeded

    bare = DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert client_error_line(bare, "host:50051", timeout=2.0) == (
        "no answer from the sidecar at host:50051 within --timeout 2 s; raise --timeout or "
        "check it is serving"
    )
    # The sidecar's own word on it, where it said one, is kept.
    queued = DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while queued")
    assert client_error_line(queued, "host:50051", timeout=0.5) == (
        "no answer from the sidecar at host:50051 within --timeout 0.5 s (deadline passed "
        "while queued); raise --timeout or check it is serving"
    )
    assert client_error_line(bare, "host:50051") == (
        "no answer from the sidecar at host:50051 in time; check it is serving"
    )


def test_a_refused_argument_is_a_usage_error_and_nothing_else_is() -> None:
    """The sidecar's INVALID_ARGUMENT is the refusal ``--local`` gives with status 2."""
    import grpc

    from limelight.cli.common import client_error_status
    from limelight_client.errors import InvalidArgument, NotFound, Unavailable

    assert client_error_status(InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "x")) == 2
    assert client_error_status(NotFound(grpc.StatusCode.NOT_FOUND, "x")) == 1
    assert client_error_status(Unavailable(grpc.StatusCode.UNAVAILABLE, "x")) == 1
