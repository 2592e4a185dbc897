"""`fit-lm-head` and `calibrate-heads` read their `--data` as every other command does: a file
without text, or one that is not UTF-8, is one line naming it, with exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from limelight.cli.main import EXIT_USAGE, main

COMMANDS = [("fit-lm-head", "--no-progress"), ("calibrate-heads", "--no-syntax", "--quiet")]


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.strip().splitlines() if line.strip()][-1]


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("empty.txt", b""),
        ("blank.txt", b"\n   \n\n"),
        ("empty.jsonl", b""),
        ("header_only.csv", b"text,label\n"),
    ],
)
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_data_without_text_is_refused(
    command: tuple[str, ...],
    name: str,
    content: bytes,
    bert_tiny_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """fit-lm-head ended in an IndexError traceback."""
    data = tmp_path / name
    data.write_bytes(content)
    out = tmp_path / "out"
    argv = [*command, "--model", str(bert_tiny_dir), "--data", str(data), "--out", str(out)]
    assert main(argv) == EXIT_USAGE
    assert _error_line(capsys) == f"limelight {command[0]}: error: {data}: no text in it"
    assert not out.exists()


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_text_file_that_is_not_utf8_is_named_with_its_line(
    command: tuple[str, ...],
    bert_tiny_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A Latin-1 .txt was a bare UnicodeDecodeError with exit status 1."""
    data = tmp_path / "latin1.txt"
    data.write_bytes("fine\ncaf\xe9 au lait\n".encode("latin-1"))
    out = tmp_path / "out"
    argv = [*command, "--model", str(bert_tiny_dir), "--data", str(data), "--out", str(out)]
    assert main(argv) == EXIT_USAGE
    assert _error_line(capsys).startswith(
        f"limelight {command[0]}: error: {data}:2: not UTF-8 text; convert the file"
    )
