"""`limelight explain` as a user runs it: against a sidecar, and in-process with --local."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunningSidecar


def limelight(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def class_column(answer: dict[str, Any], column: int) -> list[float]:
    """One class's scores of the non-special tokens of an ``explain --json`` answer."""
    return [
        row[column]
        for row, t in zip(answer["class_scores"], answer["tokens"], strict=True)
        if not t["special"]
    ]


def test_explain_against_server_json_and_html(sidecar: RunningSidecar, tmp_path: Path) -> None:
    text = "a gorgeous, witty, seductive movie"
    out = limelight("explain", text, "--target", sidecar.target, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["label"] in ("rotten", "fresh") and data["text"] == text
    assert len(data["scores"]) == len(data["tokens"])

    page = tmp_path / "out.html"
    shown = limelight("explain", text, "--target", sidecar.target, "--html", str(page))
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^for (fresh|rotten): ", shown.stdout, re.M)
    html = page.read_text()
    assert "<html" in html.lower() and "gorgeous" in html and "http://" not in html
    # A folder that is not there is found before the call (a job's would have run for nothing);
    # a file that cannot be written no longer costs the answer, printed first.
    missing = limelight("explain", text, "--target", sidecar.target, "--html", "/none/x.html")
    assert (missing.returncode, missing.stdout) == (1, ""), missing.stderr
    assert "cannot write --html /none/x.html: no folder /none" in missing.stderr
    unwritable = limelight("explain", text, "--target", sidecar.target, "--html", str(tmp_path))
    assert unwritable.returncode == 1 and "cannot write --html" in unwritable.stderr
    assert re.search(r"^for (fresh|rotten): ", unwritable.stdout, re.M)


def test_all_classes_draws_a_map_per_class_and_flags_a_method_ignores_are_refused(
    sidecar: RunningSidecar, tmp_path: Path
) -> None:
    text = "a gorgeous but slow film"
    both = limelight(
        "explain", text, "--target", sidecar.target, "--all-classes", "--color", "never",
        "--html", str(tmp_path / "all.html"),
    )  # fmt: skip
    assert both.returncode == 0, both.stderr
    answer = json.loads(
        limelight("explain", text, "--target", sidecar.target, "--all-classes", "--json").stdout
    )
    for column, label in enumerate(answer["labels"]):
        assert f"── {label} ──" in both.stdout
        # each class's map prints that class's column of the score matrix
        words = [t["text"] for t in answer["tokens"] if not t["special"]]
        scores = class_column(answer, column)
        section = both.stdout.split(f"── {label} ──", 1)[1]
        line = next(ln for ln in section.splitlines() if ln.strip())
        assert line.split() == [f"{w}[{s:+.3f}]" for w, s in zip(words, scores, strict=True)]
        assert f"<h2>{label}</h2>" in (tmp_path / "all.html").read_text()
    for flags, said in [
        (["--param", "steps=8"], "--param: the default method runs inline and takes no param"),
        (["--method", "normxlogit", "--param", "steps=8"], "--param: normxlogit runs inline"),
        (["--method", "lrp", "--all-classes", "--wait"], "--all-classes: lrp runs as a job"),
    ]:
        refused = limelight("explain", text, "--target", sidecar.target, *flags)
        assert refused.returncode == 2
        assert refused.stderr.startswith(f"limelight explain: error: {said}"), refused.stderr


def test_all_classes_draws_a_map_per_label_on_a_multi_label_model(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_multilabel_dir: Path, tmp_path: Path
) -> None:
    """As on a single-label model: every label's map, predicted or not (it drew the first
    predicted label's alone), in the terminal and on the page."""
    running = start_sidecar(model_dir=bert_tiny_multilabel_dir)
    text = "this pill gave me headaches and my anxiety got worse"
    page = tmp_path / "all.html"
    args = ("explain", text, "--target", running.target, "--all-classes")
    shown = limelight(*args, "--color", "never", "--html", str(page))
    assert shown.returncode == 0, shown.stderr
    answer = json.loads(limelight(*args, "--json").stdout)
    assert answer["multi_label"] and len(answer["labels"]) == 4
    assert len(answer["predicted_labels"]) < 4  # some labels are drawn that were not predicted
    html = page.read_text()
    words = [t["text"] for t in answer["tokens"] if not t["special"]]
    for column, label in enumerate(answer["labels"]):
        scores = class_column(answer, column)
        section = shown.stdout.split(f"── {label} ──", 1)[1]
        line = next(ln for ln in section.splitlines() if ln.strip())
        # (a word's pieces are drawn together: "headache[…]s[…]")
        drawn = "".join(
            f"{w.removeprefix('##')}[{s:+.3f}]" for w, s in zip(words, scores, strict=True)
        )
        assert "".join(line.split()) == drawn
        assert f"<h2>{label}</h2>" in html


def test_a_second_class_is_refused_not_dropped() -> None:
    """`--class a --class b` explained b alone without a word: one call explains one label.
    Refused before any sidecar is called (none listens at the target)."""
    for more in ((), ("--lines", "-")):
        text = () if more else ("this pill gave me headaches",)
        out = limelight(
            "explain", *text, *more, "--class", "negative", "--class", "mental_health",
            "--target", "127.0.0.1:1", "--timeout", "2",
        )  # fmt: skip
        assert (out.returncode, out.stdout) == (2, ""), out.stderr
        assert out.stderr == (
            "limelight explain: error: --class given 2 times (negative, mental_health): one "
            "call explains one label; use --all-classes for every class's scores, or one call "
            "per label\n"
        )


def test_the_heat_map_is_coloured_on_a_terminal_only(sidecar: RunningSidecar) -> None:
    """A heat-map redirected to a file or a pipe carries no escape codes (each score is printed
    after its token instead); on a terminal it is coloured; --color, FORCE_COLOR and NO_COLOR
    decide over that."""
    text = "a gorgeous, witty, seductive movie"
    args = ("explain", text, "--target", sidecar.target)
    clean = {"NO_COLOR": "", "FORCE_COLOR": "", "TERM": "xterm-256color"}
    piped = limelight(*args, env=clean)
    assert piped.returncode == 0, piped.stderr
    assert "\x1b[" not in piped.stdout and re.search(r"gorgeous\[[+-]\d", piped.stdout)
    assert "\x1b[48;2;" in limelight(*args, "--color", "always", env=clean).stdout
    assert "\x1b[48;2;" in limelight(*args, env={"FORCE_COLOR": "1"}).stdout
    assert "\x1b[" not in limelight(*args, env={"NO_COLOR": "1"}).stdout

    shown = _on_a_terminal(*args, env=clean)  # a real terminal on standard output
    assert "\x1b[48;2;" in shown and "gorgeous" in shown
    # TERM=dumb takes no escape codes, a terminal though it is: none unless forced.
    assert "\x1b[" not in _on_a_terminal(*args, env={**clean, "TERM": "dumb"})
    assert "\x1b[48;2;" in _on_a_terminal(*args, "--color", "always", env={**clean, "TERM": "dumb"})
    never = limelight(*args, "--color", "never", env={"FORCE_COLOR": "1"})
    assert "\x1b[" not in never.stdout
    # --no-color, as grep and git spell it, is --color never.
    assert limelight(*args, "--no-color", env={"FORCE_COLOR": "1"}).stdout == never.stdout


def _on_a_terminal(*args: str, env: dict[str, str]) -> str:
    """What `limelight ARGS` writes to a terminal (a pseudo-terminal on standard output)."""
    primary, secondary = pty.openpty()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "limelight.cli.main", *args],
            stdout=secondary,
            stderr=subprocess.PIPE,
            timeout=600,
            env={**os.environ, **env},
        )
        os.close(secondary)
        assert run.returncode == 0, run.stderr
        return _read_all(primary).decode()
    finally:
        os.close(primary)


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the terminal's other end is closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def test_explain_local_matches_server(sidecar: RunningSidecar, bert_tiny_dir: Path) -> None:
    text = "the plot is thin but the actors are superb"
    remote = json.loads(limelight("explain", text, "--target", sidecar.target, "--json").stdout)
    local = limelight("explain", text, "--local", "--model", str(bert_tiny_dir), "--json")
    assert local.returncode == 0, local.stderr
    assert "Loading weights" not in local.stderr  # transformers' bar stays out of the output
    data = json.loads(local.stdout)
    assert data["label"] == remote["label"]
    for a, b in zip(data["scores"], remote["scores"], strict=True):
        assert abs(a - b) < 1e-4


