"""What the settings accept, and what they say about LIMELIGHT_* variables they do not know."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from limelight.core.prediction import label_thresholds
from limelight.errors import InvalidArgument
from limelight.settings import Settings, job_backend_kind, unknown_variables


def test_misspelt_variables_are_named_with_the_setting_meant() -> None:
    environ = {
        "LIMELIGHT_MAX_BATCHSIZE": "8",  # a misspelt setting
        "limelight_drift_windows": "3",  # read without case, as the settings read them
        "LIMELIGHT_FOO": "1",  # like nothing: no guess
        "LIMELIGHT_MAX_BATCH_SIZE": "8",  # settings and the CLI client's variables: fine
        "LIMELIGHT_TARGET": "host:50051",
        "LIMELIGHT_TOKEN": "t",
        "PATH": "/bin",
    }
    assert unknown_variables(environ) == [
        "LIMELIGHT_FOO is not a Limelight setting and is ignored",
        "LIMELIGHT_MAX_BATCHSIZE is not a Limelight setting and is ignored; "
        "did you mean LIMELIGHT_MAX_BATCH_SIZE?",
        "limelight_drift_windows is not a Limelight setting and is ignored; "
        "did you mean LIMELIGHT_DRIFT_WINDOW?",
    ]


@pytest.mark.parametrize(
    ("spec", "kind"),
    [
        ("sqlite", "sqlite"),
        ("off", "off"),
        ("", "off"),
        (" redis://queue:6379/0 ", "redis"),
        ("rediss://user@queue:6380/0", "redis"),
        ("unix:///run/redis.sock", "redis"),
    ],
)
def test_job_backends(spec: str, kind: str) -> None:
    assert job_backend_kind(spec) == kind


@pytest.mark.parametrize("spec", ["redis", "postgres://db/0", "redis:/queue", "sqlite3"])
def test_unknown_job_backends(spec: str) -> None:
    with pytest.raises(ValueError, match="unknown job backend"):
        job_backend_kind(spec)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "auto", " cuda:0 ", "CPU"])
def test_devices(device: str) -> None:
    assert Settings(device=device).device == device.strip().lower()


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu", "cuda:", ""])
def test_unknown_devices_are_refused_with_the_settings(device: str) -> None:
    with pytest.raises(ValidationError, match="the device is cpu, cuda, cuda:N"):
        Settings(device=device)


def test_log_levels() -> None:
    assert Settings(log_level="debug").log_level == "DEBUG"
    with pytest.raises(ValidationError, match="the log level is one of DEBUG, INFO"):
        Settings(log_level="verbose")


def test_the_job_backend_is_kept_without_surrounding_blanks() -> None:
    # a value from a YAML block or a shell line keeps no stray blank for the Redis client
    assert Settings(jobs=" redis://queue:6379/0\n").jobs == "redis://queue:6379/0"


@pytest.mark.parametrize(
    ("values", "setting"),
    [
        ({"label_threshold": 0}, "label_threshold"),
        ({"label_threshold": 1.5}, "label_threshold"),
        ({"label_thresholds": {"negative": 0.3, "toxic": 0.0}}, "label_thresholds.toxic"),
        ({"label_thresholds": {"toxic": float("nan")}}, "label_thresholds.toxic"),
    ],
)
def test_label_thresholds_out_of_range_are_refused_with_the_settings(
    values: dict[str, Any], setting: str
) -> None:
    """A threshold the prediction rule refuses is refused here, before a model loads: at 0
    every label would be predicted."""
    with pytest.raises(ValidationError) as refused:
        Settings(**values)
    assert [".".join(map(str, e["loc"])) for e in refused.value.errors()] == [setting]
    # the prediction rule checks the same range
    for value in (0.0, 1.5, float("nan")):
        with pytest.raises(InvalidArgument, match=r"is not in \(0, 1\]"):
            label_thresholds(["toxic"], value, {})
    assert Settings(label_threshold=1, label_thresholds={"toxic": 1e-6}).label_threshold == 1
    assert label_thresholds(["toxic"], 1.0, {"toxic": 1e-6}) == [1e-6]
