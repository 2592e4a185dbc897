"""Batch tokenisation gives exactly what the one-by-one path gives, errors in place."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from limelight.core.service import encode_batch
from limelight.core.types import Encoded, TokenColumns, TokenInfo
from limelight.errors import InvalidArgument
from limelight.models.loaded import load_model

INPUTS: list[tuple[str, str | None]] = [
    ("a gorgeous, witty, seductive movie", None),
    ("the plot is thin", "a person rests"),
    ("naïve café — déjà vu 🎬 ", None),
    ("word " * 400, None),  # over the limit: truncated
    ("a man sleeps " * 50, "a person rests " * 50),  # a truncated pair
    ("x", None),
    # Far over the limit: tokenised from a prefix when the kept tokens end well before the cut,
    # else whole; either way the same as tokenising everything.
    (". " * 1000, None),
    ("word " * 2000, None),
    ("x" * 600 + " word" * 100, None),  # the cut falls inside an over-long word
    ("naïve café " * 400, None),
]


def test_encode_batch_matches_encode(bert_tiny_dir: Path) -> None:
    model = load_model(bert_tiny_dir)
    for limit in (64, 512):
        batch = encode_batch(model, INPUTS, limit, "truncate")
        single = [model.encode(text, pair, limit, "truncate") for text, pair in INPUTS]
        assert batch == single
        if limit == 64:
            assert [e.truncated for e in single] == [False, False, False] + [True] * 2 + [False] + [
                True
            ] * 4


def test_encode_batch_of_one_matches_encode(bert_tiny_dir: Path) -> None:
    """A batch of one (an idle server's request) takes the backend's single-input call."""
    model = load_model(bert_tiny_dir)
    for limit in (64, 512):
        for text, pair in INPUTS:
            assert encode_batch(model, [(text, pair)], limit, "truncate") == [
                model.encode(text, pair, limit, "truncate")
            ]


def test_encode_batch_rejects_only_the_over_long_inputs(bert_tiny_dir: Path) -> None:
    model = load_model(bert_tiny_dir)
    batch = encode_batch(model, INPUTS, 64, "reject")
    for (text, pair), got in zip(INPUTS, batch, strict=True):
        if len(model.encode(text, pair, 10_000)) > 64:
            assert isinstance(got, InvalidArgument) and "the limit is 64" in str(got)
        else:
            assert got == model.encode(text, pair, 64, "reject")


def test_tokens_come_in_columns_that_read_as_token_objects(bert_tiny_dir: Path) -> None:
    """The tokenizer's lists are kept as they are (no object per token on the request path);
    indexing, slicing, iterating and pickling give the tokens as ``TokenInfo`` objects."""
    model = load_model(bert_tiny_dir)
    text, pair = "the plot is thin", "a person rests"
    batched = encode_batch(model, [(text, pair)])[0]
    assert isinstance(batched, Encoded)
    for encoded in (batched, model.encode(text, pair)):
        columns = encoded.tokens
        assert isinstance(columns, TokenColumns)
        rows = list(columns)
        assert all(isinstance(t, TokenInfo) for t in rows) and len(rows) == len(encoded)
        assert [t.id for t in rows] == encoded.input_ids == columns.ids
        assert [columns[i] for i in range(len(rows))] == rows
        assert columns[-1] == rows[-1] and columns[1:3] == rows[1:3]
        assert rows[0].special and rows[-1].special and not rows[1].special
        assert {t.segment for t in rows if not t.special} == {0, 1}
        for t in rows:
            if not t.special:
                assert (text if t.segment == 0 else pair)[t.start : t.end] == t.text
        assert list(encoded.special_mask) == [t.special for t in rows]
        assert TokenColumns.of(rows) == columns == rows
        assert TokenColumns.of(columns) is columns
        assert pickle.loads(pickle.dumps(columns)) == rows
        with pytest.raises(IndexError):
            columns[len(rows)]
