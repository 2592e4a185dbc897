"""Terminal and HTML rendering."""

from __future__ import annotations

import dataclasses
import html
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from limelight_client import Explanation
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.render import color_for, contrast_centre, layout, token_text
from tests.browser import needs_browser

Factory = Callable[..., pb.ExplainResponse]

ANSI = re.compile(r"\x1b\[[0-9;]*m")
BG = re.compile(r"\x1b\[48;2;(\d+);(\d+);(\d+)m")


def wordpiece_explanation(text: str | None = "unbelievably good") -> Explanation:
    """BERT-style word pieces of one word: the renderers must draw them as one word."""
    tokens = [
        pb.Token(text="[CLS]", id=101, special=True),
        pb.Token(text="un", id=4895, start=0, end=2),
        pb.Token(text="##believ", id=6499, start=2, end=8),
        pb.Token(text="##ably", id=8231, start=8, end=12),
        pb.Token(text="good", id=2204, start=13, end=17),
        pb.Token(text="[SEP]", id=102, special=True),
    ]
    return explained(tokens, [5.0, 0.5, -0.25, 0.1, 1.0, 5.0], text)


def explained(
    tokens: list[pb.Token],
    scores: list[float],
    text: str | None,
    labels: tuple[str, str] = ("negative", "positive"),
) -> Explanation:
    """A NormXLogit answer predicting and explaining ``labels[1]`` (probability 0.9)."""
    msg = pb.ExplainResponse(
        label=labels[1],
        label_index=1,
        labels=list(labels),
        probabilities=[0.1, 0.9],
        explanation=pb.Explanation(
            method="normxlogit",
            target_index=1,
            target_label=labels[1],
            tokens=tokens,
            scores=scores,
        ),
    )
    return Explanation.from_proto(msg, text=text)


def test_a_combining_accent_stays_with_the_word_it_belongs_to() -> None:
    """An uncased WordPiece strips accents: "cafe\u0301" is the token "cafe" at 0–4, and the
    accent left behind sat on the score's bracket ("cafe[+1.000]\u0301")."""
    tokens = [pb.Token(text="cafe", id=1, start=0, end=4), pb.Token(text="ok", start=6, end=8)]
    exp = explained(tokens, [1.0, -0.5], "cafe\u0301 ok")
    assert [(s.text, s.token) for s in layout(exp)] == [("cafe\u0301", 0), (" ", None), ("ok", 1)]
    assert "cafe\u0301[+1.000] ok[-0.500]" in exp.to_terminal(color=False).splitlines()
    assert token_text(exp, exp.tokens[0]) == "cafe\u0301"


def test_layout_uses_offsets_into_original_text() -> None:
    exp = wordpiece_explanation()
    spans = layout(exp)
    assert "".join(s.text for s in spans) == "unbelievably good"
    assert [(s.text, s.token) for s in spans] == [
        ("un", 1),
        ("believ", 2),
        ("ably", 3),
        (" ", None),
        ("good", 4),
    ]


def test_layout_without_text_rebuilds_words() -> None:
    exp = wordpiece_explanation(text=None)
    assert "".join(s.text for s in layout(exp)) == "unbelievably good"


def test_color_scale_is_diverging_and_normalised() -> None:
    assert color_for(0.0, 1.0) == (255, 255, 255)
    red, blue = color_for(1.0, 1.0), color_for(-1.0, 1.0)
    assert red[0] > red[2] and blue[2] > blue[0]
    assert color_for(5.0, 1.0) == red  # clipped at max |score|
    half = color_for(0.5, 1.0)
    assert red[1] < half[1] < 255
    assert color_for(1.0, 0.0) == (255, 255, 255)


def test_terminal_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")  # not "dumb", as some CI runners set it
    exp = wordpiece_explanation()
    out = exp.to_terminal()
    plain = ANSI.sub("", out)
    # The original text, word pieces joined, without tokenizer markers.
    assert "unbelievably good" in plain
    assert "##" not in plain and "[CLS]" not in plain
    assert "\x1b[48;2;" in out
    # "good" (1.0 = max |score| among non-special tokens) gets the full red.
    good_line = next(line for line in out.splitlines() if "good" in ANSI.sub("", line))
    colours = [tuple(map(int, m)) for m in BG.findall(good_line)]
    assert color_for(1.0, 1.0) in colours
    # The negative piece is blue.
    assert color_for(-0.25, 1.0) in colours
    # Label and probability bars.
    assert "positive" in plain and "0.900" in plain and "0.100" in plain
    assert "█" in plain


