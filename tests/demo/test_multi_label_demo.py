"""The multi-label demo (BERT-tiny, a sigmoid per label, drugsCom reviews tagged by rules): the
tagging rules, the F1 arithmetic, the built model and its card, and a real sidecar serving it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, BertForSequenceClassification

from limelight.cli.main import main
from limelight.demo.build import (
    DemoBuildError,
    DemoCard,
    MultiLabelRecipe,
    demo_model_dir,
    ensure_demo_model,
    multi_label_scores,
)
from limelight.demo.datasets import (
    DRUGSCOM_MULTI_LABELS,
    MultiLabelExample,
    drugscom_labels_of,
    drugscom_multi_label,
)
from limelight.demo.recipes import RECIPES
from limelight.errors import InvalidArgument
from limelight.models.explainer_head import inline_heads
from limelight.models.lexicon_table import lexicon_dir, lexicon_unavailable_reason
from limelight.models.loaded import load_model
from limelight_client import Client

LABELS = list(DRUGSCOM_MULTI_LABELS)


def test_tagging_rules() -> None:
    assert drugscom_labels_of("Works, no complaints.", "Acne", "positive") == frozenset()
    assert drugscom_labels_of("Terrible DIZZINESS all day", "Bipolar Disorde", "negative") == {
        "negative",
        "side_effects",
        "mental_health",
    }
    assert drugscom_labels_of("Some spotting.", "Birth Control", "neutral") == {
        "side_effects",
        "birth_control",
    }
    assert drugscom_labels_of("fine", "Emergency Contraception", "positive") == {"birth_control"}
    # Prefix matches start at a word: "undizzy" is not a hit, nor is "parash" a rash.
    assert drugscom_labels_of("parash undizzy", "Generalized Anxiety Disorde", "positive") == {
        "mental_health"
    }
    example = MultiLabelExample("x", frozenset({"negative", "birth_control"}))
    assert example.vector() == [1.0, 0.0, 0.0, 1.0]


def test_packaged_splits_are_tagged() -> None:
    train, test = drugscom_multi_label("train"), drugscom_multi_label("test")
    assert (len(train), len(test)) == (600, 379)
    counts = Counter(name for e in test for name in e.labels)
    assert counts == {"side_effects": 193, "negative": 95, "birth_control": 79, "mental_health": 73}
    assert sum(1 for e in train if len(e.labels) >= 2) > 100  # genuinely multi-label
    with pytest.raises(InvalidArgument):
        drugscom_multi_label("validation")  # type: ignore[arg-type]


def test_multi_label_scores_by_hand() -> None:
    gold = [[1, 0], [1, 1], [0, 0]]
    predicted = [[1, 1], [0, 1], [0, 0]]
    scores = multi_label_scores(gold, predicted, ["a", "b"])
    # a: tp 1, fn 1 -> 2/3; b: tp 1, fp 1 -> 2/3; micro: tp 2, fp 1, fn 1 -> 4/6.
    assert scores["per_label_f1"] == {"a": 0.6667, "b": 0.6667}
    assert scores["micro_f1"] == 0.6667 and scores["macro_f1"] == 0.6667
    assert scores["exact_match"] == 0.3333 and scores["support"] == {"a": 2, "b": 1}
    assert multi_label_scores([[0]], [[0]], ["a"])["per_label_f1"] == {"a": 1.0}
    with pytest.raises(InvalidArgument):
        multi_label_scores([], [], ["a"])


def test_recipe_is_multi_label_and_hashes_its_dataset() -> None:
    recipe = RECIPES["bert-tiny-multilabel"]
    assert isinstance(recipe, MultiLabelRecipe)
    assert recipe.as_dict()["dataset"].startswith("drugscom-multilabel/")
    assert recipe.digest() != RECIPES["bert-tiny"].digest()


def _sigmoids(model_dir: Path, texts: list[str]) -> np.ndarray:
    """transformers' own sigmoid probabilities, one text at a time (no padding)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            enc = tokenizer(text, return_tensors="pt", truncation=True, max_length=512)
            rows.append(torch.sigmoid(model(**enc).logits[0]).numpy())
    return np.stack(rows)


