"""Regression heads end to end: a tiny random BERT with one output, served by a real sidecar:
the predicted value, NormXLogit's distance form, a job, drift and the heat-maps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertForSequenceClassification

from limelight_client import Client
from tests.tiny_bert import save_tiny_bert

TEXTS = [
    "the room was clean and the staff were friendly",
    "a long wait, a cold meal and a rude waiter",
    "average in every way",
]


@pytest.fixture(scope="module")
def regression_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny randomly initialised BERT regressor (num_labels 1, problem_type regression)."""
    out = tmp_path_factory.mktemp("regression-bert")

    def rating_like(model: BertForSequenceClassification) -> None:
        model.classifier.bias.fill_(2.5)  # a rating-like offset
        model.classifier.weight.mul_(20)  # so that tokens' outputs differ visibly

    return save_tiny_bert(
        out, tokenizer_dir, ["score"], seed=2, problem_type="regression", edit=rating_like
    )


def _reference(model_dir: Path, text: str) -> tuple[float, np.ndarray]:
    """transformers' predicted value and NormXLogit's distance form computed by hand."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    enc = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
        value = float(out.logits[0, 0])
        h0, h_last = out.hidden_states[0][0], out.hidden_states[-1][0]
        per_token = model.classifier(model.bert.pooler.activation(model.bert.pooler.dense(h_last)))
        distance = (h0.norm(dim=-1) * (per_token[:, 0] - value).abs()).numpy()
    return value, distance


def test_regression_end_to_end(
    start_sidecar: Callable[..., Any], regression_dir: Path, tmp_path: Path
) -> None:
    running = start_sidecar(
        model_dir=regression_dir, drift_bootstrap_n=2, drift_window=4, drift_min_count=1
    )
    with Client(running.target, timeout=60) as client:
        info = client.model()
        assert info.problem_type == "regression" and info.labels == ["score"]
        results = [client.explain(text, method="normxlogit") for text in TEXTS]
        for text, result in zip(TEXTS, results, strict=True):
            value, distance = _reference(regression_dir, text)
            assert result.probabilities["score"] == pytest.approx(value, rel=1e-4, abs=1e-5)
            assert result.label == "score" and result.predicted_labels == []
            assert not result.multi_label
            np.testing.assert_allclose(result.scores, distance, rtol=1e-4, atol=1e-5)
            assert min(result.scores) >= 0  # a distance: unsigned
        assert len({r.probabilities["score"] for r in results}) == 3  # one value per text

        job = client.submit(TEXTS[0], "grad_x_input")
        done = job.result(timeout=120)
        assert done.target_label == "score"
        assert done.probabilities["score"] == pytest.approx(
            results[0].probabilities["score"], rel=1e-4
        )
        assert len(done.scores) == len(results[0].tokens)

        for text in TEXTS:
            client.explain(text)
        report = client.drift(top_k=3)
    assert report.reference_state == "ready"
    assert [d.label for d in report.labels] == ["score"]
    assert report.labels[0].window_count == 4

    text = results[0].to_terminal(color=False)
    assert "prediction: score" in text
    results[0].to_html(tmp_path / "regression.html")
