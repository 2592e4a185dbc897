"""The head's card format: readers refuse, with a message, a head whose layout they cannot
load; every head written before still loads."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from limelight.errors import FailedPrecondition
from limelight.models.explainer_head import (
    ExplainerHead,
    HeadCard,
    check_card,
    head_dir,
    inline_heads,
    load_head,
    read_card,
    save_head,
)
from limelight.models.loaded import LoadedModel, load_model

#: The one format Limelight read before the linear head (and until it got its own format):
#: such a reader checks the card's format against this string and nothing else.
CONTEXT_FORMAT = "limelight-distilled-head/2"


@pytest.fixture
def model(random_bert_dir: Path, tmp_path: Path) -> LoadedModel:
    """A copy of the tiny random BERT, so that the heads written beside it stay in this test."""
    copy = tmp_path / "model"
    shutil.copytree(random_bert_dir, copy)
    return load_model(copy, device="cpu")


def _card(model: LoadedModel, width: int, heads: int) -> HeadCard:
    return HeadCard(
        model_version=model.version,
        layers=[1, 2],
        hidden_size=model.hidden_size,
        num_labels=model.num_labels,
        width=width,
        attention_heads=heads,
        teacher="greedy_deletion",
    )


def _save(model: LoadedModel, width: int, heads: int) -> HeadCard:
    card = _card(model, width, heads)
    head = ExplainerHead(card.layers, card.hidden_size, card.num_labels, width, heads)
    save_head(head, card, head_dir(model))
    written = read_card(head_dir(model))
    assert written is not None
    return written


def test_a_linear_head_is_written_in_a_format_the_readers_before_it_refuse(
    model: LoadedModel,
) -> None:
    written = _save(model, width=0, heads=0)
    # A reader from before the linear head compares the format with its own and nothing else:
    # with the context head's format it built a context head of width 0 and crashed.
    assert written.format != CONTEXT_FORMAT
    assert not check_card(written, model)  # this Limelight reads it
    assert load_head(model).linear


def test_a_context_head_keeps_the_format_every_reader_loads(model: LoadedModel) -> None:
    written = _save(model, width=8, heads=2)
    assert written.format == CONTEXT_FORMAT
    assert not load_head(model).linear


def test_a_linear_head_written_before_its_format_still_loads(model: LoadedModel) -> None:
    _save(model, width=0, heads=0)
    path = head_dir(model) / "card.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format": CONTEXT_FORMAT}))
    assert load_head(model).linear
    assert set(inline_heads(model)) == {"distilled"}


def test_a_head_of_an_unknown_format_is_refused_with_a_message(
    model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    written = _save(model, width=0, heads=0)
    newer = replace(written, format="limelight-distilled-head/99")
    (head_dir(model) / "card.json").write_text(newer.to_json())
    assert "format 'limelight-distilled-head/99'" in check_card(newer, model)
    with pytest.raises(FailedPrecondition, match="limelight distill"):
        load_head(model)
    with caplog.at_level(logging.WARNING, logger="limelight.models.explainer_head"):
        assert inline_heads(model) == {}
    assert "not loading the distilled head" in caplog.text


#: What a copy cut short leaves of each file: the card as the audit found it, the weights'
#: first 100 bytes (safetensors: "invalid header length").
CUT_SHORT = {"card.json": b'{"model_version": \n', "head.safetensors": None}


@pytest.mark.parametrize("damaged", sorted(CUT_SHORT))
def test_a_head_cut_short_is_left_out_with_one_warning_that_names_its_file(
    model: LoadedModel, damaged: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A half-written card or weights file stopped every start with an error naming no file
    (``JSONDecodeError: Expecting value``, ``SafetensorError: invalid header length``)."""
    _save(model, width=8, heads=2)
    path = head_dir(model) / damaged
    path.write_bytes(CUT_SHORT[damaged] or path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert inline_heads(model) == {}
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    said = warning.getMessage()
    assert said.startswith("not loading the distilled head") and warning.exc_info is None
    assert str(path) in said and f"limelight distill --model {model.directory}" in said
    with pytest.raises(FailedPrecondition) as refused:
        load_head(model)
    assert str(path) in refused.value.message


def test_a_card_cut_short_is_refused_by_its_check_naming_the_file(model: LoadedModel) -> None:
    """What the `distilled` method (and a default named in the settings) says of such a card:
    a reason naming the file, not an exception."""
    _save(model, width=0, heads=0)
    path = head_dir(model) / "card.json"
    path.write_text('{"model_version": ')
    card = read_card(head_dir(model))
    assert card is not None
    reason = check_card(card, model)
    assert str(path) in reason and "cannot be read" in reason and "limelight distill" in reason
    path.write_text("[]")  # JSON, but not a card
    card = read_card(head_dir(model))
    assert card is not None and str(path) in check_card(card, model)


def served_without(
    model: Path, damaged: Path, method: str, cache: Path, caplog: pytest.LogCaptureFixture
) -> Any:
    """With the file ``damaged`` beside ``model``: under ``auto`` the model is served with
    NormXLogit and one warning naming the file; the service with ``method`` named as the
    default (not ready), for the caller's checks."""
    from tests.conftest import inline_service

    with caplog.at_level(logging.WARNING):
        service = inline_service(model, default_method="auto", cache_dir=cache)
    assert service.default_method.name == "normxlogit"
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert str(damaged) in warning.getMessage()
    return inline_service(model, default_method=method, cache_dir=cache)


@pytest.mark.parametrize("damaged", sorted(CUT_SHORT))
def test_the_sidecar_starts_without_a_head_cut_short_and_says_which_file(
    bert_tiny_dir: Path, tmp_path: Path, damaged: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under ``auto`` the model is served without the head (NormXLogit), as with a head made
    for another model; with the head's method named as the default, the sidecar is not ready
    and says which file, as it does for a head made for another model."""
    copy = Path(shutil.copytree(bert_tiny_dir, tmp_path / "model"))
    path = copy / "limelight_distilled" / damaged
    path.write_bytes(CUT_SHORT[damaged] or path.read_bytes()[:100])
    named = served_without(copy, path, "distilled", tmp_path / "cache", caplog)
    assert named.default_method.name == "distilled"
    assert "distilled" not in named.runtime.head_names
    assert str(path) in named.default_unavailable  # not ready, and which file to mend
