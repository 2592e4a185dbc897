"""SHAP and LIME as `limelight eval` references (the ``peers`` extra, which `make test`
installs): their scores land on the right token positions and explain the class asked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from limelight.core.types import Encoded
from limelight.evaluation.explainers import lime_explainer, shap_explainer
from limelight.evaluation.perturbation import probabilities
from limelight.models.loaded import LoadedModel, load_model


@pytest.fixture(scope="module")
def model(bert_tiny_dir: Path) -> LoadedModel:
    return load_model(bert_tiny_dir)


def masked(model: LoadedModel, enc: Encoded, positions: list[int]) -> Encoded:
    mask_id = model.mask_token_id if model.mask_token_id is not None else model.pad_id
    ids = [int(mask_id) if i in positions else t for i, t in enumerate(enc.input_ids)]
    return Encoded(ids, enc.token_type_ids, enc.tokens, False)


def words(enc: Encoded) -> list[int]:
    return [i for i, t in enumerate(enc.tokens) if not t.special]


def test_shap_values_add_up_to_the_change_from_the_fully_masked_text(model: LoadedModel) -> None:
    enc = model.encode("a gorgeous, witty, seductive movie", None)
    full, empty = probabilities(model, [enc, masked(model, enc, words(enc))])
    explain = shap_explainer(model, budget=500)
    for target in (0, 1):
        scores = explain(enc, target)
        assert scores.shape == (len(enc),)
        # Partition values are efficient: every token's share is accounted for, on the class
        # asked for (a score on the wrong position or class would break the sum).
        assert float(scores.sum()) == pytest.approx(full[target] - empty[target], abs=1e-3)
        special = [i for i, t in enumerate(enc.tokens) if t.special]
        assert np.all(np.abs(scores[special]) < 1e-6)  # SHAP keeps [CLS] and [SEP]


def test_lime_weights_follow_each_tokens_own_effect(model: LoadedModel) -> None:
    enc = model.encode("an unwatchable, overwrought misfire of a film with a fine cast", None)
    full = probabilities(model, [enc])[0]
    target = int(np.argmax(full))
    positions = words(enc)
    alone = probabilities(model, [masked(model, enc, [i]) for i in positions])[:, target]
    scores = lime_explainer(model, budget=1000, seed=0)(enc, target)
    assert scores.shape == (len(enc),)
    assert np.all(np.delete(scores, positions) == 0)  # nothing on [CLS] / [SEP]
    # LIME's local linear weights against each token's leave-one-out drop: the same ranking
    # unless a weight landed on the wrong position.
    rho = spearmanr(scores[positions], full[target] - alone).statistic
    assert rho > 0.6, rho