def test_a_job_method_is_submitted_followed_and_shown(sidecar: RunningSidecar) -> None:
    """A job method without --wait prints the job (JSON with --json, for scripts); with --wait
    the explanation; `jobs show` and `jobs watch` find the job by its id."""
    text = "a gorgeous movie"
    target = ("--target", sidecar.target)
    submitted = limelight("explain", text, "--method", "integrated_gradients", "--json", *target)
    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(submitted.stdout)
    assert job["method"] == "integrated_gradients" and len(job["id"]) == 32
    hint = limelight("explain", text, "--method", "integrated_gradients", *target)
    assert hint.stdout.startswith("submitted job ") and "limelight jobs show " in hint.stdout

    waited = limelight(
        "explain", text, "--method", "integrated_gradients", "--wait", "--json", *target
    )
    assert waited.returncode == 0, waited.stderr
    explained = json.loads(waited.stdout)
    assert explained["method"] == "integrated_gradients" and explained["text"] == text
    assert len(explained["scores"]) == len(explained["tokens"])

    watched = limelight("jobs", "watch", job["id"], *target, env={"FORCE_COLOR": ""})
    assert watched.returncode == 0, watched.stderr
    assert "succeeded" in watched.stdout.lower() and "\x1b[" not in watched.stdout
    page = limelight("jobs", "show", job["id"], "--color", "always", "--top", "1", *target)
    assert "\x1b[48;2;" in page.stdout and re.search(
        r"^for \w+: \"[^\"]*\"( \(\w+ of \d+\))? [+-][\d.]+$", page.stdout, re.M
    )
    # Piped, the progress is one line per state, not a bar's redrawn frames.
    assert "\r" not in watched.stderr and "%/s" not in watched.stderr
    assert (
        watched.stderr.splitlines()[-1] == f"integrated_gradients {job['id'][:8]}: succeeded: done"
    )
    shown = json.loads(limelight("jobs", "show", job["id"], "--json", *target).stdout)
    assert shown["id"] == job["id"] and shown["state"] == "SUCCEEDED"
    late = limelight("jobs", "cancel", job["id"], *target)
    assert late.returncode == 0, late.stderr
    assert late.stdout.strip() == f"job {job['id']}: already succeeded; nothing to cancel"


