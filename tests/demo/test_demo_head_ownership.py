"""Whose head a demo start serves: the demo build replaces its own heads of other recipes
(an upgrade, another checkout sharing the cache), never one its user trained with
`limelight distill` for the demo model."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from limelight.demo import build as build_module
from limelight.demo.build import _ensure_inline_head, built_by_demo, demo_head_recipe
from limelight.demo.synthetic import build_synthetic_model, sample_linear_dataset
from limelight.distill.build import HeadRecipe, build_head, head_is_current, shelved_head_dir
from limelight.distill.train import TrainConfig
from limelight.models.explainer_head import HEAD_DIRNAME, HeadCard, head_dir, read_card
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


@pytest.fixture
def model_dir(synthetic: Path, tmp_path: Path) -> Path:
    """A copy of the synthetic model without its heads (the labels kept), so that what one
    test leaves beside the model does not decide whose head the next one finds."""
    copy = tmp_path / "models" / synthetic.name
    shutil.copytree(
        synthetic, copy, ignore=shutil.ignore_patterns(HEAD_DIRNAME, f"{HEAD_DIRNAME}.recipe-*")
    )
    return copy


def _without_built_by(where: Path) -> None:
    """Rewrite the card of the head at ``where`` as a Limelight before ``built_by`` wrote it."""
    card = json.loads((where / "card.json").read_text())
    del card["built_by"]
    (where / "card.json").write_text(json.dumps(card))


def test_a_head_an_older_distill_trained_is_kept_as_the_users(
    model_dir: Path, tmp_path: Path
) -> None:
    files = ModelFiles.of(model_dir)
    where = head_dir(files)
    demo = small_recipe(tmp_path)
    assert _ensure_inline_head(model_dir, demo, False, 1)  # the demo's, built or restored
    mine = replace(demo, n_texts=15)  # shelves the demo's: a start could restore it
    build_head(load_model(model_dir), Settings(jobs="off"), mine, progress=False)
    _without_built_by(where)  # trained before cards said who built them
    assert _ensure_inline_head(model_dir, demo, False, 1, build=False)
    assert head_is_current(files, mine)  # served as it is, not shelved
    assert not shelved_head_dir(where, mine.digest()).exists()


def test_an_older_demo_head_is_replaced_and_its_shelf_logged(
    model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    files = ModelFiles.of(model_dir)
    where = head_dir(files)
    demo = small_recipe(tmp_path)
    assert _ensure_inline_head(model_dir, demo, False, 1)
    older = replace(demo, n_texts=25)  # a demo recipe of a Limelight before built_by
    assert _ensure_inline_head(model_dir, older, False, 1)
    _without_built_by(where)
    monkeypatch.setattr(
        build_module,
        "DEMO_HEAD_RECIPES_BEFORE_BUILT_BY",
        build_module.DEMO_HEAD_RECIPES_BEFORE_BUILT_BY | {older.digest()},
    )
    with caplog.at_level(logging.WARNING, logger="limelight.distill.build"):
        assert _ensure_inline_head(model_dir, demo, False, 1, build=False)
    assert head_is_current(files, demo)
    shelf = shelved_head_dir(where, older.digest())
    assert shelf.exists()
    assert str(shelf) in caplog.text


def test_only_the_demos_recipes_make_a_card_without_built_by_the_demos() -> None:
    card = HeadCard("0" * 16, [1], 8, 2, 0, "greedy_deletion")
    assert not built_by_demo(card)  # no recipe: `limelight distill` before recipes
    assert not built_by_demo(replace(card, recipe_hash="0123456789ab"))
    assert built_by_demo(replace(card, recipe_hash=demo_head_recipe("bert-tiny").digest()))
    for known in build_module.DEMO_HEAD_RECIPES_BEFORE_BUILT_BY:
        assert built_by_demo(replace(card, recipe_hash=known))
    assert built_by_demo(replace(card, recipe_hash="0123456789ab", built_by="demo"))
    assert not built_by_demo(
        replace(card, recipe_hash=demo_head_recipe("bert-tiny").digest(), built_by="distill")
    )


def test_the_background_build_says_which_head_is_served_meanwhile(
    model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(build_module, "_start_child", lambda *args: SimpleNamespace(pid=4242))
    monkeypatch.setattr(build_module, "watch_build", lambda *args: None)
    where = head_dir(ModelFiles.of(model_dir))
    demo = small_recipe(tmp_path)
    assert _ensure_inline_head(model_dir, demo, False, 1)  # an earlier recipe's, in place
    caplog.set_level(logging.INFO, logger="limelight.demo.build")
    build_module.build_demo_extras_in_background(model_dir, "bert-tiny")
    assert f"the head in place (recipe {demo.digest()}) is served until it is done" in caplog.text
    assert "NormXLogit is served" not in caplog.text

    caplog.clear()
    aside = where.with_name(f"{where.name}.aside")
    where.rename(aside)
    try:
        build_module.build_demo_extras_in_background(model_dir, "bert-tiny")
    finally:
        aside.rename(where)
    assert "NormXLogit is served until it is done" in caplog.text
