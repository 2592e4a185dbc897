"""Flags that a combination of options would drop without a word are refused instead: one
line, exit status 2, before a model loads or a sidecar is called."""

from __future__ import annotations

from pathlib import Path

import pytest

from limelight.cli.main import EXIT_USAGE, main


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def lines_file(tmp_path: Path) -> Path:
    path = tmp_path / "lines.txt"
    path.write_text("a good film\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["hi", "--keep-going"], "--keep-going goes with --lines"),
        (["hi", "--texts-per-call", "4"], "--texts-per-call goes with --lines"),
        (
            ["hi", "--keep-going", "--texts-per-call", "4"],
            "--keep-going and --texts-per-call go with --lines",
        ),
        (
            ["hi", "--local", "--target", "otherhost:50051"],
            "--local explains in this process and calls no sidecar: drop --target",
        ),
        (
            ["hi", "--local", "--token", "secret"],
            "--local explains in this process and calls no sidecar: drop --token",
        ),
        (
            ["--lines", "LINES", "--local", "--texts-per-call", "4"],
            "--local explains in this process and calls no sidecar: drop --texts-per-call",
        ),
    ],
)
def test_explain_refuses_flags_it_would_ignore(
    argv: list[str],
    said: str,
    lines_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("LIMELIGHT_TARGET", raising=False)
    monkeypatch.delenv("LIMELIGHT_TOKEN", raising=False)
    argv = [str(lines_file) if a == "LINES" else a for a in argv]
    # No model is at --model and no sidecar at the default target: getting that far would
    # fail with another message.
    status = main(["explain", *argv, "--model", str(tmp_path / "no-model-here")])
    assert status == EXIT_USAGE
    assert _error_line(capsys) == f"limelight explain: error: {said}"


def test_explain_local_accepts_a_target_set_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """LIMELIGHT_TARGET / LIMELIGHT_TOKEN set for other commands are no mistake with --local:
    the command goes on (here to the missing model)."""
    monkeypatch.setenv("LIMELIGHT_TARGET", "otherhost:50051")
    monkeypatch.setenv("LIMELIGHT_TOKEN", "secret")
    main(["explain", "hi", "--local", "--model", str(tmp_path / "no-model-here")])
    line = _error_line(capsys)
    assert "calls no sidecar" not in line and "no-model-here" in line, line


def test_export_onnx_refuses_fidelity_n_without_int8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-model-here"
    status = main(["export-onnx", "--model", str(missing), "--fidelity-n", "50"])
    assert status == EXIT_USAGE
    assert _error_line(capsys) == (
        "limelight export-onnx: error: --fidelity-n goes with --int8: it sizes the int8 "
        "graph's report"
    )


def test_bench_refuses_texts_without_against(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = tmp_path / "short.txt"
    texts.write_text("a good film\n", encoding="utf-8")
    out = tmp_path / "out"
    status = main(["bench", "--texts", str(texts), "--quick", "--out", str(out)])
    assert status == EXIT_USAGE
    assert _error_line(capsys) == (
        "limelight bench: error: --texts goes with --against; a local run sends the test reviews"
    )
    assert not out.exists()
