"""`limelight serve` flags for the OIP/KServe side: --model-name, --http-tls, --metrics-port."""

from __future__ import annotations

import argparse

import pytest

from limelight.cli.common import settings_from_args
from limelight.cli.serve import register
from limelight.settings import Settings


def _settings(*argv: str) -> Settings:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return settings_from_args(parser.parse_args(["serve", *argv]))


def test_flags_reach_settings() -> None:
    settings = _settings("--model-name", "classifier", "--no-http-tls", "--metrics-port", "8080")
    assert (settings.model_name, settings.http_tls, settings.metrics_port) == (
        "classifier",
        False,
        8080,
    )


def test_defaults_leave_the_environment_in_charge(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIMELIGHT_MODEL_NAME", raising=False)
    monkeypatch.delenv("LIMELIGHT_HTTP_TLS", raising=False)
    settings = _settings()
    assert settings.model_name is None and settings.http_tls is True
    monkeypatch.setenv("LIMELIGHT_MODEL_NAME", "from-env")
    assert _settings().model_name == "from-env"
