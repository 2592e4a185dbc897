"""``--model`` as a Hugging Face model id, resolved from the local Hugging Face cache only.

The cache is built here by hand in the hub's own layout (``models--org--name/snapshots/<commit>``
and ``refs/main``): nothing is ever downloaded."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from limelight.cli.main import EXIT_FAILURE, main
from limelight.errors import ModelLoadError
from limelight.models.loaded import load_model
from limelight.models.sources import hub_cache_dir, parse_hub_id, resolve_model_source
from limelight_client import Client

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root: Path, repo_id: str, model_dir: Path, *, pickled: bool = False) -> Path:
    """``root`` as a hub cache holding ``model_dir`` as ``repo_id`` at main = COMMIT."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model_dir, snapshot)
    if pickled:
        (snapshot / "model.safetensors").rename(snapshot / "pytorch_model.bin")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_ids_and_paths() -> None:
    assert parse_hub_id("acme/tiny-clf") == ("acme/tiny-clf", None)
    assert parse_hub_id("distilbert-base-uncased") == ("distilbert-base-uncased", None)
    assert parse_hub_id("acme/tiny-clf@v1.0") == ("acme/tiny-clf", "v1.0")
    for path in ("/models/classifier", "./model", "../m", "~/m", "a/b/c", "config.json"):
        assert parse_hub_id(path) is None, path


def test_the_cache_location_follows_the_hubs_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


def test_resolves_a_cached_snapshot(random_bert_dir: Path, tmp_path: Path) -> None:
    snapshot = fake_cache(tmp_path, "acme/tiny-clf", random_bert_dir)
    source = resolve_model_source("acme/tiny-clf", cache_dir=tmp_path)
    assert source.path == snapshot and source.name == "tiny-clf"
    assert source.hub_id == "acme/tiny-clf"
    pinned = resolve_model_source(f"acme/tiny-clf@{COMMIT}", cache_dir=tmp_path)
    assert pinned.path == snapshot
    # A local directory of that name wins over the cache.
    assert resolve_model_source(random_bert_dir, cache_dir=tmp_path).path == random_bert_dir


def test_a_missing_id_says_how_to_fetch_it(random_bert_dir: Path, tmp_path: Path) -> None:
    fake_cache(tmp_path, "acme/tiny-clf", random_bert_dir)
    with pytest.raises(ModelLoadError) as info:
        resolve_model_source("acme/other", cache_dir=tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert "`hf download acme/other`" in message and str(tmp_path) in message
    assert "never downloads" in message and "HF_HUB_CACHE" in message
    assert "docs/deploy.md" in message
    with pytest.raises(ModelLoadError, match="--revision v2"):
        resolve_model_source("acme/tiny-clf@v2", cache_dir=tmp_path)


def test_load_model_and_serve_from_the_cache(
    monkeypatch: pytest.MonkeyPatch,
    random_bert_dir: Path,
    tmp_path: Path,
    start_sidecar: Callable[..., Any],
) -> None:
    cache = tmp_path / "hub"
    fake_cache(cache, "acme/tiny-clf", random_bert_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    model = load_model("acme/tiny-clf")
    assert model.name == "tiny-clf" and model.labels == ["negative", "neutral", "positive"]
    running = start_sidecar(model_dir=Path("acme/tiny-clf"))
    with Client(running.target, timeout=60) as client:
        assert client.model().name == "tiny-clf"
        assert client.explain("a fine film").label in model.labels


def test_serve_with_an_uncached_id_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    serve = ["serve", "--port", "0", "--metrics-port", "0", "--jobs", "off"]
    status = main([*serve, "--model", "acme/not-fetched"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == EXIT_FAILURE
    assert "Traceback" not in "\n".join(err)
    assert "hf download acme/not-fetched" in err[-1]


def test_pickle_only_snapshots_stay_refused(
    monkeypatch: pytest.MonkeyPatch, random_bert_dir: Path, tmp_path: Path
) -> None:
    fake_cache(tmp_path, "acme/pickled", random_bert_dir, pickled=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError) as info:
        load_model("acme/pickled")
    message = str(info.value)
    assert "safetensors only" in message and "pytorch_model.bin" in message
    assert "save_pretrained('OUT', safe_serialization=True)" in message
