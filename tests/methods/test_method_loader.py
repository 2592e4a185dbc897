"""One method loader for the sidecar, workers, evaluation and distillation."""

from __future__ import annotations

from pathlib import Path

import pytest

from limelight.errors import InvalidArgument
from limelight.methods.base import BUILTIN_METHODS, MethodRegistry, load_method_class
from limelight.methods.decoded_gradcam import DecodedGradCAM
from limelight.settings import Settings
from tests.methods.loader_plugins import LengthMethod

PLUGIN = "tests.methods.loader_plugins:LengthMethod"


def test_builtins_load_unconfigured_without_settings() -> None:
    registry = MethodRegistry.load()
    assert set(registry.names()) <= set(BUILTIN_METHODS)
    assert {"normxlogit", "integrated_gradients", "lrp", "slalom"} <= set(registry.names())


def test_plugins_from_settings_and_arguments_are_loaded_and_configured(tmp_path: Path) -> None:
    settings = Settings(method_plugins=[PLUGIN], lm_head_dir=tmp_path)
    registry = MethodRegistry.load(settings, plugins=[PLUGIN])  # duplicates load once
    plugin = registry.get("plugin_length")
    assert isinstance(plugin, LengthMethod)
    assert plugin.configured_with is settings
    gradcam = registry.get("decoded_gradcam")
    assert isinstance(gradcam, DecodedGradCAM) and gradcam.lm_head_dir == tmp_path


def test_sidecar_and_worker_see_the_same_methods() -> None:
    """The sidecar (plug-ins from Settings) and a worker (``--method`` adds to them) build their
    registries with the same loader, so the sidecar accepts every job method its workers run."""
    settings = Settings(method_plugins=[PLUGIN])
    assert "plugin_length" in MethodRegistry.load(settings).names()
    assert MethodRegistry.load(Settings(), plugins=[PLUGIN]).names() == (
        MethodRegistry.load(settings).names()
    )


@pytest.mark.parametrize(
    "path",
    [
        "tests.methods.loader_plugins:Missing",
        "tests.methods.no_such_module:Method",
        "tests.methods.loader_plugins:NotAMethod",
        "no-colon",
    ],
)
def test_a_plugin_that_cannot_be_loaded_is_an_invalid_argument(path: str) -> None:
    with pytest.raises(InvalidArgument, match="cannot be loaded"):
        MethodRegistry.load(Settings(method_plugins=[path]))


def test_method_plugins_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIMELIGHT_METHOD_PLUGINS", f'["{PLUGIN}"]')
    assert Settings().method_plugins == [PLUGIN]
    assert load_method_class(PLUGIN) is LengthMethod
