"""`limelight build-demo` through the real command-line entry point."""

from __future__ import annotations

from pathlib import Path

import pytest

from limelight.cli.main import build_parser, main
from limelight.demo.build import DemoCard


def test_build_demo_is_registered() -> None:
    args = build_parser().parse_args(["build-demo", "--model", "bert-tiny", "--force"])
    assert args.model == "bert-tiny" and args.force and callable(args.func)
    defaults = build_parser().parse_args(["build-demo"])
    assert defaults.model == "all" and defaults.cache_dir is None and not defaults.force


def test_build_demo_reports_a_cached_model(
    bert_tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = bert_tiny_dir.parent.parent
    before = (bert_tiny_dir / "model.safetensors").stat().st_mtime_ns
    code = main(["build-demo", "--model", "bert-tiny", "--cache-dir", str(cache), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    card = DemoCard.read(bert_tiny_dir)
    assert f"bert-tiny: {bert_tiny_dir}" in out
    assert f"test accuracy {card.accuracy:.4f} ({card.n_test} held-out reviews)" in out
    assert "(cached)" in out
    assert (bert_tiny_dir / "model.safetensors").stat().st_mtime_ns == before


def test_build_demo_reads_the_cache_dir_from_the_environment(
    bert_tiny_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIMELIGHT_CACHE_DIR", str(bert_tiny_dir.parent.parent))
    assert main(["build-demo", "--model", "bert-tiny", "--quiet"]) == 0
    assert str(bert_tiny_dir) in capsys.readouterr().out
