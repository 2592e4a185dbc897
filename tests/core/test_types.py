"""The JSON token shape of the HTTP APIs and the viewer, read from columns or from objects."""

from __future__ import annotations

import dataclasses

import pytest

from limelight.core.types import TokenColumns, TokenInfo, scored_tokens

TOKENS = [
    TokenInfo("[CLS]", 101, 0, 0, True),
    TokenInfo("not", 2025, 0, 3, False),
    TokenInfo("bad", 2919, 4, 7, False),
    TokenInfo("[SEP]", 102, 0, 0, True),
    TokenInfo("yes", 2748, 0, 3, False, 1),
    TokenInfo("[SEP]", 102, 0, 0, True, 1),
]


@pytest.mark.parametrize("columns", [True, False])
def test_each_token_with_its_score(columns: bool) -> None:
    scores = [0.0, 1.5, -2.25, None, 3.0, 0.5]
    tokens = TokenColumns.of(TOKENS) if columns else TOKENS
    got = scored_tokens(tokens, scores)
    want = []
    for token, score in zip(TOKENS, scores, strict=True):
        fields = dataclasses.asdict(token)
        del fields["id"]
        want.append({**fields, "score": score})
    assert got == want
    assert all(type(t["special"]) is bool and type(t["start"]) is int for t in got)
    assert all(s is None or type(s) is float for s in (t["score"] for t in got))


def test_a_score_per_token() -> None:
    with pytest.raises(ValueError):
        scored_tokens(TOKENS, [1.0])
