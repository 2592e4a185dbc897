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
    assert unreachable.returncode == 1
    # where it looked and how to point it elsewhere, not gRPC's resolver internals
    assert "cannot reach a sidecar at 127.0.0.1:1 (connection refused)" in unreachable.stderr
    assert "--target" in unreachable.stderr and "ipv4:" not in unreachable.stderr
    jobs = limelight("jobs", "list", "--target", "127.0.0.1:1", "--timeout", "2")
    assert jobs.returncode == 1 and "cannot reach a sidecar at 127.0.0.1:1" in jobs.stderr
    unknown = limelight("explain", "fine", "--method", "nope", "--target", sidecar.target)
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("error: unknown method 'nope'; offered: ")
    assert "normxlogit" in unknown.stderr and "KeyError" not in unknown.stderr


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
