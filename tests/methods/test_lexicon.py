"""The lexicon (job and served inline lookup) against the classifier run by hand on one-token
texts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from limelight.errors import FailedPrecondition
from limelight.methods.base import JobContext
from limelight.methods.lexicon import Lexicon, LexiconLookup, _Table
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.serving import torch_serving_runtime
from limelight.runtimes.torch_runtime import TorchRuntime


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
    table = _Table(single, None)
    np.testing.assert_allclose(table.column(1, multi_label=False)[[1, 2]], [3.0 - 1.0, -1.0 - 1.0])
    assert table.reference == "vocabulary mean"


# --- served inline: the table saved beside the model, looked up on the serving pass ----------


@pytest.mark.parametrize("target", [0, 2])
def test_the_served_lookup_is_the_classifier_run_by_hand(
    lexicon_bert_dir: Path, target: int
) -> None:
    model = load_model(lexicon_bert_dir)
    runtime = torch_serving_runtime(model)
    assert "lexicon" in runtime.head_names
    enc = model.encode("a witty , gorgeous film")
    longer = model.encode("a much longer text , padded against the first one in its batch")
    outputs = runtime.run_inline(InlineBatch.from_encoded([enc, longer], model.pad_id))
    matrix = LexiconLookup().attribute(outputs, 0, len(enc))
    assert matrix.shape == (len(enc), model.num_labels) and matrix.dtype == np.float32
    cls, sep = model.tokenizer.cls_token_id, model.tokenizer.sep_token_id
    empty = log_odds(model, [cls, sep], target)
    for position, token in enumerate(enc.tokens):
        token_id = enc.input_ids[position]
        expected = 0.0 if token.special else log_odds(model, [cls, token_id, sep], target) - empty
        assert matrix[position, target] == pytest.approx(expected, abs=1e-4)


def test_the_job_reads_the_saved_table(
    lexicon_bert_dir: Path, make_ctx: Callable[..., JobContext]
) -> None:
    model = load_model(lexicon_bert_dir)
    ctx = make_ctx(model)
    enc = model.encode("a good film")
    scores = Lexicon().run(ctx, enc, 1, Lexicon().defaults()).scores
    assert not [m for _, m in ctx.progress if m.startswith("lexicon")]  # type: ignore[attr-defined]
    outputs = torch_serving_runtime(model).run_inline(InlineBatch.from_encoded([enc], model.pad_id))
    np.testing.assert_array_equal(scores, LexiconLookup().attribute(outputs, 0, len(enc))[:, 1])


def test_the_lookup_without_a_table_says_how_to_build_one(random_bert: LoadedModel) -> None:
    assert "limelight lexicon --model" in LexiconLookup().unavailable_reason(random_bert)
    outputs = TorchRuntime(random_bert).run_inline(
        InlineBatch.from_encoded([random_bert.encode("a film")], random_bert.pad_id)
    )
    with pytest.raises(FailedPrecondition, match="lexicon table"):
        LexiconLookup().attribute(outputs, 0, 3)
