"""Distillation for multi-label models, on a tiny random 3-label BERT (sigmoid per label): the
teacher examples are per (text, label the sidecar explains), no column learns another's negated
scores, and the head trains, saves, loads and serves one column per predicted label. Mechanics
only: a random model's head has no quality to assert."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertForSequenceClassification

from limelight.distill.train import (
    TrainConfig,
    amortisation_loss,
    distill,
    negates_other_class,
    predict_scores,
    teacher_attributions,
)
from limelight.methods.distilled import DistilledExplainer
from limelight.models.explainer_head import (
    OUTPUT_NAME,
    head_dir,
    inline_heads,
    load_head,
    read_card,
    save_head,
)
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings
from limelight_client import Client
from tests.tiny_bert import save_tiny_bert

LABELS = ["toxic", "insult", "threat"]
#: Head biases that put two labels clearly over 0.5 and one clearly under, whatever the text.
BIASES = [3.0, 1.5, -3.0]
TEXTS = [
    "you are a dreadful person",
    "this is a terrible, awful idea",
    "what a lovely afternoon in the park",
    "I will not forget what you did",
    "the service was slow and the food cold",
    "thanks for the quick reply",
]
TEACHER = "grad_x_input"  # one backward pass per example: the cheapest teacher
CONFIG = TrainConfig(epochs=3, width=16, attention_heads=2, loop_steps=2, loop_batch_size=4)


@pytest.fixture(scope="module")
def multi_label_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny randomly initialised 3-label BERT (problem_type multi_label_classification)."""
    out = tmp_path_factory.mktemp("multi-label-distill")
    return save_tiny_bert(
        out, tokenizer_dir, LABELS, seed=3, problem_type="multi_label_classification", biases=BIASES
    )


def _predicted(model_dir: Path, text: str, thresholds: list[float]) -> list[int]:
    """transformers' own sigmoids: the labels at or above their thresholds, most probable
    first (or the most probable one when none is)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        probs = torch.sigmoid(model(**tokenizer(text, return_tensors="pt")).logits[0]).numpy()
    order = np.argsort(-probs, kind="stable")
    return [int(i) for i in order if probs[i] >= thresholds[i]] or [int(order[0])]


def test_multi_label_never_negates_the_other_column() -> None:
    # Two columns, the target column exactly right, the other equal to (not minus) the labels.
    y = torch.tensor([[0.0, 1.0, -1.0, 0.5]])
    scores = torch.stack([y, y], dim=-1)  # [1, n, 2]
    keep = torch.ones_like(y, dtype=torch.bool)
    target = torch.tensor([0])
    assert float(amortisation_loss(scores, y, keep, target, negate_other=False)) == 0.0
    assert float(amortisation_loss(scores, y, keep, target, negate_other=True)) > 0.0


def test_teacher_examples_are_per_text_and_served_label(
    multi_label_dir: Path, tmp_path: Path
) -> None:
    model = load_model(multi_label_dir)
    assert model.is_multi_label and not negates_other_class(model)
    for name, settings in (
        ("default", Settings(jobs="off")),
        ("strict", Settings(jobs="off", label_thresholds={"insult": 0.999})),
    ):
        thresholds = [settings.label_thresholds.get(n, settings.label_threshold) for n in LABELS]
        cache = tmp_path / f"{name}.jsonl"
        examples = teacher_attributions(model, settings, TEACHER, {}, TEXTS, cache)
        expected = [
            (t, label) for t in TEXTS for label in _predicted(multi_label_dir, t, thresholds)
        ]
        assert [(e.text, e.target) for e in examples] == expected
        for example in examples:
            assert len(example.scores) == len(model.encode(example.text))
        # The cache is keyed by (text, label) and stamped with the thresholds.
        lines = cache.read_text().splitlines()
        assert json.loads(lines[0])["thresholds"] == thresholds
        assert len({json.loads(line)["key"] for line in lines[1:]}) == len(expected)
    # The biases make two labels pass 0.5 on every text; insult's 0.999 leaves toxic alone.
    assert len(expected) == len(TEXTS)
    assert {label for _, label in expected} == {0}


@pytest.mark.slow
def test_head_trains_saves_loads_and_serves_each_label(
    multi_label_dir: Path, tmp_path: Path, start_sidecar: Callable[..., Any]
) -> None:
    model = load_model(multi_label_dir)
    head, card = distill(
        model, Settings(jobs="off"), TEXTS, TEACHER, {}, tmp_path / "t.jsonl", config=CONFIG
    )
    thresholds = [0.5] * len(LABELS)
    per_text = {t: _predicted(multi_label_dir, t, thresholds) for t in TEXTS}
    assert all(len(labels) == 2 for labels in per_text.values())  # the fixture's biases
    # Texts are held out whole; validation is per (text, label).
    assert card.train_texts + card.validation_texts == len(TEXTS)
    assert card.validation["examples"] == 2 * card.validation_texts
    assert card.num_labels == len(LABELS) and card.training["loop_steps"] == CONFIG.loop_steps
    save_head(head, card, head_dir(model))
    assert read_card(head_dir(model)) is not None

    served = load_model(multi_label_dir)
    loaded = load_head(served)
    heads = inline_heads(served)
    assert set(heads) == {OUTPUT_NAME}
    text = TEXTS[0]
    encoded = served.encode(text)
    direct = predict_scores(served, loaded, encoded)
    assert direct.shape == (len(encoded), len(LABELS))
    np.testing.assert_allclose(direct, predict_scores(model, head, encoded), atol=1e-5)
    outputs = TorchRuntime(served, heads).run_inline(
        InlineBatch.from_encoded([encoded], served.pad_id)
    )
    np.testing.assert_allclose(
        DistilledExplainer().attribute(outputs, 0, len(encoded)), direct, atol=1e-5
    )

    # The sidecar explains every predicted label with the head's column for that label.
    running = start_sidecar(model_dir=multi_label_dir, default_method="auto", jobs="off")
    with Client(running.target, timeout=60) as client:
        result = client.explain(text)
    explained = result.explained()
    assert [e.target_label for e in explained] == [LABELS[i] for i in per_text[text]]
    for one in explained:
        assert one.method == OUTPUT_NAME
        column = direct[:, LABELS.index(one.target_label)]
        np.testing.assert_allclose(one.scores, column, rtol=1e-4, atol=1e-5)
