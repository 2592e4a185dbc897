"""Drift settings that could never compare a label are refused at start, in one line.

A label is compared once the window and the reference each hold ``drift_min_count``
explanations of it. A ``drift_window`` below that (or, without a reference file, a
``drift_bootstrap_n`` below it) left every label NaN for ever, and ``limelight drift`` said
"not compared yet"."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from limelight.cli.main import EXIT_USAGE, main
from limelight.settings import Settings


@pytest.mark.parametrize(
    ("settings", "short"),
    [
        ({"drift_window": 100}, ["drift_window is 100"]),
        ({"drift_bootstrap_n": 100}, ["drift_bootstrap_n is 100"]),
        (
            {"drift_window": 90, "drift_bootstrap_n": 60},
            ["drift_window is 90", "bootstrap_n is 60"],
        ),
        ({"drift_window": 50, "drift_bootstrap_n": 50, "drift_min_count": 51}, ["is 50"]),
    ],
)
def test_a_window_or_bootstrap_below_min_count_is_refused(
    settings: dict[str, object], short: list[str]
) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(**settings)  # type: ignore[arg-type]
    message = str(caught.value)
    for said in short:
        assert said in message
    # what is wrong and what to do, naming the three settings
    for said in ("below drift_min_count", "raise drift_window and drift_bootstrap_n to at least"):
        assert said in message
    assert "or lower drift_min_count" in message


@pytest.mark.parametrize(
    "settings",
    [
        {},  # the defaults: 500, 500, 150
        {"drift_window": 150, "drift_bootstrap_n": 150},  # equal is enough
        {"drift_window": 100, "drift_bootstrap_n": 20, "drift_min_count": 20},
        {"drift_window": 100, "drift_enabled": False},  # no monitor: nothing to compare
        # a reference file: the bootstrap is not what the reference is made of
        {"drift_bootstrap_n": 10, "drift_reference": Path("ref.json")},
    ],
)
def test_settings_that_can_compare_are_accepted(settings: dict[str, object]) -> None:
    Settings(**settings)  # type: ignore[arg-type]


def test_a_reference_file_does_not_excuse_a_small_window() -> None:
    with pytest.raises(ValidationError, match="drift_window is 100"):
        Settings(drift_window=100, drift_reference=Path("ref.json"))


def test_serve_stops_with_one_line_saying_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused with the other settings, before a port opens or a model loads."""
    monkeypatch.setenv("LIMELIGHT_DRIFT_WINDOW", "100")
    status = main(["serve", "--port", "0", "--metrics-port", "0", "--jobs", "off",
                   "--model", str(tmp_path / "unused")])  # fmt: skip
    err = capsys.readouterr().err
    assert status == EXIT_USAGE, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("limelight serve: error: invalid setting"), line
    assert "drift_window is 100, below drift_min_count (150)" in line
    for variable in ("DRIFT_WINDOW", "DRIFT_BOOTSTRAP_N", "DRIFT_MIN_COUNT"):
        assert f"LIMELIGHT_{variable}" in line
