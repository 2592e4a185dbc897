"""`limelight explain` as a user runs it: against a sidecar, and in-process with --local."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import RunningSidecar


def limelight(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


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
    assert "\x1b[" in shown.stdout and "top tokens:" in shown.stdout
    html = page.read_text()
    assert "<html" in html.lower() and "gorgeous" in html and "http://" not in html

    plain = limelight("explain", text, "--target", sidecar.target, env={"NO_COLOR": "1"})
    assert "\x1b[" not in plain.stdout and "gorgeous" in plain.stdout


def test_explain_local_matches_server(sidecar: RunningSidecar, bert_tiny_dir: Path) -> None:
    text = "the plot is thin but the actors are superb"
    remote = json.loads(limelight("explain", text, "--target", sidecar.target, "--json").stdout)
    local = limelight("explain", text, "--local", "--model", str(bert_tiny_dir), "--json")
    assert local.returncode == 0, local.stderr
    data = json.loads(local.stdout)
    assert data["label"] == remote["label"]
    for a, b in zip(data["scores"], remote["scores"], strict=True):
        assert abs(a - b) < 1e-4


def test_bad_input_exits_non_zero_with_a_clear_message(sidecar: RunningSidecar) -> None:
    out = limelight("explain", "fine", "--class", "meh", "--target", sidecar.target)
    assert out.returncode == 1
    assert "unknown label 'meh'" in out.stderr
    unreachable = limelight("explain", "x", "--target", "127.0.0.1:1", "--timeout", "2")
    assert unreachable.returncode == 1 and "error" in unreachable.stderr.lower()