def test_bad_input_exits_non_zero_with_a_clear_message(sidecar: RunningSidecar) -> None:
    out = limelight("explain", "fine", "--class", "meh", "--target", sidecar.target)
    assert out.returncode == 2  # refused as an argument: a usage error, as with --local
    assert "unknown label 'meh'" in out.stderr
    unreachable = limelight("explain", "x", "--target", "127.0.0.1:1", "--timeout", "2")
    assert unreachable.returncode == 1
    # where it looked and how to point it elsewhere, not gRPC's resolver internals
    assert "cannot reach a sidecar at 127.0.0.1:1 (connection refused)" in unreachable.stderr
    assert "--target" in unreachable.stderr and "ipv4:" not in unreachable.stderr
    jobs = limelight("jobs", "list", "--target", "127.0.0.1:1", "--timeout", "2")
    assert jobs.returncode == 1 and "cannot reach a sidecar at 127.0.0.1:1" in jobs.stderr
    # Without a port gRPC dials 443, which nothing here listens on: the line says so.
    no_port = limelight("explain", "x", "--target", "localhost", "--timeout", "2")
    assert no_port.returncode == 1
    assert "without a port gRPC dials 443" in no_port.stderr
    assert "--target localhost:50051" in no_port.stderr
    unknown = limelight("explain", "fine", "--method", "nope", "--target", sidecar.target)
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("limelight explain: error: unknown method 'nope'; offered: ")
    assert "normxlogit" in unknown.stderr and "KeyError" not in unknown.stderr


def test_an_argument_the_sidecar_refuses_exits_2_as_in_process(
    sidecar: RunningSidecar, bert_tiny_dir: Path
) -> None:
    """The same invalid input exited 2 with --local and 1 against a sidecar (which refuses it
    with INVALID_ARGUMENT); the --help epilog promises 2 for invalid arguments."""
    target = ("--target", sidecar.target)
    for argv, said in (
        (("",), "text is empty"),
        (("fine", "--class", "bogus"), "unknown label 'bogus'"),
        (
            ("fine", "--method", "integrated_gradients", "--param", "steps=abc", "--wait"),
            "parameter 'steps' must be a number",
        ),
        (("fine", "--method", "nope"), "unknown method 'nope'"),
    ):
        out = limelight("explain", *argv, *target)
        assert (out.returncode, out.stdout) == (2, ""), out.stderr
        assert out.stderr.startswith("limelight explain: error: ") and said in out.stderr
    local = limelight(
        "explain", "fine", "--class", "bogus", "--local", "--model", str(bert_tiny_dir)
    )
    assert local.returncode == 2 and "unknown label 'bogus'" in local.stderr, local.stderr