def test_terminal_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    exp = wordpiece_explanation()
    out = exp.to_terminal()
    assert "\x1b[" not in out
    assert "un[+0.500]believ[-0.250]ably[+0.100] good[+1.000]" in out
    assert "0.900" in out


def test_terminal_color_argument_overrides_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[48;2;" in wordpiece_explanation().to_terminal(color=True)
    monkeypatch.setenv("NO_COLOR", "")  # empty means unset (no-color.org)
    assert "\x1b[48;2;" in wordpiece_explanation().to_terminal()


def test_force_color_wins_over_no_color_as_in_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert "\x1b[48;2;" in wordpiece_explanation().to_terminal()
    assert "\x1b[" not in wordpiece_explanation().to_terminal(color=False)
    monkeypatch.setenv("FORCE_COLOR", "")  # empty means unset
    assert "\x1b[" not in wordpiece_explanation().to_terminal()


def test_terminal_neutralises_control_characters(response_factory: Factory) -> None:
    text = "evil \x1b[2J text"
    exp = Explanation.from_proto(response_factory(text), text=text)
    out = exp.to_terminal(color=False)
    assert "\x1b" not in out


def test_html_escapes_and_is_self_contained(response_factory: Factory, tmp_path: Path) -> None:
    text = 'I <script>alert("x")</script> & loved it'
    exp = Explanation.from_proto(response_factory(text), text=text)
    path = tmp_path / "exp.html"
    page = exp.to_html(path)
    assert path.read_text(encoding="utf-8") == page
    assert "<script" not in page.lower()
    assert "&lt;" in page and "&amp;" in page
    for needle in ("http://", "https://", "src=", "href=", "url(", "<link", "@import"):
        assert needle not in page.lower()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # Every non-special token appears as an (escaped) span with its score in the tooltip.
    spans = re.findall(r'<span class="tok"[^>]*title="([^"]*)"[^>]*>([^<]*)</span>', page)
    shown = [html.unescape(t) for _, t in spans]
    words = [t for t in exp.tokens if not t.special]
    assert shown == [text[t.start : t.end] for t in words]
    for (title, _), tok, score in zip(
        spans,
        words,
        [s for t, s in zip(exp.tokens, exp.scores, strict=True) if not t.special],
        strict=True,
    ):
        assert f"{score:+.3f}" in html.unescape(title)
        assert html.unescape(title).startswith(tok.text)
    # The whole original text survives (escaped) in reading order.
    text_block = re.search(r'<p class="text">(.*?)</p>', page, re.S)
    assert text_block is not None
    assert html.unescape(re.sub(r"<[^>]+>", "", text_block.group(1))) == text
    assert "Top tokens" in page and "0.750" in page  # top table and probabilities


def test_html_several_score_arrays_side_by_side() -> None:
    exp = wordpiece_explanation()
    n = len(exp.tokens)
    msg_value = [0.1 * i for i in range(n)]
    exp = Explanation(
        **{
            **{f: getattr(exp, f) for f in exp.__dataclass_fields__},
            "extra_scores": {"value": msg_value, "importance": [-1.0] * n},
        }
    )
    page = exp.to_html(scores=["value", "importance"])
    assert page.count('<div class="map">') == 2
    assert "<h2>value</h2>" in page and "<h2>importance</h2>" in page
    assert page.count("Top tokens by") == 2
    with pytest.raises(KeyError):
        exp.to_html(scores=["missing"])
    # Arrays other than class evidence get a neutral legend.
    legend = exp.to_terminal(scores="importance", color=False).splitlines()[-1]
    assert legend.startswith("importance: ") and "supports" not in legend
    assert "supports positive" in exp.to_terminal(color=False).splitlines()[-1]


def test_a_map_whose_tokens_all_score_the_same_says_so_instead_of_a_scale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SLALOM's importance of a one-word text is 0: a legend from -0.000 to +0.000 would
    look like a rendering fault."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    exp = wordpiece_explanation()
    exp = Explanation(
        **{
            **{f: getattr(exp, f) for f in exp.__dataclass_fields__},
            "extra_scores": {"importance": [0.0] * len(exp.tokens)},
        }
    )
    for color in (True, False):
        legend = ANSI.sub("", exp.to_terminal(scores="importance", color=color)).splitlines()[-1]
        assert legend == "importance: every token scores +0.000: none stands out"
    page = exp.to_html(scores=["importance"])
    assert "every token scores +0.000: none stands out" in page
    assert "-0.000" not in page and "every token scores" not in exp.to_html()
    # Nor a colour bar from +0.000 to +0.000 beside the words.
    (flat,) = [m for m in page.split('<div class="map">')[1:] if "none stands out" in m]
    assert 'class="grad"' not in flat and 'class="grad"' in exp.to_html()


def test_scores_that_are_not_numbers_are_not_drawn_as_zero() -> None:
    """A method that broke down on a text (nan, inf) is not a map where "every token scores
    +0.000": the legend says which tokens have no finite score."""
    base = wordpiece_explanation()
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    n = len(base.tokens)
    shown = sum(1 for t in base.tokens if not t.special)
    broken = Explanation(**{**fields, "scores": [math.nan] * n})
    for color in (True, False):
        legend = ANSI.sub("", broken.to_terminal(color=color)).splitlines()[-1]
        assert legend == "no token has a finite score (nan or inf): this map shows nothing"
        assert "every token scores" not in broken.to_terminal(color=color)
    assert "this map shows nothing" in broken.to_html()
    first = next(i for i, t in enumerate(base.tokens) if not t.special)
    partly = [math.inf if i == first else float(i) for i in range(n)]
    some = Explanation(**{**fields, "scores": partly})
    note = f"1 of {shown} tokens have no finite score (nan or inf) and are drawn white"
    assert ANSI.sub("", some.to_terminal(color=True)).splitlines()[-1] == note
    assert note in some.to_html()
    assert "finite score" not in base.to_terminal(color=False) + base.to_html()


def test_terminal_several_score_arrays_share_one_header() -> None:
    exp = wordpiece_explanation()
    n = len(exp.tokens)
    exp = Explanation(
        **{
            **{f: getattr(exp, f) for f in exp.__dataclass_fields__},
            "extra_scores": {"importance": [float(i % 3 - 1) for i in range(n)]},
        }
    )
    out = exp.to_terminal(scores=["scores", "importance"], color=False)
    lines = out.splitlines()
    assert sum(line.startswith("prediction: ") for line in lines) == 1
    assert f"── {exp.method} ──" in lines and "── importance ──" in lines
    assert lines.index(f"── {exp.method} ──") < lines.index("── importance ──")
    # each map carries its own legend: class evidence for the primary array, neutral after it
    legends = [line for line in lines if "scores in brackets" in line]
    assert len(legends) == 2
    assert "supports" in legends[0] and "supports" not in legends[1]
    with pytest.raises(KeyError):
        exp.to_terminal(scores=["scores", "missing"])


def test_html_wordpieces_join_into_the_word() -> None:
    page = wordpiece_explanation().to_html()
    text_block = re.search(r'<p class="text">(.*?)</p>', page, re.S)
    assert text_block is not None
    assert re.sub(r"<[^>]+>", "", text_block.group(1)) == "unbelievably good"
    # Tokenizer markers only in the tooltips (the raw token), never in the visible text.
    assert "##" not in re.sub(r"<[^>]+>", "", text_block.group(1))
    assert 'title="##believ' in text_block.group(1)


def test_html_text_pair(response_factory: Factory) -> None:
    exp = Explanation.from_proto(
        response_factory("A man sleeps.", "Nobody sleeps."),
        text="A man sleeps.",
        text_pair="Nobody sleeps.",
    )
    page = exp.to_html()
    blocks = re.findall(r'<p class="text">(.*?)</p>', page, re.S)
    assert [re.sub(r"<[^>]+>", "", b) for b in blocks] == ["A man sleeps.", "Nobody sleeps."]
    assert "text pair" in page
    assert "text pair: Nobody[" in exp.to_terminal(color=False)


def test_words_merge_pieces_and_sum_scores() -> None:
    exp = wordpiece_explanation()
    words = exp.words()
    assert [(w.text, w.tokens, w.start, w.end) for w in words] == [
        ("unbelievably", (1, 2, 3), 0, 12),
        ("good", (4,), 13, 17),
    ]
    assert words[0].score == pytest.approx(0.5 - 0.25 + 0.1)
    assert words[1].score == pytest.approx(1.0)
    # Without the text, the pieces are joined from the token strings.
    assert [w.text for w in wordpiece_explanation(text=None).words()] == ["unbelievably", "good"]


def test_words_keep_segments_apart(response_factory: Factory) -> None:
    exp = Explanation.from_proto(
        response_factory("don't stop", "stop."), text="don't stop", text_pair="stop."
    )
    assert [(w.text, w.segment) for w in exp.words()] == [
        ("don't", 0),
        ("stop", 0),
        ("stop.", 1),
    ]
    assert sum(w.score for w in exp.words()) == pytest.approx(
        sum(s for t, s in zip(exp.tokens, exp.scores, strict=True) if not t.special)
    )


def _uniform_positive() -> Explanation:
    """Scores that all share one sign and are close in size (NormXLogit's usual look)."""
    words = ["a", "gorgeous", "movie", "indeed"]
    tokens = [pb.Token(text="[CLS]", id=101, special=True)]
    start = 0
    for w in words:
        tokens.append(pb.Token(text=w, id=1000 + len(tokens), start=start, end=start + len(w)))
        start += len(w) + 1
    tokens.append(pb.Token(text="[SEP]", id=102, special=True))
    msg = pb.ExplainResponse(
        label="fresh",
        label_index=1,
        labels=["rotten", "fresh"],
        probabilities=[0.1, 0.9],
        explanation=pb.Explanation(
            method="normxlogit",
            target_index=1,
            target_label="fresh",
            tokens=tokens,
            scores=[9.0, 2.0, 2.6, 2.1, 2.2, 9.0],
        ),
    )
    return Explanation.from_proto(msg, text=" ".join(words))


def test_one_signed_near_uniform_scores_still_show_contrast(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    exp = _uniform_positive()
    assert contrast_centre(exp.scores, exp.tokens) == pytest.approx(2.15)
    out = exp.to_terminal()
    line = next(row for row in out.splitlines() if "gorgeous" in ANSI.sub("", row))
    colours = [tuple(map(int, m)) for m in BG.findall(line)]
    # The strongest token gets the full red, the weakest a clear blue: not one shade of red.
    assert color_for(1.0, 1.0) in colours and color_for(-1.0, 3.0) in colours
    assert "centred on the median" in ANSI.sub("", out)
    page = tmp_path / "m.html"
    exp.to_html(page)
    assert "white is the median" in page.read_text()
    # Mixed signs keep zero as white.
    assert contrast_centre([0.0, 1.0, -0.5, 0.0], _uniform_positive().tokens[:4]) == 0.0
    # Without colour the numbers are the raw scores, and so is the largest the legend names
    # (2.6, not the 0.45 spread around the median; the special tokens' 9.0 is no token's).
    plain = exp.to_terminal(color=False)
    assert "gorgeous[+2.600]" in plain and "max |score| 2.600" in plain


def test_a_fragment_is_the_page_as_one_div_with_its_style_scoped_to_it() -> None:
    from limelight_client.render import _CSS, FRAGMENT_CLASS

    exp = wordpiece_explanation()
    page, fragment = exp.to_html(), exp.to_html(fragment=True)
    assert exp._repr_html_() == fragment  # what a notebook shows
    assert fragment.startswith(f'<div class="{FRAGMENT_CLASS}"')
    assert fragment.rstrip().endswith("</div>")
    for whole_page_only in ("!DOCTYPE", "html", "head", "body", "title"):
        assert not re.search(rf"<{whole_page_only}[\s>]", fragment, re.I), whole_page_only
    # the same content: token spans, probabilities, top tokens
    spans = re.compile(r'<span class="tok"[^>]*>[^<]*</span>')
    assert spans.findall(fragment) == spans.findall(page) != []
    assert "Top tokens" in fragment and "0.900" in fragment
    # every rule of the fragment's style sheet applies inside the fragment only
    assert "@" not in _CSS  # plain rules: the scoping does not handle nested braces
    style = re.search(r"<style>(.*?)</style>", fragment, re.S)
    assert style is not None
    selectors = [
        sel.strip()
        for rule in style.group(1).split("}")
        if rule.strip()
        for sel in rule.partition("{")[0].split(",")
    ]
    assert selectors and all(
        sel == f".{FRAGMENT_CLASS}" or sel.startswith(f".{FRAGMENT_CLASS} ") for sel in selectors
    ), selectors


@needs_browser
def test_a_fragment_in_a_host_page_keeps_its_look_and_leaves_the_host_alone(
    browser: Any, tmp_path: Path
) -> None:
    """Two explanations embedded in one host page, as a notebook shows them: the browser
    colours their tokens as on the stand-alone page, and the host's own heading and table keep
    the host's style."""
    exp = wordpiece_explanation()
    alone = tmp_path / "alone.html"
    exp.to_html(alone)
    host = tmp_path / "host.html"
    host.write_text(
        "<!DOCTYPE html><html><head><style>h1{font-size:40px} td{padding:9px}</style></head>"
        '<body><h1 id="own">notebook</h1><table><tr><td id="cell">x</td></tr></table>'
        + exp.to_html(fragment=True)
        + wordpiece_explanation("unbelievably good").to_html(fragment=True)
        + "</body></html>",
        encoding="utf-8",
    )
    colours = (
        "return [...document.querySelectorAll('.tok')]"
        ".map(s => getComputedStyle(s).backgroundColor)"
    )
    browser.get(alone.as_uri())
    expected = browser.execute_script(colours)
    browser.get(host.as_uri())
    assert browser.execute_script(colours) == expected * 2 != []
    own = browser.execute_script(
        "return [getComputedStyle(document.getElementById('own')).fontSize,"
        " getComputedStyle(document.getElementById('cell')).paddingTop]"
    )
    assert own == ["40px", "9px"]
    inner = browser.execute_script(
        "return getComputedStyle(document.querySelector('.limelight-explanation h1')).fontSize"
    )
    assert inner != "40px"  # the fragment's heading keeps its own size (1.4rem)


def test_a_truncated_answer_says_how_much_of_the_text_was_explained() -> None:
    import dataclasses

    cut = dataclasses.replace(
        wordpiece_explanation("unbelievably good, and then much more"), truncated=True
    )
    said = "the input was truncated to the model's token limit: the first 17 of 37 characters"
    assert f"note: {said} were explained" in cut.to_terminal(color=False)
    assert html.escape(f"The {said[4:]}") in cut.to_html()
    whole = dataclasses.replace(wordpiece_explanation("unbelievably good"), truncated=True)
    assert "characters" not in whole.to_terminal(color=False)  # every character was reached


def test_an_answer_explained_in_windows_says_so_in_html_as_in_the_terminal() -> None:
    import dataclasses

    windowed = dataclasses.replace(wordpiece_explanation(), windows=3)
    said = "xplained in 3 overlapping windows, stitched together"
    assert f"note: e{said}" in windowed.to_terminal(color=False)
    page = windowed.to_html()
    assert f'<p class="meta">E{said}.</p>' in page
    assert page.index(f"E{said}") < page.index("</header>")
    assert f"E{said}" in windowed.to_html(fragment=True)
    assert "window" not in wordpiece_explanation().to_html().lower()  # one pass: no note


def _pieces_explanation() -> Explanation:
    """WordPiece tokens of "(unbelievably) good, don't" with arbitrary scores in every array,
    all classes, and a second explained label (multi-label)."""
    spans = [
        ("(", 0, 1),
        ("un", 1, 3),
        ("##believ", 3, 9),
        ("##ably", 9, 13),
        (")", 13, 14),
        ("good", 15, 19),
        (",", 19, 20),
        ("don", 21, 24),
        ("'", 24, 25),
        ("t", 25, 26),
    ]
    tokens = [pb.Token(text="[CLS]", id=101, special=True)]
    tokens += [pb.Token(text=t, id=1000 + i, start=s, end=e) for i, (t, s, e) in enumerate(spans)]
    tokens.append(pb.Token(text="[SEP]", id=102, special=True))

    def scores(seed: int) -> list[float]:
        return [((7 * i + seed) % 11 - 5) / 4 for i in range(len(tokens))]

    first = pb.Explanation(
        method="distilled",
        target_index=1,
        target_label="positive",
        tokens=tokens,
        scores=scores(1),
        class_scores=[
            pb.ClassScores(scores=[a, b]) for a, b in zip(scores(2), scores(3), strict=True)
        ],
    )
    first.extra_scores["normxlogit"].values.extend(scores(4))
    second = pb.Explanation(
        method="distilled", target_index=0, target_label="negative", scores=scores(5)
    )
    msg = pb.ExplainResponse(
        label="positive",
        label_index=1,
        labels=["negative", "positive"],
        probabilities=[0.6, 0.9],
        multi_label=True,
        predicted_labels=["positive", "negative"],
        explanation=first,
        label_explanations=[second],
    )
    return Explanation.from_proto(msg, text="(unbelievably) good, don't")


def _summed_by_span(exp: Explanation, merged: Explanation, values: list[float]) -> list[float]:
    """The reference: each merged token's value is the sum over the original tokens whose
    character span lies inside its span (a special token: its own value)."""
    out = []
    for new in merged.tokens:
        if new.special:
            (index,) = [i for i, t in enumerate(exp.tokens) if t is new]
            out.append(values[index])
            continue
        inside = [
            v
            for t, v in zip(exp.tokens, values, strict=True)
            if not t.special and new.start <= t.start and t.end <= new.end
        ]
        out.append(sum(inside))
    return out


def test_by_words_merges_pieces_sums_every_array_and_keeps_punctuation_apart() -> None:
    exp = _pieces_explanation()
    merged = exp.by_words()
    assert [t.text for t in merged.tokens] == [
        "[CLS]",
        "(",
        "unbelievably",
        ")",
        "good",
        ",",
        "don't",
        "[SEP]",
    ]
    assert [t.id for t in merged.tokens] == [101, 1000, -1, 1004, 1005, 1006, -1, 102]
    assert (merged.tokens[2].start, merged.tokens[2].end) == (1, 13)
    assert merged.scores == pytest.approx(_summed_by_span(exp, merged, exp.scores))
    extra = merged.extra_scores["normxlogit"]
    assert extra == pytest.approx(_summed_by_span(exp, merged, exp.extra_scores["normxlogit"]))
    assert exp.class_scores is not None and merged.class_scores is not None
    for column in (0, 1):
        original = [row[column] for row in exp.class_scores]
        assert [row[column] for row in merged.class_scores] == pytest.approx(
            _summed_by_span(exp, merged, original)
        )
    (other,) = merged.label_explanations
    assert other.tokens == merged.tokens
    assert other.scores == pytest.approx(
        _summed_by_span(exp, merged, exp.label_explanations[0].scores)
    )
    # Every renderer draws the words: the text is unchanged, the pieces' markers gone.
    plain = merged.to_terminal(color=False)
    assert re.search(r"\(\[[+-][\d.]+\]unbelievably\[[+-][\d.]+\]\)", plain), plain
    assert "don't[" in plain and "##" not in plain
    page = merged.to_html()
    assert 'title="unbelievably: ' in page and "(id -1)" not in page
    assert 'title="good (id 1005): ' in page
    assert merged.top(1)[0][0].text in {"(", "unbelievably", ")", "good", ",", "don't"}
    assert exp.by_words().by_words().tokens == merged.tokens  # already words: unchanged
    apart = exp.words(punctuation_apart=True)
    assert [(w.text, w.score) for w in apart] == [
        (t.text, s) for t, s in zip(merged.tokens, merged.scores, strict=True) if not t.special
    ]
    assert [w.text for w in exp.words()] == ["(unbelievably)", "good,", "don't"]


def test_html_shows_bidirectional_controls_as_the_terminal_does() -> None:
    """An override or isolate in the text (between tokens or inside one) would reorder every
    token after it on the page: the map, its tooltips and the top table show U+FFFD instead,
    as ``terminal_safe`` does, and the text keeps its order."""
    text = "a\u202egood film is b\u2066ad"
    spans = [("a", 0, 1), ("good", 2, 6), ("film", 7, 11), ("is", 12, 14), ("bad", 15, 19)]
    tokens = [pb.Token(text=t, id=1000 + i, start=s, end=e) for i, (t, s, e) in enumerate(spans)]
    exp = explained(tokens, [0.5, -1.0, 0.25, 0.1, 2.0], text)
    controls = re.compile("[\u202a-\u202e\u2066-\u2069]")
    for page in (exp.to_html(), exp.to_html(fragment=True)):
        assert not controls.search(page)
        block = re.search(r'<p class="text">(.*?)</p>', page, re.S)
        assert block is not None
        shown = html.unescape(re.sub(r"<[^>]+>", "", block.group(1)))
        assert shown == "a\ufffdgood film is b\ufffdad"
        assert page.count(">b\ufffdad</span>") == 2  # in the map and in the top table


def test_terminal_safe_leaves_no_control_a_terminal_would_act_on() -> None:
    from limelight_client.render import terminal_safe

    assert terminal_safe("a\x1b[2Jb\x07c\x7fd") == "a\ufffd[2Jb\ufffdc\ufffdd"
    # C1 controls: U+009B alone starts a control sequence on some terminals.
    assert terminal_safe("x\x9b31my\x85z") == "x\ufffd31my\ufffdz"
    # Bidirectional overrides and isolates reorder the rest of the line.
    assert terminal_safe("\u202eevil\u202c \u2066x\u2069") == "\ufffdevil\ufffd \ufffdx\ufffd"
    # Line ends of every convention end a line; tabs, emoji and accents stay.
    assert terminal_safe("one\r\ntwo\rthree\nfour\tfive \U0001f600 \u00e9") == (
        "one\ntwo\nthree\nfour\tfive \U0001f600 \u00e9"
    )


def test_probability_bars_line_up_under_wide_labels() -> None:
    """A Chinese label takes two terminal columns per character: padded by characters, its
    bar started two columns to the right of the others' per character."""
    from limelight_client.render import columns

    tokens = [pb.Token(text="ok", id=2, start=0, end=2)]
    page = explained(tokens, [1.0], "ok", ("neutral", "情绪")).to_terminal(color=False)
    shown = page.splitlines()
    bars = [line for line in shown if "█" in line or "░" in line]
    assert len(bars) == 2
    starts = {columns(line[: min(line.index(c) for c in "█░" if c in line)]) for line in bars}
    assert len(starts) == 1, bars


def _jamo_explanation() -> Explanation:
    """An uncased WordPiece cuts each Hangul syllable of "정말 좋아 cafe" into its three
    letters, all three with the syllable's span (as bert-tiny's tokenizer answers)."""
    spans = [("ᄌ", 0, 1), ("##ᅥ", 0, 1), ("##ᆼ", 0, 1), ("##ᄆ", 1, 2), ("##ᅡ", 1, 2)]
    spans += [("##ᆯ", 1, 2), ("[UNK]", 3, 5), ("cafe", 6, 10)]
    tokens = [pb.Token(text="[CLS]", id=101, special=True)]
    tokens += [pb.Token(text=t, id=1000 + i, start=s, end=e) for i, (t, s, e) in enumerate(spans)]
    tokens.append(pb.Token(text="[SEP]", id=102, special=True))
    scores = [9.0, 0.25, 0.5, 1.0, -0.125, -0.25, -0.5, 2.0, 4.0, 9.0]
    return explained(tokens, scores, "정말 좋아 cafe")


def test_pieces_of_one_character_join_their_word_and_show_once_with_their_sum() -> None:
    exp = _jamo_explanation()
    assert [(w.text, w.score, w.tokens) for w in exp.words()] == [
        ("정말", 0.875, (1, 2, 3, 4, 5, 6)),
        ("좋아", 2.0, (7,)),
        ("cafe", 4.0, (8,)),
    ]
    assert [t.text for t in exp.by_words().tokens] == ["[CLS]", "정말", "좋아", "cafe", "[SEP]"]
    chars = exp.by_characters()
    assert [(t.text, t.start, t.end, t.id) for t in chars.tokens[1:3]] == [
        ("정", 0, 1, -1),
        ("말", 1, 2, -1),
    ]
    assert chars.scores == pytest.approx([9.0, 1.75, -0.875, 2.0, 4.0, 9.0])
    assert chars.by_characters() is chars  # nothing left to merge
    # Each syllable is drawn once, with its letters' summed score (not the first letter's).
    plain = exp.to_terminal(color=False).splitlines()
    assert "정[+1.750]말[-0.875] 좋아[+2.000] cafe[+4.000]" in plain, plain
    page = exp.to_html()
    assert page.count('title="정') == page.count('title="말') == 1


def _glyph_explanation() -> Explanation:
    """A map with every drawing character (the predicted label's mark, bars, the rule over
    each of two maps) and text a narrow encoding cannot write: Chinese, an accent, a label in
    Chinese."""
    tokens = [
        pb.Token(text="[CLS]", id=101, special=True),
        pb.Token(text="[UNK]", id=100, start=0, end=2),
        pb.Token(text="cafe", id=7, start=3, end=7),
        pb.Token(text="great", id=2307, start=8, end=13),
        pb.Token(text="[SEP]", id=102, special=True),
    ]
    exp = explained(tokens, [0.0, -0.5, 0.25, 1.0, 0.0], "电影 café great", ("差", "fresh"))
    return dataclasses.replace(exp, extra_scores={"importance": [0.0, 0.1, 0.2, 0.3, 0.0]})


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_stream_that_cannot_encode_the_drawing_characters_gets_ascii_ones(
    encoding: str,
) -> None:
    """``PYTHONIOENCODING=ascii limelight explain ...`` ended with UnicodeEncodeError and the
    result lost: ``▶ █ ░ ──`` cannot be written in ASCII (nor in Latin-1). The map is drawn
    with ``> # . --`` for such a stream, and text it cannot write shows as ``?``."""
    from limelight_client.render import to_terminal

    exp = _glyph_explanation()
    for color in (False, True):
        page = to_terminal(exp, ["scores", "importance"], color=color, encoding=encoding)
        page.encode(encoding)  # prints: nothing in it the stream cannot write
        lines = ANSI.sub("", page).splitlines()
        assert "> fresh  " + "#" * 22 + "..  0.900" in lines, lines
        assert "  ?      " + "##" + "." * 22 + "  0.100" in lines, lines
        assert "-- normxlogit --" in lines and "-- importance --" in lines
    plain = to_terminal(exp, color=False, encoding=encoding).splitlines()
    cafe = "café" if encoding == "latin-1" else "caf?"
    assert f"??[-0.500] {cafe}[+0.250] great[+1.000]" in plain, plain
    # Where the stream writes them, the drawing characters are the Unicode ones.
    unicode_page = to_terminal(exp, ["scores", "importance"], color=False, encoding="utf-8")
    assert "▶ fresh  " + "█" * 22 + "░░  0.900" in unicode_page.splitlines()
    assert "── importance ──" in unicode_page.splitlines()
    assert "电影[-0.500] café[+0.250] great[+1.000]" in unicode_page.splitlines()


def test_the_default_encoding_is_standard_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``print(exp.to_terminal())`` on an ASCII standard output prints (the SDK's own users)."""
    import io

    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr("sys.stdout", ascii_out)
    page = _glyph_explanation().to_terminal(color=False)
    print(page)  # no UnicodeEncodeError
    assert "> fresh" in page and "#" in page and "█" not in page


def test_term_dumb_gets_no_colour_unless_it_is_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A terminal that says it takes no escape codes (``TERM=dumb``: Emacs' shell) got
    truecolor escapes all the same."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("TERM", "dumb")
    exp = wordpiece_explanation()
    assert "\x1b[" not in exp.to_terminal()
    assert "un[+0.500]believ[-0.250]ably[+0.100] good[+1.000]" in exp.to_terminal()
    assert "\x1b[48;2;" in exp.to_terminal(color=True)
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert "\x1b[48;2;" in exp.to_terminal()
    monkeypatch.delenv("FORCE_COLOR")
    monkeypatch.setenv("TERM", "xterm-256color")
    assert "\x1b[48;2;" in exp.to_terminal()
