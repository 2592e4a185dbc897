"""The command `limelight distill --out DIR` prints to serve the head it wrote, run as printed."""

from __future__ import annotations

import datetime
import re
import subprocess
from pathlib import Path

from limelight.cli.distill import serve_hint


def _head(directory: Path, name: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "card.json").write_text(name)
    return directory


def _run_printed(line: str) -> None:
    assert re.match(r"  mv ", line), line  # the command on a line of its own, to copy
    subprocess.run(["bash", "-c", line.strip()], check=True)


def test_the_hint_moves_the_head_beside_a_model_without_one(tmp_path: Path) -> None:
    out = _head(tmp_path / "my heads" / "new", "new")  # a space: the paths are quoted
    dest = tmp_path / "model" / "limelight_distilled"
    dest.parent.mkdir()
    lines = serve_hint(out, dest)
    _run_printed(lines[1])
    assert (dest / "card.json").read_text() == "new" and not out.exists()
    assert "limelight serve --model" in lines[-1]


def test_the_hint_replaces_a_served_head_and_keeps_it(tmp_path: Path) -> None:
    """A plain `mv OUT DEST` would move the new head into the old one, which stays served."""
    out = _head(tmp_path / "new", "new")
    dest = _head(tmp_path / "model" / "limelight_distilled", "old")
    when = datetime.datetime(2026, 12, 6, 3, 4, 5)
    lines = serve_hint(out, dest, now=when)
    assert "limelight_distilled.replaced-20261206-030405" in lines[0]
    _run_printed(lines[1])
    assert (dest / "card.json").read_text() == "new"
    assert sorted(p.name for p in dest.iterdir()) == ["card.json"]  # nothing nested
    kept = dest.with_name("limelight_distilled.replaced-20261206-030405")
    assert (kept / "card.json").read_text() == "old"