def test_no_answer_in_time_names_the_sidecar_and_the_timeout() -> None:
    """Something that takes the connection and never answers (a hung sidecar, a port that
    swallows it) gave "DEADLINE_EXCEEDED: Deadline Exceeded" and nothing to go on."""
    import socket

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)  # connections complete in the kernel; nothing ever reads them
        target = f"127.0.0.1:{hole.getsockname()[1]}"
        for argv in (("explain", "x"), ("jobs", "list")):
            out = limelight(*argv, "--target", target, "--timeout", "1")
            assert (out.returncode, out.stdout) == (1, ""), out.stderr
            assert out.stderr.splitlines()[-1].endswith(
                f"error: no answer from the sidecar at {target} within --timeout 1 s; raise "
                "--timeout or check it is serving"
            ), out.stderr


def test_a_terminal_that_cannot_encode_the_map_still_gets_the_result(
    sidecar: RunningSidecar,
) -> None:
    """``PYTHONIOENCODING=ascii`` (or Latin-1): the heat-map, `jobs show` and `jobs watch`
    ended with UnicodeEncodeError, the result lost; they print with ASCII drawing characters
    and "?" for what the stream cannot encode. Under the POSIX locale (no UTF-8 mode) a
    Chinese TEXT came with a warning that it was not UTF-8, though it arrived whole."""
    target = ("--target", sidecar.target)
    text = "电影 café great movie"
    for encoding in ("ascii", "latin-1"):
        env = {"PYTHONIOENCODING": encoding, "NO_COLOR": "", "FORCE_COLOR": ""}
        out = subprocess.run(
            [sys.executable, "-m", "limelight.cli.main", "explain", text, *target],
            capture_output=True,
            timeout=600,
            env={**os.environ, **env},
        )
        assert out.returncode == 0, out.stderr.decode(errors="replace")
        page = out.stdout.decode(encoding).splitlines()
        assert any(re.fullmatch(r"> (fresh|rotten) +#+\.* +[\d.]+", line) for line in page), page
        assert any(line.startswith("for ") for line in page)  # the lists too
        cafe = "café" if encoding == "latin-1" else "caf?"
        assert any(re.match(rf"\?\[.*\?\[.* {re.escape(cafe)}\[", line) for line in page), page

    submitted = limelight("explain", text, "--method", "integrated_gradients", "--json", *target)
    job = json.loads(submitted.stdout)["id"]
    for command in ("watch", "show"):
        shown = subprocess.run(
            [sys.executable, "-m", "limelight.cli.main", "jobs", command, job, *target],
            capture_output=True,
            timeout=600,
            env={**os.environ, "PYTHONIOENCODING": "ascii", "NO_COLOR": "", "FORCE_COLOR": ""},
        )
        assert shown.returncode == 0, shown.stderr.decode(errors="replace")
        lines = shown.stdout.decode("ascii").splitlines()
        assert "state      succeeded" in lines
        assert any(re.fullmatch(r"> (fresh|rotten) +#+\.* +[\d.]+", line) for line in lines)

    posix = {"LC_ALL": "POSIX", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    intact = limelight("explain", "电影 great", "--json", *target, env=posix)
    assert intact.returncode == 0, intact.stderr
    assert json.loads(intact.stdout)["text"] == "电影 great"
    assert "not valid UTF-8" not in intact.stderr
    # A byte that is not UTF-8 is still replaced, and said.
    broken = subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", "explain", b"\xff great", "--json", *target],
        capture_output=True,
        timeout=600,
        env={**os.environ, **posix},
    )
    assert broken.returncode == 0, broken.stderr
    assert json.loads(broken.stdout)["text"] == "\ufffd great"
    assert b"TEXT is not valid UTF-8" in broken.stderr


