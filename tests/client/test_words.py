"""Words as BERT's basic pre-tokenizer defines them (whitespace, each punctuation character and
each CJK ideograph apart), as far as the offsets allow; the HTML top-tokens table with NaN;
strict JSON of a drift report; explanations are explicitly unhashable."""

from __future__ import annotations

import json
import math
import re

import pytest

from limelight_client import Client, Explanation, Token
from limelight_client.types import DriftReport, LabelDrift
from tests.conftest import RunningSidecar


def _explanation(
    text: str, spans: list[tuple[int, int]], scores: list[float] | None = None
) -> Explanation:
    tokens = [Token("[CLS]", 101, 0, 0, True)]
    tokens += [Token(text[s:e], 1000 + i, s, e) for i, (s, e) in enumerate(spans)]
    tokens.append(Token("[SEP]", 102, 0, 0, True))
    values = [0.0, *(scores or [1.0] * len(spans)), 0.0]
    return Explanation(
        label="pos",
        label_index=1,
        labels=["neg", "pos"],
        probabilities={"neg": 0.5, "pos": 0.5},
        tokens=tokens,
        scores=values,
        method="m",
        target_label="pos",
        target_index=1,
        text=text,
    )


def _chars(text: str) -> list[tuple[int, int]]:
    return [(i, i + 1) for i, c in enumerate(text) if not c.isspace()]


def test_cjk_ideographs_are_words_of_their_own() -> None:
    text = "这部电影非常好看，演员很棒。"
    exp = _explanation(text, _chars(text))
    assert [w.text for w in exp.words(punctuation_apart=True)] == list(text)
    # Ideographs stand apart even without punctuation_apart (and so then does what touches them).
    assert [w.text for w in exp.words()] == list(text)
    assert [t.text for t in exp.by_words().tokens[1:-1]] == list(text)


def test_kana_runs_stay_words_between_ideographs() -> None:
    text = "素晴らしい映画でした"
    words = _explanation(text, _chars(text)).by_words()
    assert [t.text for t in words.tokens[1:-1]] == ["素", "晴", "らしい", "映", "画", "でした"]


def test_each_punctuation_character_is_a_word_when_apart() -> None:
    text = "it was good,but boring...really dull"
    spans = [(0, 2), (3, 6), (7, 9), (9, 11), (11, 12), (12, 15), (16, 22)]
    spans += [(22, 23), (23, 24), (24, 25), (25, 31), (32, 36)]
    exp = _explanation(text, spans)
    assert [w.text for w in exp.words(punctuation_apart=True)] == [
        "it", "was", "good", ",", "but", "boring", ".", ".", ".", "really", "dull",
    ]  # fmt: skip
    assert [w.tokens for w in exp.words(punctuation_apart=True)][2] == (3, 4)  # "go", "##od"
    # Without punctuation_apart, punctuation stays with the word it touches.
    assert [w.text for w in exp.words()] == ["it", "was", "good,but", "boring...really", "dull"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("don't stop", ["don't", "stop"]),
        ("it\u2019s fine", ["it\u2019s", "fine"]),
        ("'quoted'", ["'", "quoted", "'"]),
        ("rock 'n' roll", ["rock", "'", "n", "'", "roll"]),
        ("the cast's", ["the", "cast's"]),
    ],
)
def test_an_apostrophe_between_letters_stays_in_its_word(text: str, words: list[str]) -> None:
    """BERT splits "don't" into three words; a word-level heat-map of "don", "'", "t" reads
    worse than one of "don't" (negations matter to a sentiment model's reader)."""
    exp = _explanation(text, _chars(text))
    assert [w.text for w in exp.words(punctuation_apart=True)] == words
    assert [t.text for t in exp.by_words().tokens[1:-1]] == words


def test_by_words_of_a_real_sidecar_splits_text_without_spaces(sidecar: RunningSidecar) -> None:
    with Client(sidecar.target, timeout=60) as client:
        cjk = client.explain("这部电影非常好看，演员很棒。")
        assert [t.text for t in cjk.by_words().tokens if not t.special] == list(
            "这部电影非常好看，演员很棒。"
        )
        punct = client.explain("it was good,but boring...really dull")
        shown = [t.text for t in punct.by_words().tokens if not t.special]
        assert shown == ["it", "was", "good", ",", "but", "boring", ".", ".", ".", "really", "dull"]


def test_html_top_tokens_order_as_top_does_with_nan() -> None:
    text = "a b c d e"
    exp = _explanation(text, _chars(text), [1.0, math.nan, 5.0, 3.0, 4.0])
    expected = [tok.text for tok, _ in exp.top(5, absolute=True)]
    assert expected == ["c", "e", "d", "a", "b"]
    table = exp.to_html().split("Top tokens")[1]
    shown = re.findall(r'<span class="tok"[^>]*>([^<]*)</span>', table)
    assert shown == expected


def test_drift_report_to_dict_is_strict_json() -> None:
    pending = LabelDrift(label="pos", divergence=math.nan, alert=False, window_count=0)
    report = DriftReport(
        reference_state="building",
        reference_count=3,
        window_count=0,
        alert_threshold=0.2,
        labels=[pending],
        label_mix_divergence=math.inf,
    )
    out = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert out["labels"][0]["divergence"] is None
    assert out["label_mix_divergence"] is None
    assert not pending.compared


def test_explanations_are_explicitly_unhashable() -> None:
    exp = _explanation("a b", _chars("a b"))
    with pytest.raises(TypeError, match="unhashable type: 'Explanation'"):
        hash(exp)
    assert Explanation.__hash__ is None
    assert exp == _explanation("a b", _chars("a b"))
