"""`limelight bench` as a user runs it: a quick served run writes its report."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cli.test_explain_cli import limelight


@pytest.mark.parametrize(("rpc", "workers"), [("stream", 1), ("http", 2)])
def test_quick_served_bench(bert_tiny_dir: Path, tmp_path: Path, rpc: str, workers: int) -> None:
    """Over streams, and over the HTTP port of two workers (which share it)."""
    out = tmp_path / "bench"
    done = limelight(
        "bench",
        "--model",
        str(bert_tiny_dir),
        "--quick",
        "--sections",
        "served",
        "--runtimes",
        "onnx",
        "--clients",
        "2",
        "--rpc",
        rpc,
        "--workers",
        str(workers),
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = (out / "bench.md").read_text()
    assert f"--rpc {rpc}" in report  # the command that made it, for the docs
    assert f"closed loop, {rpc} calls" in report
    row = re.search(r"^\| onnx \| 2 \| ([\d.]+) \| [\d.]+ \| ([\d.e+]+) \|", report, re.M)
    assert row is not None, report
    assert float(row.group(1)) > 0 and float(row.group(2)) > 0  # p50 and req/s were measured
    assert (out / "bench.png").stat().st_size > 0


def test_bench_refuses_an_unknown_rpc(bert_tiny_dir: Path, tmp_path: Path) -> None:
    done = limelight(
        "bench", "--model", str(bert_tiny_dir), "--rpc", "bidi", "--out", str(tmp_path)
    )
    assert done.returncode == 2 and "--rpc" in done.stderr
