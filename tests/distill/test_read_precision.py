"""``TrainConfig.read_precision``: the forward passes a head build only reads (teacher labels,
loop rewards) may run in bfloat16. Checked here: the mechanics — bfloat16 labels are cached
apart from float32 ones, the precision is part of the recipe and recorded in the card — not
whether the head is as good (measured: bench/bench_head_policy_loop.py --read-precision,
docs/distillation.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from limelight.demo.synthetic import build_synthetic_model, sample_linear_dataset
from limelight.distill.build import HeadRecipe, build_head
from limelight.distill.train import TrainConfig, _teacher_examples
from limelight.models.loaded import load_model
from limelight.models.precision import read_precision
from limelight.settings import Settings


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_synthetic_model(tmp_path_factory.mktemp("synthetic"), seed=0, n_train=3000)


def test_bfloat16_labels_are_kept_apart_from_float32_labels(
    synthetic: Path, tmp_path: Path
) -> None:
    model = load_model(synthetic)
    texts = sample_linear_dataset(3, seed=5).texts()
    cache = tmp_path / "labels.jsonl"
    args = (model, Settings(jobs="off"), "shapley", {"permutations": 2}, texts, cache)
    low = _teacher_examples(*args, precision="bfloat16")
    assert json.loads(cache.read_text().splitlines()[0])["precision"] == "bfloat16"
    exact = _teacher_examples(*args)  # another stamp: recomputed, not read back
    assert "precision" not in json.loads(cache.read_text().splitlines()[0])
    for a, b in zip(low, exact, strict=True):
        x, y = np.asarray(a[0].scores), np.asarray(b[0].scores)
        assert x.shape == y.shape and not np.array_equal(x, y)
        assert np.corrcoef(x, y)[0, 1] > 0.9


def test_the_precision_is_part_of_the_recipe_and_the_card(synthetic: Path, tmp_path: Path) -> None:
    def digest(**config: object) -> str:
        return HeadRecipe(train=TrainConfig(**config)).digest()  # type: ignore[arg-type]

    # float32 is how every head was built before the option: the same digest.
    assert digest(read_precision="float32") == digest()
    assert digest(read_precision="bfloat16") != digest()
    model = load_model(synthetic)
    config = TrainConfig(
        epochs=1, width=16, attention_heads=2, loop_steps=2, loop_samples=1, loop_points=1,
        read_precision="bfloat16",
    )  # fmt: skip
    recipe = HeadRecipe(n_texts=6, validation_texts=3, train=config, data=_data(tmp_path))
    _, card, _ = build_head(model, Settings(jobs="off"), recipe, tmp_path / "head", progress=False)
    assert card.training["read_precision"] == read_precision(model.device, "bfloat16")
    assert card.recipe_hash == recipe.digest()


def _data(tmp_path: Path) -> str:
    path = tmp_path / "texts.jsonl"
    rows = [json.dumps({"text": t}) for t in sample_linear_dataset(9, seed=6).texts()]
    path.write_text("\n".join(rows) + "\n")
    return str(path)