def test_built_model_config_card_and_metrics(bert_tiny_multilabel_dir: Path) -> None:
    directory = bert_tiny_multilabel_dir
    assert directory == demo_model_dir("bert-tiny-multilabel", directory.parent.parent)
    loaded = load_model(directory)
    assert loaded.is_multi_label and loaded.labels == LABELS
    assert loaded.config.problem_type == "multi_label_classification"
    assert inline_heads(loaded) == {}  # no distilled head for this demo

    card = DemoCard.read(directory)
    recipe = RECIPES["bert-tiny-multilabel"]
    assert card.recipe_hash == recipe.digest()
    assert (card.n_train, card.n_validation, card.n_test) == (540, 60, 379)
    metrics = card.metrics
    assert metrics["split"] == "drugscom:test" and metrics["threshold"] == 0.5
    assert set(metrics["per_label_f1"]) == set(LABELS)
    assert isinstance(recipe, MultiLabelRecipe)
    assert metrics["micro_f1"] >= recipe.min_micro_f1

    # Recompute the test metrics from the saved weights with transformers alone.
    test = drugscom_multi_label("test")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = BertForSequenceClassification.from_pretrained(directory).eval()
    predicted: list[list[float]] = []
    with torch.no_grad():
        for start in range(0, len(test), 64):
            batch = tokenizer(
                [e.text for e in test[start : start + 64]],
                truncation=True,
                max_length=recipe.max_length,
                padding=True,
                return_tensors="pt",
            )
            predicted.extend((torch.sigmoid(model(**batch).logits) >= 0.5).float().tolist())
    again = multi_label_scores([e.vector() for e in test], predicted, LABELS)
    assert again["support"] == metrics["support"]
    assert again["micro_f1"] == pytest.approx(metrics["micro_f1"], abs=0.005)
    assert again["macro_f1"] == pytest.approx(metrics["macro_f1"], abs=0.005)
    for name in LABELS:
        assert again["per_label_f1"][name] == pytest.approx(metrics["per_label_f1"][name], abs=0.01)
    assert again["exact_match"] == pytest.approx(card.accuracy, abs=0.005)


def test_served_sigmoids_match_transformers(
    start_sidecar: Callable[..., Any], bert_tiny_multilabel_dir: Path, tmp_path: Path
) -> None:
    texts = [e.text for e in drugscom_multi_label("test")[:6]]
    texts.append("This pill gave me awful headaches and nausea; my depression got worse.")
    expected = _sigmoids(bert_tiny_multilabel_dir, texts)
    running = start_sidecar(model_dir=bert_tiny_multilabel_dir)
    with Client(running.target, timeout=60) as client:
        info = client.model()
        assert info.problem_type == "multi_label_classification"
        assert info.thresholds == dict.fromkeys(LABELS, 0.5)
        for text, probs in zip(texts, expected, strict=True):
            result = client.explain(text, method="normxlogit")
            assert result.multi_label
            np.testing.assert_allclose(
                [result.probabilities[name] for name in LABELS], probs, rtol=1e-4, atol=1e-5
            )
            over = [LABELS[i] for i in np.argsort(-probs) if probs[i] >= 0.5]
            assert result.predicted_labels == over
            if over:  # one explanation per predicted label; none predicted: the top one
                assert [e.target_label for e in result.explained()] == over
            else:
                assert result.target_label == LABELS[int(np.argmax(probs))]
    # `limelight explain --lines` counts every predicted label in its summary.
    lines = tmp_path / "reviews.txt"
    lines.write_text("\n".join(texts) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "limelight.cli.main", "explain", "--lines", str(lines),
         "--target", running.target, "--method", "normxlogit"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["line"] for r in rows] == list(range(1, len(texts) + 1))
    predicted = Counter(
        label
        for probs in expected
        for label in [LABELS[i] for i in range(len(LABELS)) if probs[i] >= 0.5] or ["(none)"]
    )
    summary = out.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"explained {len(texts)} line(s) in ")
    for label, n in predicted.items():
        assert f"{label} {n}" in summary


