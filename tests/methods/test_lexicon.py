"""The lexicon reference against the classifier run by hand on one-token texts."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from limelight.methods.base import JobContext
from limelight.methods.lexicon import Lexicon, _Table
from limelight.models.loaded import LoadedModel


def log_odds(model: LoadedModel, ids: list[int], target: int) -> float:
    """The target's log-odds against the other classes, straight from transformers."""
    with torch.inference_mode():
        logits = model.model(input_ids=torch.tensor([ids])).logits[0].double()
    others = torch.cat([logits[:target], logits[target + 1 :]])
    return float(logits[target] - torch.logsumexp(others, dim=0))


@pytest.mark.parametrize("target", [0, 2])
def test_each_token_scores_its_own_text_against_the_empty_text(
    random_bert: LoadedModel, make_ctx: Callable[..., JobContext], target: int
) -> None:
    method = Lexicon()
    enc = random_bert.encode("a witty , gorgeous film")
    out = method.run(make_ctx(random_bert), enc, target, method.validate_params({}))
    cls, sep = random_bert.tokenizer.cls_token_id, random_bert.tokenizer.sep_token_id
    empty = log_odds(random_bert, [cls, sep], target)
    for position, (token, score) in enumerate(zip(enc.tokens, out.scores, strict=True)):
        if token.special:
            assert score == 0.0
        else:
            token_id = enc.input_ids[position]
            expected = log_odds(random_bert, [cls, token_id, sep], target) - empty
            assert score == pytest.approx(expected, abs=1e-4)
    assert out.scores.dtype == np.float32 and np.any(out.scores != 0)


def test_the_table_is_built_once_per_model(
    random_bert: LoadedModel, make_ctx: Callable[..., JobContext]
) -> None:
    method = Lexicon()
    params = method.validate_params({"batch_size": 4096})
    first, second = make_ctx(random_bert), make_ctx(random_bert)
    a = method.run(first, random_bert.encode("a good film"), 1, params).scores
    b = method.run(second, random_bert.encode("a good film"), 1, params).scores
    np.testing.assert_array_equal(a, b)
    building = [m for _, m in first.progress if m.startswith("lexicon")]  # type: ignore[attr-defined]
    assert len(building) == -(-random_bert.model.get_input_embeddings().num_embeddings // 4096)
    assert not [m for _, m in second.progress if m.startswith("lexicon")]  # type: ignore[attr-defined]


def test_without_special_tokens_the_vocabulary_mean_is_the_reference() -> None:
    single = torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, -1.0]])  # log-odds of class 1: 1, 3, -1
    scores = _Table(single, None).scores([1, 2], target=1, multi_label=False)
    np.testing.assert_allclose(scores, [3.0 - 1.0, -1.0 - 1.0])