def test_a_text_read_under_the_posix_locale_is_warned_about_only_when_it_is_broken(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Under the POSIX locale without UTF-8 mode every byte over 127 of an argument comes as
    a surrogate: "电影" as six, which read back whole; only bytes that are not UTF-8 are."""
    from limelight.cli.explain import _utf8_or_replaced

    as_argv = "电影 great".encode().decode("ascii", "surrogateescape")
    assert _utf8_or_replaced(as_argv, "TEXT") == "电影 great"
    assert capsys.readouterr().err == ""
    assert _utf8_or_replaced("\udcff great \ufffd", "TEXT") == "\ufffd great \ufffd"
    assert "TEXT is not valid UTF-8" in capsys.readouterr().err
    assert _utf8_or_replaced("plain \ufffd", "TEXT") == "plain \ufffd"
    assert capsys.readouterr().err == ""


def test_the_text_can_come_from_standard_input(sidecar: RunningSidecar) -> None:
    text = "a gorgeous, witty, seductive movie " * 40  # longer than a shell argument likes
    out = subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", "explain", "-", "--json"],
        input=text + "\n",
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "LIMELIGHT_TARGET": sidecar.target},
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["text"] == text  # the final newline is not part of it


def test_explain_lines_prints_json_lines_in_order(sidecar: RunningSidecar, tmp_path: Path) -> None:
    texts = [
        f"review {i}: a {'gorgeous, witty' if i % 2 else 'dull, tired'} film" for i in range(9)
    ]
    lines = [texts[0], "", *texts[1:5], "   ", *texts[5:]]  # blank lines are skipped
    path = tmp_path / "reviews.txt"
    path.write_text("\n".join(lines) + "\n")
    out = limelight(
        "explain", "--lines", str(path), "--texts-per-call", "4", "--connections", "2",
        "--target", sidecar.target,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["text"] for r in rows] == texts
    assert [r["line"] for r in rows] == [n + 1 for n, t in enumerate(lines) if t.strip()]
    assert "explained 9 line(s)" in out.stderr
    one = json.loads(limelight("explain", texts[3], "--target", sidecar.target, "--json").stdout)
    assert rows[3]["label"] == one["label"]
    for a, b in zip(rows[3]["scores"], one["scores"], strict=True):
        assert abs(a - b) < 1e-4

    piped = subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", "explain", "--lines", "-", "--class", "fresh"],
        input="\n".join(texts[:3]),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "LIMELIGHT_TARGET": sidecar.target},
    )
    assert piped.returncode == 0, piped.stderr
    rows = [json.loads(line) for line in piped.stdout.splitlines()]
    assert [r["text"] for r in rows] == texts[:3]
    assert {r["target_label"] for r in rows} == {"fresh"}


def test_a_reader_that_leaves_ends_the_command_quietly(
    sidecar: RunningSidecar, tmp_path: Path
) -> None:
    """`limelight explain --lines big.txt | head -1`: when the reader closes the pipe the
    command stops with the shell's SIGPIPE status (141) and no error or traceback."""
    path = tmp_path / "many.txt"
    path.write_text("".join(f"a fine film, take {i}\n" for i in range(3000)), encoding="utf-8")
    reader = subprocess.Popen(
        [sys.executable, "-m", "limelight.cli.main", "explain", "--lines", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "LIMELIGHT_TARGET": sidecar.target},
    )
    assert reader.stdout is not None and reader.stderr is not None
    assert json.loads(reader.stdout.readline())["line"] == 1
    reader.stdout.close()  # as `head -1` does after its line
    err = reader.stderr.read().decode()
    assert reader.wait(timeout=600) == 141, err
    assert "error" not in err and "Traceback" not in err and "Exception" not in err, err


def test_explain_lines_local_matches_server(
    sidecar: RunningSidecar, bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """--lines --local runs the server's code path in this process: the same JSON lines."""
    path = tmp_path / "reviews.txt"
    path.write_text("a gorgeous, witty film\n\na dull, tired film\nfine\n")
    remote = limelight("explain", "--lines", str(path), "--target", sidecar.target)
    local = limelight("explain", "--lines", str(path), "--local", "--model", str(bert_tiny_dir))
    assert remote.returncode == 0 and local.returncode == 0, local.stderr
    assert "explained 3 line(s)" in local.stderr
    remote_rows = [json.loads(line) for line in remote.stdout.splitlines()]
    local_rows = [json.loads(line) for line in local.stdout.splitlines()]
    assert [r["line"] for r in local_rows] == [1, 3, 4]
    for a, b in zip(remote_rows, local_rows, strict=True):
        assert (a["line"], a["text"], a["label"]) == (b["line"], b["text"], b["label"])
        assert max(abs(x - y) for x, y in zip(a["scores"], b["scores"], strict=True)) < 1e-4

    path.write_text("a fine film\n\nanother fine film\n" + "x" * 20_001 + "\nnever sent\n")
    failed = limelight("explain", "--lines", str(path), "--local", "--model", str(bert_tiny_dir))
    assert failed.returncode == 1
    assert [json.loads(line)["line"] for line in failed.stdout.splitlines()] == [1, 3]
    assert failed.stderr.strip().splitlines()[-1].startswith("limelight explain: error: line 4: ")
    job = limelight(
        "explain", "--lines", str(path), "--local", "--model", str(bert_tiny_dir), "--method", "lrp"
    )  # fmt: skip
    assert job.returncode == 2 and "inline methods" in job.stderr


def test_explain_lines_keep_going(
    sidecar: RunningSidecar, bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """--keep-going: a line the server refuses gets its error in its place, the others their
    answers; the exit status says that some failed. The same with --local."""
    path = tmp_path / "reviews.txt"
    path.write_text("a gorgeous film\n\n" + "x" * 30_000 + "\na dull mess\n" + "y" * 30_000 + "\n")
    remote = limelight(
        "explain", "--lines", str(path), "--target", sidecar.target, "--keep-going",
        "--texts-per-call", "2",
    )  # fmt: skip
    local = limelight(
        "explain", "--lines", str(path), "--local", "--model", str(bert_tiny_dir), "--keep-going"
    )  # fmt: skip
    for run in (remote, local):
        assert run.returncode == 1, run.stderr
        rows = [json.loads(line) for line in run.stdout.splitlines()]
        assert [r["line"] for r in rows] == [1, 3, 4, 5]  # blank lines are skipped, not failed
        assert ["error" in r for r in rows] == [False, True, False, True]
        assert rows[1]["error"]["code"] == "INVALID_ARGUMENT"
        assert "limit" in rows[1]["error"]["message"]
        assert rows[0]["label"] and rows[2]["label"]
        assert "explained 2 line(s)" in run.stderr
        assert "2 line(s) failed (INVALID_ARGUMENT 2)" in run.stderr
    # Without it the first failure ends the run, naming its line.
    stopped = limelight("explain", "--lines", str(path), "--target", sidecar.target)
    assert stopped.returncode == 1
    assert stopped.stderr.strip().splitlines()[-1].startswith("limelight explain: error: line 3: ")


def test_explain_lines_answers_piped_lines_as_they_come(sidecar: RunningSidecar) -> None:
    """A line written to a live pipe is answered before the next one is written (not held
    back until a whole call of --texts-per-call lines has arrived)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "limelight.cli.main", "explain", "--lines", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LIMELIGHT_TARGET": sidecar.target},
    )
    assert proc.stdin is not None and proc.stdout is not None
    # Fails the test instead of hanging it if the answer never comes.
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        for n, text in enumerate(["a gorgeous movie", "a dull, tired film"], start=1):
            proc.stdin.write(text + "\n")
            proc.stdin.flush()
            row = json.loads(proc.stdout.readline())
            assert (row["line"], row["text"]) == (n, text)
        proc.stdin.close()
        assert proc.wait() == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        watchdog.cancel()
        proc.kill()


def test_explain_lines_names_the_line_that_failed(sidecar: RunningSidecar, tmp_path: Path) -> None:
    path = tmp_path / "reviews.txt"
    path.write_text("a fine film\n\nanother fine film\n" + "x" * 20_001 + "\nnever sent\n")
    out = limelight("explain", "--lines", str(path), "--texts-per-call", "2",
                    "--target", sidecar.target)  # fmt: skip
    assert out.returncode == 1
    assert [json.loads(line)["line"] for line in out.stdout.splitlines()] == [1, 3]
    assert out.stderr.strip().splitlines()[-1].startswith("limelight explain: error: line 4: ")
    assert "20000" in out.stderr.replace(",", "") and "2 line(s) explained before it" in out.stderr
    wrong = limelight("explain", "--lines", str(path), "--class", "meh", "--target", sidecar.target)
    assert (
        wrong.returncode == 1
        and "limelight explain: error: line 1: unknown label 'meh'" in wrong.stderr
    )
    job = limelight("explain", "--lines", str(path), "--method", "lrp", "--target", sidecar.target)
    assert job.returncode == 2 and "inline methods" in job.stderr
    for bad in (
        ["x", "--lines", str(path)],
        ["--lines", str(tmp_path / "missing.txt")],
        ["--lines", str(path), "--param", "steps=8"],  # inline methods take none
    ):
        refused = limelight("explain", *bad, "--target", sidecar.target)
        assert refused.returncode == 2 and refused.stderr.startswith("limelight explain: error: ")


@pytest.mark.parametrize("texts_per_call", ["16", "1"], ids=["calls", "streams"])
def test_explain_lines_prints_every_line_before_the_refused_one(
    sidecar: RunningSidecar, tmp_path: Path, texts_per_call: str
) -> None:
    # The refused line in the middle of a call: the lines before it in the same call are
    # printed too, and the error names the line, with one call per text as well.
    path = tmp_path / "reviews.txt"
    path.write_text("one fine film\ntwo fine films\nthree\n" + "x" * 20_001 + "\nfive\n")
    out = limelight("explain", "--lines", str(path), "--texts-per-call", texts_per_call,
                    "--target", sidecar.target)  # fmt: skip
    assert out.returncode == 1
    assert [json.loads(line)["line"] for line in out.stdout.splitlines()] == [1, 2, 3]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("limelight explain: error: line 4: text has 20001 characters")
    assert last.endswith("(3 line(s) explained before it)")


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_explain_lines_reads_text_as_it_comes(
    sidecar: RunningSidecar, tmp_path: Path, source: str
) -> None:
    # A byte-order mark is not text; a line ends at a line feed (CRLF too), not at a lone
    # carriage return; bytes that are not UTF-8 are read as U+FFFD with a warning, not a
    # traceback.
    raw = b"\xef\xbb\xbfgreat movie\r\nbad\rworse film\r\ncaf\xe9 good\n"
    path = tmp_path / "reviews.txt"
    path.write_bytes(raw)
    argv = [sys.executable, "-m", "limelight.cli.main", "explain", "--lines"]
    argv += [str(path) if source == "file" else "-", "--target", sidecar.target]
    out = subprocess.run(
        argv,
        input=raw if source == "stdin" else None,
        capture_output=True,
        timeout=600,
        env={**os.environ, "PYTHONIOENCODING": ""},
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["line"], r["text"]) for r in rows] == [
        (1, "great movie"),
        (2, "bad\rworse film"),
        (3, "caf\ufffd good"),
    ]
    assert b"warning: line 3 is not valid UTF-8" in out.stderr
    one = subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", "explain", "-", "--json"],
        input=b"caf\xe9 \xff good\r\n",
        capture_output=True,
        timeout=600,
        env={**os.environ, "LIMELIGHT_TARGET": sidecar.target},
    )
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["text"] == "caf\ufffd \ufffd good"
    assert b"warning: the input is not valid UTF-8" in one.stderr


def test_a_class_named_like_an_index_is_the_class_of_that_name() -> None:
    from limelight.cli.explain import _target

    def never() -> list[str]:
        raise AssertionError("labels asked for a name")

    stars = ["1", "2", "3", "4", "5"]  # a star-rating model
    assert _target("1", lambda: stars) == "1" and _target("0", lambda: stars) == 0
    assert _target("1", lambda: ["rotten", "fresh"]) == 1
    assert _target("-1", lambda: ["rotten", "fresh"]) == -1  # the server says what is wrong
    assert _target("fresh", never) == "fresh" and _target("\u00b2", never) == "\u00b2"
    assert _target(None, never) is None


@pytest.mark.parametrize("texts_per_call", ["16", "1"], ids=["calls", "streams"])
def test_explain_lines_ends_when_the_server_stops_answering(
    tmp_path: Path, texts_per_call: str
) -> None:
    """A gRPC server that takes the calls (or the streams' texts) and never answers them (a
    hung sidecar): `--timeout` bounds the wait for an answer, so the run fails with a message
    instead of waiting forever."""
    from concurrent import futures

    import grpc

    from limelight_client.proto import explainer_pb2_grpc as pb_grpc

    released = threading.Event()

    class Hung(pb_grpc.ExplainerServicer):
        def ExplainBatch(self, request: object, context: grpc.ServicerContext) -> None:
            released.wait(60)
            context.abort(grpc.StatusCode.UNAVAILABLE, "released")

        def ExplainStream(self, requests: Iterator[object], context: object) -> Iterator[object]:
            for _ in requests:  # takes every text, answers none
                pass
            released.wait(60)
            return iter(())

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ExplainerServicer_to_server(Hung(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    path = tmp_path / "reviews.txt"
    path.write_text("a fine film\nanother fine film\n")
    try:
        # The watchdog turns a hang (the bug) into a failure rather than a stuck suite.
        target = f"127.0.0.1:{port}"
        out = limelight(
            "explain", "--lines", str(path), "--target", target, "--timeout", "1",
            "--texts-per-call", texts_per_call, timeout=120,
        )  # fmt: skip
    finally:
        released.set()
        server.stop(grace=None)
    assert out.returncode == 1
    assert out.stdout == ""
    assert "deadline" in out.stderr.lower(), out.stderr


def test_an_interrupted_wait_says_the_job_goes_on(sidecar: RunningSidecar) -> None:
    """Ctrl-C on `explain --wait` ends the CLI (status 130), not the job, which lives in the
    sidecar: the CLI says so, with the commands that follow or cancel it."""
    argv = [sys.executable, "-m", "limelight.cli.main", "explain", "a gorgeous movie"]
    argv += ["--method", "slalom", "--param", "epochs=10000", "--wait"]
    argv += ["--target", sidecar.target]
    # As at a terminal: a suite run in the background or by pytest-xdist's workers ignores
    # SIGINT, and a child that inherits that never sees Ctrl-C (exec keeps ignored signals).
    inherited = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, inherited)
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        assert proc.stderr is not None
        seen, job_id = [], None
        for line in proc.stderr:  # one line per state off a terminal
            seen.append(line)
            if job_id := re.match(r"slalom ([0-9a-f]{8}): running", line):
                break
        assert job_id is not None, seen
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait() == 130
    finally:
        watchdog.cancel()
        proc.kill()
    said = re.search(r"interrupted: job ([0-9a-f]{32}) is still running on the sidecar", rest)
    assert said is not None, rest
    full = said.group(1)
    assert full.startswith(job_id.group(1))
    assert f"`limelight jobs cancel {full}`" in rest and "Traceback" not in rest
    stopped = limelight("jobs", "cancel", full, "--target", sidecar.target)
    assert stopped.returncode == 0, stopped.stderr


def test_a_wait_timeout_gives_up_following_the_job_not_the_job(sidecar: RunningSidecar) -> None:
    """`--wait-timeout` bounds how long `explain --wait` and `jobs watch` follow a job (a
    script must not hang on a queue no worker consumes): exit status 1 with where the job
    stood, and the job goes on in the sidecar."""
    target = ["--target", sidecar.target]
    text = " ".join(["a gorgeous, witty, seductive movie that never loses its nerve"] * 12)
    out = limelight(
        "explain", text, "--method", "shapley", "--param", "permutations=256",
        "--wait-timeout", "1", *target,
    )  # fmt: skip
    assert out.returncode == 1 and out.stdout == "", out.stderr
    said = re.search(
        r"error: job ([0-9a-f]{32}) not finished after 1 s \((queued|running)", out.stderr
    )
    assert said is not None, out.stderr
    job = said.group(1)
    assert f"follow it with `limelight jobs watch {job}`" in out.stderr
    again = limelight("jobs", "watch", job, "--wait-timeout", "0.5", *target)
    assert again.returncode == 1 and f"job {job} not finished after 0.5 s" in again.stderr
    shown = json.loads(limelight("jobs", "show", job, "--json", *target).stdout)
    assert shown["state"] in ("QUEUED", "RUNNING")
    assert limelight("jobs", "cancel", job, *target).returncode == 0
    refused = limelight("jobs", "watch", job, "--wait-timeout", "0", *target)
    assert refused.returncode == 2 and "--wait-timeout" in refused.stderr


def test_words_show_whole_words_in_the_map_the_lists_and_json(sidecar: RunningSidecar) -> None:
    """`--words` merges each word's pieces (BERT-tiny cuts "unwatchable" into three) into one
    token whose score is the sum of its pieces', punctuation apart; jobs too."""
    text = "an unwatchable, overwrought misfire"
    target = ("--target", sidecar.target)
    pieces = json.loads(limelight("explain", text, "--json", *target).stdout)
    assert "##watch" in [t["text"] for t in pieces["tokens"]]
    out = limelight("explain", text, "--json", "--words", *target)
    assert out.returncode == 0, out.stderr
    words = json.loads(out.stdout)
    shown = [t for t in words["tokens"] if not t["special"]]
    assert [t["text"] for t in shown] == ["an", "unwatchable", ",", "overwrought", "misfire"]
    for token, score in zip(words["tokens"], words["scores"], strict=True):
        if token["special"]:
            continue
        inside = [
            s
            for t, s in zip(pieces["tokens"], pieces["scores"], strict=True)
            if not t["special"] and token["start"] <= t["start"] and t["end"] <= token["end"]
        ]
        assert score == pytest.approx(sum(inside), rel=1e-4, abs=1e-6)

    printed = limelight("explain", text, "--words", "--no-color", *target)
    assert printed.returncode == 0, printed.stderr
    assert "unwatchable[" in printed.stdout and "##" not in printed.stdout
    assert re.search(r'^for \w+: "(unwatchable|overwrought|misfire)"', printed.stdout, re.M)

    submitted = limelight("explain", text, "--method", "grad_x_input", "--json", *target)
    job = json.loads(submitted.stdout)["id"]
    assert limelight("jobs", "watch", job, *target).returncode == 0
    page = limelight("jobs", "show", job, "--words", "--no-color", *target)
    assert page.returncode == 0, page.stderr
    assert "unwatchable[" in page.stdout and "##" not in page.stdout
    data = json.loads(limelight("jobs", "show", job, "--words", "--json", *target).stdout)
    assert "unwatchable" in [t["text"] for t in data["result"]["tokens"]]