def test_auto_serves_the_demos_lexicon_for_every_predicted_label(
    start_sidecar: Callable[..., Any], bert_tiny_multilabel_dir: Path
) -> None:
    # No distilled head for this demo: the build puts its lexicon table beside it instead.
    model = load_model(bert_tiny_multilabel_dir)
    assert lexicon_unavailable_reason(model) == ""
    table = np.load(lexicon_dir(model) / "table.npy")
    assert table.shape == (model.model.get_input_embeddings().num_embeddings, len(LABELS))
    text = "This pill gave me awful headaches and nausea; my depression got worse."
    running = start_sidecar(model_dir=bert_tiny_multilabel_dir, default_method="auto")
    with Client(running.target, timeout=60) as client:
        result = client.explain(text)
    ids = AutoTokenizer.from_pretrained(bert_tiny_multilabel_dir)(text)["input_ids"]
    assert result.explained()
    for one in result.explained():
        assert one.method == "lexicon_lookup"
        # The table's rows for the text's ids, by hand; [CLS] and [SEP] score 0.
        expected = table[ids, LABELS.index(one.target_label)]
        expected[[0, -1]] = 0.0
        np.testing.assert_allclose(one.scores, expected, atol=1e-6)
        assert "normxlogit" in one.extra_scores


def test_build_demo_cli_reports_f1(
    bert_tiny_multilabel_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = bert_tiny_multilabel_dir.parent.parent
    code = main(
        ["build-demo", "--model", "bert-tiny-multilabel", "--cache-dir", str(cache), "--quiet"]
    )
    out = capsys.readouterr().out
    card = DemoCard.read(bert_tiny_multilabel_dir)
    assert code == 0 and "(cached)" in out
    assert f"micro-F1 {card.metrics['micro_f1']:.4f}" in out
    assert "on drugscom:test" in out and "(exact match: every label right)" in out


def test_a_small_build_is_deterministic_and_skips_the_inline_head(tmp_path: Path) -> None:
    base = RECIPES["bert-tiny-multilabel"]
    assert isinstance(base, MultiLabelRecipe)
    small = dataclasses.replace(
        base, version="test-small", train_limit=48, epochs=1, max_length=32, min_micro_f1=0.0
    )
    a = ensure_demo_model("bert-tiny-multilabel", tmp_path / "a", progress=False, recipe=small)
    b = ensure_demo_model(
        "bert-tiny-multilabel", tmp_path / "b", progress=False, recipe=small, threads=1
    )
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=1e-5)
    card = DemoCard.read(a)
    assert card.n_train == 48 and card.metrics["split"] == "drugscom:test"
    assert card.metrics["support"] == {
        "negative": 95,
        "side_effects": 193,
        "mental_health": 73,
        "birth_control": 79,
    }
    assert inline_heads(load_model(a)) == {}
    # A gate it cannot pass caches nothing.
    strict = dataclasses.replace(small, version="test-strict", min_micro_f1=1.01)
    with pytest.raises(DemoBuildError, match="micro-F1"):
        ensure_demo_model("bert-tiny-multilabel", tmp_path / "c", progress=False, recipe=strict)
    assert not demo_model_dir("bert-tiny-multilabel", tmp_path / "c", strict).exists()


def test_eval_and_drift_reference_default_to_the_demos_own_data(
    bert_tiny_multilabel_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With `--demo bert-tiny-multilabel` and no --data, both read drugsCom (what the model
    was trained on), not the sentiment reviews of the other demos."""
    import json

    cache = str(bert_tiny_multilabel_dir.parent.parent)
    demo = ["--demo", "bert-tiny-multilabel", "--cache-dir", cache]
    out = tmp_path / "eval"
    quick = ["--methods", "random", "--n", "3", "--fractions", "0.5", "--game-steps", "2"]
    assert main(["eval", *demo, *quick, "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["dataset"].startswith("drugscom (test)")
    # one evaluated item per (text, explained label), each identified for `limelight eval-pool`
    items = [(i["index"], i["target"]) for i in report["inputs"]]
    assert len(items) == len(set(items)) == report["methods"][0]["n"]
    assert len({index for index, _ in items}) == 3
    assert all(isinstance(target, int) for _, target in items)
    reference = tmp_path / "ref.json"
    args = ["--n", "4", "--out", str(reference), "--no-progress"]
    assert main(["drift-reference", "build", *demo, *args]) == 0
    assert json.loads(reference.read_text())["source"]["data"] == "drugscom:test"
    capsys.readouterr()
