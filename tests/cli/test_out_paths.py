"""Where `limelight eval` and `limelight export-onnx` write (``--out``) and what they read
(``--data``): a path that cannot serve is refused in one line naming it, with status 2 like
every other argument error."""

from __future__ import annotations

from pathlib import Path

import pytest

from limelight.cli.main import main


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_eval_out_that_is_a_file(
    random_bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "results.txt"
    taken.write_text("mine")
    base = ["eval", "--model", str(random_bert_dir), "--methods", "normxlogit", "--no-progress"]
    assert main([*base, "--out", str(taken)]) == 2
    line = error_line(capsys)
    assert line == f"limelight eval: error: --out {taken} is a file, not a directory"

    below = taken / "run" / "1"
    assert main([*base, "--out", str(below)]) == 2
    line = error_line(capsys)
    assert f"--out {below}: {taken} is a file, not a directory" in line
    assert "File exists" not in line and "Not a directory" not in line
    assert taken.read_text() == "mine"


def test_export_onnx_out_below_a_file_or_a_directory(
    random_bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "graphs"
    taken.write_text("mine")
    graph = taken / "g.onnx"
    assert main(["export-onnx", "--model", str(random_bert_dir), "--out", str(graph)]) == 2
    line = error_line(capsys)
    assert line == (
        f"limelight export-onnx: error: --out {graph}: {taken} is a file, not a directory"
    )
    assert main(["export-onnx", "--model", str(random_bert_dir), "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a directory" in error_line(capsys)


def test_eval_data_with_a_header_and_no_rows_is_a_usage_error(
    random_bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n")
    args = ["eval", "--model", str(random_bert_dir), "--data", str(empty)]
    code = main([*args, "--methods", "normxlogit", "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 2
    line = error_line(capsys)
    assert line == f"limelight eval: error: {empty}: no examples to evaluate (no rows)"
