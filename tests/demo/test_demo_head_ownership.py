"""Whose head a demo start serves: the demo build replaces its own heads of other recipes
(an upgrade, another checkout sharing the cache), never one its user trained with
`limelight distill` for the demo model."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from limelight.demo.build import _ensure_inline_head
from limelight.demo.synthetic import build_synthetic_model, sample_linear_dataset
from limelight.distill.build import HeadRecipe, build_head, head_is_current
from limelight.distill.train import TrainConfig
from limelight.models.explainer_head import head_dir, read_card
from limelight.models.fingerprint import ModelFiles
from limelight.models.loaded import load_model
from limelight.settings import Settings


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_synthetic_model(tmp_path_factory.mktemp("synthetic"), seed=0, n_train=1000)


def small_recipe(directory: Path) -> HeadRecipe:
    data = directory / "texts.jsonl"
    rows = [json.dumps({"text": t}) for t in sample_linear_dataset(40, seed=4).texts()]
    data.write_text("\n".join(rows) + "\n")
    config = TrainConfig(epochs=5, loop_steps=2, loop_batch_size=8)
    return HeadRecipe(data=str(data), n_texts=30, validation_texts=10, train=config)


def test_a_start_keeps_the_users_own_head_and_replaces_its_own(
    synthetic: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = ModelFiles.of(synthetic)
    where = head_dir(files)
    demo = small_recipe(tmp_path)
    assert _ensure_inline_head(synthetic, demo, False, 1)  # built, as a first start does
    built = read_card(where)
    assert built is not None and built.built_by == "demo" and head_is_current(files, demo)

    # An earlier demo recipe's head (another version of Limelight): the start puts its own back.
    older = replace(demo, n_texts=25)
    assert _ensure_inline_head(synthetic, older, False, 1)
    assert head_is_current(files, older)
    assert _ensure_inline_head(synthetic, demo, False, 1, build=False)  # restored, not built
    assert head_is_current(files, demo)

    # The user's own, trained for the demo model: served by the next start, the demo's shelved.
    mine = replace(demo, n_texts=20)
    _, card, _ = build_head(load_model(synthetic), Settings(jobs="off"), mine, progress=False)
    assert card.built_by == "distill"
    with caplog.at_level(logging.INFO, logger="limelight.demo.build"):
        assert _ensure_inline_head(synthetic, demo, False, 1, build=False)
    assert head_is_current(files, mine)
    assert f"mv {where} {where}.mine" in caplog.text

    # Moved aside as the line says: the next start restores the demo's, without training.
    where.rename(where.with_name(f"{where.name}.mine"))
    assert _ensure_inline_head(synthetic, demo, False, 1, build=False)
    assert head_is_current(files, demo)

    # A user's head that does not fit the model's weights is not kept.
    _, card, _ = build_head(load_model(synthetic), Settings(jobs="off"), mine, progress=False)
    stale = replace(card, model_version="0" * 16)
    (where / "card.json").write_text(stale.to_json())
    assert _ensure_inline_head(synthetic, demo, False, 1, build=False)
    assert head_is_current(files, demo)
