"""Multi-label and regression heads across architectures.

For a representative family of each head shape (pooler, pre-classifier, dense + tanh, context
pooler, ELECTRA's head, ModernBERT's, last-token decoders, XLNet's sequence summary, and the
families whose rows run unpadded: FNet and YOSO; BART for the encoder-decoders), a tiny
random-init classifier is built once with a sigmoid multi-label head and once with a one-output
regression head, saved, and loaded as the sidecar loads it. Checked against transformers' own
forward: the multi-label probabilities are ``torch.sigmoid`` of its logits and the predicted set
follows the thresholds; the regression value is its output, and NormXLogit's distance form is
measured from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from limelight.core.prediction import predict
from limelight.methods.normxlogit import NormXLogit
from limelight.models import adapters
from limelight.models.loaded import LoadedModel, load_model
from limelight.models.tiny import HEAD_KIND_FAMILIES, tiny_config
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime

FAMILIES = list(HEAD_KIND_FAMILIES)
TEXT = "a witty and gorgeous film , sadly too long"
VOCAB = 30522  # the WordPiece tokenizer's
LABELS = ["toxic", "insult", "threat", "spam"]

HEADS: dict[str, dict[str, Any]] = {
    "multi_label": dict(
        num_labels=len(LABELS),
        problem_type="multi_label_classification",
        id2label=dict(enumerate(LABELS)),
        label2id={name: i for i, name in enumerate(LABELS)},
    ),
    "regression": dict(num_labels=1, problem_type="regression"),
}


def build(model_type: str, head: str, directory: Path, tokenizer_dir: Path) -> LoadedModel:
    torch.manual_seed(0)
    values = dict(HEADS[head])
    if model_type == "bart":  # its head reads the last end-of-sequence token: WordPiece [SEP]
        values["eos_token_id"] = 102
    config = tiny_config(model_type, vocab_size=VOCAB, **values)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return load_model(directory)


def own_logits(model: LoadedModel, text: str) -> torch.Tensor:
    enc = model.tokenizer(text, return_tensors="pt")
    kwargs: dict[str, Any] = {"input_ids": enc["input_ids"]}
    if adapters._accepts(model.model, "use_cache"):
        kwargs["use_cache"] = False
    with torch.no_grad():
        return model.model(**kwargs).logits[0]


@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("model_type", FAMILIES)
def test_head_on_family(model_type: str, head: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    model = build(model_type, head, tmp_path / model_type, tokenizer_dir)
    encoded = model.encode(TEXT)
    outputs = TorchRuntime(model).run_inline(InlineBatch.from_encoded([encoded], model.pad_id))
    logits = own_logits(model, TEXT)
    scores = NormXLogit().attribute(outputs, 0, len(encoded))
    assert scores.shape == (len(encoded), model.num_labels)
    if head == "multi_label":
        assert model.problem_type == "multi_label_classification"
        thresholds = [0.5, 0.4, 0.6, 0.5]
        prediction = predict(outputs.logits[0], model.problem_type, thresholds)
        want = torch.sigmoid(logits).numpy()
        np.testing.assert_allclose(prediction.probabilities, want, rtol=1e-4, atol=1e-5)
        expected = [i for i in np.argsort(-want, kind="stable") if want[i] >= thresholds[i]]
        assert prediction.active == expected
    else:
        assert model.problem_type == "regression" and model.is_regression
        value = float(logits[0])
        prediction = predict(outputs.logits[0], model.problem_type, [])
        assert float(prediction.probabilities[0]) == pytest.approx(value, rel=1e-4, abs=1e-5)
        distance = outputs.embedding_norms[0, : len(encoded)] * np.abs(
            outputs.token_logits[0, : len(encoded), 0] - value
        )
        np.testing.assert_allclose(scores[:, 0], distance, rtol=1e-4, atol=1e-5)
