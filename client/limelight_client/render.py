"""Renderers for explanations: a terminal heat-map and a self-contained HTML page.

Both draw over the *original* text using the tokens' character offsets, so word pieces of one
word sit next to each other without tokenizer markers (``##``, ``Ġ``, ``▁``) and the text's own
spacing is kept. When the text is not known (e.g. a job result fetched by id), the tokens are
laid out by their offsets with those markers removed.

Colours are diverging and normalised per score array by its largest magnitude: red for evidence
*for* the explained class (positive scores), blue for evidence against (negative), white at 0.
"""

from __future__ import annotations

import html
import math
import os
import sys
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from limelight_client._text import strip_piece_marker

if TYPE_CHECKING:
    from limelight_client.types import Explanation, Token

__all__ = [
    "color_for",
    "displayable",
    "encodable",
    "format_score",
    "layout",
    "output_encoding",
    "terminal_safe",
    "to_html",
    "to_terminal",
    "token_text",
]

_WHITE = (255, 255, 255)
_RED = (214, 39, 40)
_BLUE = (31, 119, 180)
_BAR_WIDTH = 24
_TOP_K = 10


@dataclass(frozen=True)
class Span:
    """A run of display text; ``token`` indexes ``Explanation.tokens`` (None: plain text)."""

    text: str
    token: int | None


def color_for(score: float, scale: float) -> tuple[int, int, int]:
    """Diverging RGB colour for ``score`` on a scale where ``±scale`` is full intensity."""
    if not math.isfinite(score) or scale <= 0 or not math.isfinite(scale):
        return _WHITE
    t = min(abs(score) / scale, 1.0)
    target = _RED if score > 0 else _BLUE
    r, g, b = (round(w + t * (c - w)) for w, c in zip(_WHITE, target, strict=True))
    return (r, g, b)


def _text_color(score: float, scale: float) -> tuple[int, int, int]:
    # Dark text on light backgrounds, light text once the background is saturated.
    strong = scale > 0 and math.isfinite(score) and abs(score) / scale > 0.6
    return (255, 255, 255) if strong else (0, 0, 0)


def _scale(values: Sequence[float], tokens: Sequence[Token]) -> float:
    mags = [
        abs(v) for v, t in zip(values, tokens, strict=False) if not t.special and math.isfinite(v)
    ]
    return max(mags, default=0.0)


def contrast_centre(values: Sequence[float], tokens: Sequence[Token]) -> float:
    """The score that colours as white: 0, unless every token's score has one sign and they
    are close in size (NormXLogit often is: every token positive). Then the median, so that
    colour shows which tokens matter more or less than a typical token instead of painting the
    whole text one shade."""
    vals = sorted(
        v for v, t in zip(values, tokens, strict=False) if not t.special and math.isfinite(v)
    )
    if len(vals) < 3 or (vals[0] < 0 < vals[-1]):
        return 0.0
    top = max(abs(vals[0]), abs(vals[-1]))
    if top == 0 or (vals[-1] - vals[0]) > 0.5 * top:
        return 0.0
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def format_score(value: float, scale: float) -> str:
    """A score as the heat-maps write it: signed, three decimals, or two significant digits in
    exponent form when the map's largest magnitude ``scale`` is under 0.001 or from 10,000 on
    (where three decimals would read 0.000, or run long)."""
    if not math.isfinite(value):
        return str(value)
    if scale != 0 and (scale < 1e-3 or scale >= 1e4):
        return f"{value:+.2e}"
    return f"{value:+.3f}"


_fmt = format_score


def _flat(score: float, values: Sequence[float], tokens: Sequence[Token]) -> str:
    """The legend of a map whose tokens all score the same (SLALOM's importance of a one-word
    text is 0): no colour scale, only that. Scores that are not numbers (nan, inf: a method
    that broke down on this text) are not a score of 0 and are said apart."""
    finite = sum(
        1 for v, t in zip(values, tokens, strict=False) if not t.special and math.isfinite(v)
    )
    if not finite:
        return "no token has a finite score (nan or inf): this map shows nothing"
    return f"every token scores {_fmt(score, 0)}: none stands out"


def _not_finite_note(values: Sequence[float], tokens: Sequence[Token]) -> str | None:
    """A line for a map where some tokens score nan or inf: they are drawn white, which
    would otherwise read as a score of 0."""
    bad = sum(
        1 for v, t in zip(values, tokens, strict=False) if not t.special and not math.isfinite(v)
    )
    shown = sum(1 for t in tokens[: len(values)] if not t.special)
    if not bad or bad == shown:
        return None
    return f"{bad} of {shown} tokens have no finite score (nan or inf) and are drawn white"


def _segment_source(exp: Explanation, segment: int) -> str | None:
    return exp.text if segment == 0 else exp.text_pair


def segments(exp: Explanation) -> list[int]:
    """The segments present: ``[0]`` or ``[0, 1]`` for text pairs."""
    present = {t.segment for t in exp.tokens if not t.special}
    if exp.text_pair is not None:
        present.add(1)
    present.add(0)
    return sorted(present)


def layout(exp: Explanation, segment: int = 0) -> list[Span]:
    """Split one segment into display spans, each either plain text or one token."""
    indexed = [(i, t) for i, t in enumerate(exp.tokens) if not t.special and t.segment == segment]
    indexed.sort(key=lambda it: (it[1].start, it[1].end))
    source = _segment_source(exp, segment)
    usable = source is not None and all(0 <= t.start <= t.end <= len(source) for _, t in indexed)
    if source is not None and usable:
        return _layout_offsets(source, indexed)
    return _layout_tokens(indexed)


def _with_marks(source: str, end: int) -> int:
    """``end`` moved past the combining marks that follow it: a tokenizer that strips accents
    ends "cafe\u0301" at the "e", and the accent left behind would sit on the score's bracket."""
    while end < len(source) and unicodedata.combining(source[end]):
        end += 1
    return end


def _layout_offsets(source: str, indexed: list[tuple[int, Token]]) -> list[Span]:
    spans: list[Span] = []
    pos = 0
    for i, tok in indexed:
        start = max(tok.start, pos)  # some tokenizers report overlapping spans
        if tok.end <= start:
            continue
        if start > pos:
            spans.append(Span(source[pos:start], None))
        end = _with_marks(source, tok.end)
        spans.append(Span(source[start:end], i))
        pos = end
    if pos < len(source):
        spans.append(Span(source[pos:], None))
    return spans


def _layout_tokens(indexed: list[tuple[int, Token]]) -> list[Span]:
    # No text: rebuild it from the tokens; a gap in the offsets (or a word-start marker when
    # offsets are missing) becomes a space, so word pieces still join into words.
    have_offsets = any(t.end > t.start for _, t in indexed)
    spans: list[Span] = []
    prev_end: int | None = None
    for i, tok in indexed:
        if prev_end is not None:
            gap = tok.start > prev_end if have_offsets else not tok.text.startswith("##")
            if gap:
                spans.append(Span(" ", None))
        spans.append(Span(strip_piece_marker(tok.text), i))
        prev_end = tok.end
    return spans


def _token_display(exp: Explanation, index: int) -> str:
    return token_text(exp, exp.tokens[index])


def token_text(exp: Explanation, tok: Token) -> str:
    """What a token covers in the input as the user wrote it ("I", an emoji), where the
    tokenizer's own string may differ ("i", "[UNK]", "##ing"); for display."""
    source = _segment_source(exp, tok.segment)
    if source is not None and 0 <= tok.start < tok.end <= len(source):
        return source[tok.start : _with_marks(source, tok.end)]
    return strip_piece_marker(tok.text)


def _explained_class(exp: Explanation, scores: str) -> str | None:
    """The class a score array argues for (None for arrays like SLALOM importance)."""
    if scores == "scores":
        return exp.target_label or str(exp.target_index)
    if scores not in exp.extra_scores and scores in exp.labels:
        return scores
    return None


def _resolve(exp: Explanation, scores: str | Sequence[str] | None) -> list[str]:
    if scores is None:
        return ["scores"]
    if isinstance(scores, str):
        return [scores]
    names = list(scores)
    if not names:
        raise ValueError("scores must name at least one score array")
    return names


# ---------------------------------------------------------------------------------- terminal


def _color_enabled(color: bool | None) -> bool:
    if color is not None:
        return color
    # As the CLI reads them: FORCE_COLOR (force-color.org) wins over NO_COLOR (no-color.org),
    # each counting when set and not empty; TERM=dumb (a terminal that takes no escape codes,
    # as Emacs' shell) means none unless forced.
    if os.environ.get("FORCE_COLOR"):
        return True
    return not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


@dataclass(frozen=True)
class _Glyphs:
    """The drawing characters of a heat-map: the predicted label's mark, a probability bar's
    filled and empty cells, and the rule around a map's title."""

    mark: str
    filled: str
    empty: str
    rule: str


_UNICODE_GLYPHS = _Glyphs(mark="▶", filled="█", empty="░", rule="──")
#: For a stream that cannot encode those (``PYTHONIOENCODING=ascii``, a Latin-1 terminal).
_ASCII_GLYPHS = _Glyphs(mark=">", filled="#", empty=".", rule="--")


def output_encoding(stream: object = None) -> str:
    """The encoding text written to ``stream`` (default: standard output) ends up in; UTF-8
    for a stream that names none (a ``StringIO``, no standard output at all)."""
    stream = sys.stdout if stream is None else stream
    encoding = getattr(stream, "encoding", None)
    return encoding if isinstance(encoding, str) and encoding else "utf-8"


def encodable(text: str, encoding: str) -> bool:
    """Whether ``text`` can be written in ``encoding`` as it is (an unknown encoding: no)."""
    try:
        text.encode(encoding)
    except (UnicodeError, LookupError):
        return False
    return True


def displayable(text: str, encoding: str) -> str:
    """``text`` with every character ``encoding`` cannot write as that codec's replacement
    (``?``), so that printing it cannot fail; an unknown encoding leaves it as it is."""
    try:
        text.encode(encoding)
    except LookupError:
        return text
    except UnicodeError:
        return text.encode(encoding, "replace").decode(encoding, "replace")
    return text


def _glyphs(encoding: str) -> _Glyphs:
    """The Unicode drawing characters where ``encoding`` writes them all, else ASCII ones."""
    drawn = _UNICODE_GLYPHS
    probe = drawn.mark + drawn.filled + drawn.empty + drawn.rule
    return drawn if encodable(probe, encoding) else _ASCII_GLYPHS


def _truncation(exp: Explanation) -> str:
    """What a truncated answer explained: the share of the text its tokens reach (the SDK
    has the text; a token's ``end`` is its character offset in it)."""
    said = "the input was truncated to the model's token limit"
    reached = max((t.end for t in exp.tokens if not t.special and t.segment == 0), default=0)
    if exp.text and 0 < reached < len(exp.text):
        said += f": the first {reached:,} of {len(exp.text):,} characters were explained"
    return said


#: Characters user text must not bring to a terminal: C0 controls but tab and line feed, DEL,
#: C1 controls (U+009B is a CSI on its own) and the bidirectional overrides and isolates, which
#: reorder what follows them on the line.
_UNSAFE = {
    c: "\ufffd"
    for c in [
        *range(0x00, 0x20),
        *range(0x7F, 0xA0),
        *range(0x202A, 0x202F),
        *range(0x2066, 0x206A),
    ]
    if chr(c) not in "\n\t"
}


def columns(text: str) -> int:
    """The terminal columns ``text`` takes: two for a wide or full-width character (CJK), none
    for a combining mark, one for the rest."""
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in text
    )


def pad(text: str, width: int) -> str:
    """``text`` padded with spaces to ``width`` terminal columns (``str.ljust`` counts
    characters, which puts the bars after a Chinese label two columns out per character)."""
    return text + " " * max(0, width - columns(text))


def terminal_safe(text: str) -> str:
    """``text`` with nothing a terminal would act on: control characters (escape sequences),
    C1 controls and bidirectional overrides become U+FFFD; a carriage return ends a line as
    a line feed does (Windows and old Mac line ends)."""
    return text.replace("\r\n", "\n").replace("\r", "\n").translate(_UNSAFE)


def _ansi(text: str, bg: tuple[int, int, int], fg: tuple[int, int, int]) -> str:
    start = f"\x1b[48;2;{bg[0]};{bg[1]};{bg[2]}m\x1b[38;2;{fg[0]};{fg[1]};{fg[2]}m"
    # Colour each line separately so the background never bleeds across a line break.
    return "\n".join(f"{start}{part}\x1b[0m" if part else "" for part in text.split("\n"))


def _bar(fraction: float, glyphs: _Glyphs = _UNICODE_GLYPHS) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * _BAR_WIDTH)
    return glyphs.filled * filled + glyphs.empty * (_BAR_WIDTH - filled)


def to_terminal(
    exp: Explanation,
    scores: str | Sequence[str] = "scores",
    color: bool | None = None,
    encoding: str | None = None,
) -> str:
    """Render ``exp`` as a heat-map for a terminal.

    With colour: ANSI truecolor backgrounds per token. Without (``NO_COLOR`` or
    ``TERM=dumb`` set and ``FORCE_COLOR`` not, or ``color=False``): plain text with each
    token's score in brackets after it. Several score arrays (e.g. ``["scores",
    "importance"]`` for SLALOM) give one map each under one header.

    ``encoding`` is that of the stream the map is for (default: standard output's): where it
    cannot write the drawing characters (``▶ █ ░ ─``) the map uses ASCII ones (``> # . -``),
    and characters of the text, the labels or the model's name it cannot write are shown as
    ``?``, so the map always prints.
    """
    exp = exp.by_characters()  # pieces of one character cannot be shown apart
    use_color = _color_enabled(color)
    encoding = encoding or output_encoding()
    glyphs = _glyphs(encoding)

    def safe(text: str) -> str:
        return displayable(terminal_safe(text), encoding)

    names = _resolve(exp, scores)
    scores = names[0]
    lines: list[str] = []

    if exp.multi_label:
        chosen = ", ".join(safe(name) for name in exp.predicted_labels)
        head = f"{{{chosen}}}" if chosen else "no label over its threshold"
    else:
        head = f"{safe(exp.label)} (class {exp.label_index})"
    explained = exp.explained() if scores == "scores" else [exp]
    target = ", ".join(safe(e.target_label or str(e.target_index)) for e in explained)
    model = safe(exp.model_name + (f"@{exp.model_version}" if exp.model_version else ""))
    method = safe(exp.method or "?")
    lines.append(f"prediction: {head}   explaining: {target}   method: {method}")
    if model:
        lines.append(f"model: {model}")
    if exp.truncated:
        lines.append(f"note: {_truncation(exp)}")
    if exp.windows > 1:
        lines.append(f"note: explained in {exp.windows} overlapping windows, stitched together")
    width = max((columns(safe(name)) for name in exp.probabilities), default=0)
    predicted = set(exp.predicted_labels) if exp.multi_label else {exp.label}
    for name, p in exp.probabilities.items():
        mark = glyphs.mark if name in predicted else " "
        limit = exp.thresholds.get(name) if exp.multi_label else None
        note = f"  (threshold {limit:.2f})" if limit is not None else ""
        lines.append(f"{mark} {pad(safe(name), width)}  {_bar(p, glyphs)}  {p:.3f}{note}")
    lines.append("")
    if len(names) > 1:  # one map per named array, each under its name
        for index, name in enumerate(names):
            if index:
                lines.append("")
            lines.append(f"{glyphs.rule} {safe(_array_title(exp, name))} {glyphs.rule}")
            lines.extend(_terminal_map(exp, name, use_color, safe))
        return "\n".join(lines)
    for index, one in enumerate(explained):
        if len(explained) > 1:
            if index:
                lines.append("")
            lines.append(
                f"{glyphs.rule} explaining {safe(one.target_label or str(one.target_index))} "
                f"{glyphs.rule}"
            )
        lines.extend(_terminal_map(one, scores, use_color, safe))
    return "\n".join(lines)


def _array_title(exp: Explanation, name: str) -> str:
    """What a score array is called under its map: the method's primary array by its own name
    when the method gives one (SLALOM: ``linearized``)."""
    if name != "scores":
        return name
    primary = exp.details.get("primary_score") if isinstance(exp.details, dict) else None
    return str(primary or exp.method or "scores")


def _terminal_map(
    exp: Explanation, scores: str, use_color: bool, safe: Callable[[str], str] = terminal_safe
) -> list[str]:
    """The heat-map of one score array and its legend; ``safe`` makes user text printable."""
    values = exp.score_array(scores)
    centre = contrast_centre(values, exp.tokens)
    shown = [v - centre for v in values]  # colours; the numbers printed stay the raw scores
    scale = _scale(shown, exp.tokens)
    lines: list[str] = []
    for segment in segments(exp):
        parts: list[str] = []
        for span in layout(exp, segment):
            text = safe(span.text)
            if span.token is None or span.token >= len(values):
                parts.append(text)
                continue
            value = values[span.token]
            if use_color:
                tone = shown[span.token]
                parts.append(_ansi(text, color_for(tone, scale), _text_color(tone, scale)))
            else:
                parts.append(f"{text}[{_fmt(value, scale)}]")
        prefix = "text pair: " if segment == 1 else ""
        lines.append(prefix + "".join(parts))

    lines.append("")
    name = "" if scores == "scores" else f"{safe(scores)}: "
    explained = _explained_class(exp, scores)
    explained = safe(explained) if explained else None
    if scale == 0:  # a colour bar from -0 to +0 would say nothing
        lines.append(f"{name}{_flat(centre, values, exp.tokens)}")
    elif use_color:
        steps = 5
        neg = "".join(
            _ansi(" ", color_for(-scale * (steps - k) / steps, scale), (0, 0, 0))
            for k in range(steps)
        )
        pos = "".join(
            _ansi(" ", color_for(scale * (k + 1) / steps, scale), (0, 0, 0)) for k in range(steps)
        )
        if centre:
            lines.append(
                f"{name}{_fmt(centre - scale, scale)} {neg}{_fmt(centre, scale)}{pos} "
                f"{_fmt(centre + scale, scale)}   every score has one sign: colours are "
                "centred on the median (red: more than a typical token, blue: less)"
            )
        else:
            lines.append(
                f"{name}{_fmt(-scale, scale)} {neg}0{pos} {_fmt(scale, scale)}   "
                + (
                    f"red supports {explained}, blue speaks against it"
                    if explained
                    else "red: above 0, blue: below 0"
                )
            )
    else:
        # The printed numbers are the raw scores: their own largest magnitude, not the spread
        # around the median the colours would use.
        top = max(
            (
                abs(v)
                for v, t in zip(values, exp.tokens, strict=False)
                if not t.special and math.isfinite(v)
            ),
            default=scale,
        )
        lines.append(
            f"{name}scores in brackets (max |score| {_fmt(top, scale).lstrip('+')})"
            + (f": > 0 supports {explained}, < 0 speaks against it" if explained else "")
        )
    note = _not_finite_note(values, exp.tokens)
    if note:
        lines.append(f"{name}{note}")
    return lines


# -------------------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2rem;color:#222;
max-width:72rem}
h1{font-size:1.4rem;margin:0 0 .3rem}
h2{font-size:1.05rem;margin:.2rem 0 .5rem}
.meta{color:#555;font-size:.9rem;margin:.1rem 0}
.warn{color:#a15c00}
table{border-collapse:collapse;font-size:.9rem}
td,th{padding:.15rem .6rem;text-align:left;border-bottom:1px solid #eee}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.probs .bar{background:#eee;width:14rem;height:.8rem;border-radius:2px}
.probs .fill{background:#555;height:100%;border-radius:2px}
.probs tr.pred td{font-weight:600}
.maps,.tops{display:flex;flex-wrap:wrap;gap:1.5rem;margin-top:1.2rem}
.map{flex:1 1 20rem;border:1px solid #ddd;border-radius:6px;padding:.8rem}
.text{white-space:pre-wrap;line-height:1.9;font-size:1.05rem;margin:.3rem 0}
.seg{color:#777;font-size:.8rem;margin-top:.6rem}
.tok{border-radius:3px;padding:.1rem 0}
.tok:hover{outline:1px solid #333}
.legend{display:flex;align-items:center;gap:.5rem;font-size:.8rem;color:#555}
.legend .grad{width:10rem;height:.7rem;border:1px solid #ccc}
footer{margin-top:1.5rem;color:#777;font-size:.8rem}
"""


#: The root element of an embeddable fragment (``to_html(fragment=True)``, notebooks).
FRAGMENT_CLASS = "limelight-explanation"


def _scoped_css(css: str, root: str) -> str:
    """``css`` with every selector confined to ``.root`` (``body`` becomes the root itself),
    so that a fragment embedded in a notebook or a page does not restyle its host. Plain
    rules only (no ``@media`` or other at-rules, whose braces nest)."""
    rules = []
    for rule in filter(None, (r.strip() for r in css.split("}"))):
        selectors, _, body = rule.partition("{")
        scoped = [
            f".{root}" if sel.strip() == "body" else f".{root} {sel.strip()}"
            for sel in selectors.split(",")
        ]
        rules.append(f"{','.join(scoped)}{{{body.strip()}}}")
    return "\n".join(rules)


def _rgb_css(c: tuple[int, int, int]) -> str:
    return f"rgb({c[0]},{c[1]},{c[2]})"


#: The bidirectional embeddings, overrides and isolates: one in a text would reorder every token
#: after it on the page (an override lasts to the end of its paragraph), as on a terminal.
_BIDI = {c: "\ufffd" for c in [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]}


def _esc(text: str) -> str:
    """``text`` for the page: escaped, and each bidirectional control as U+FFFD (as
    ``terminal_safe`` shows them), so that the heat-map reads in the text's order."""
    return html.escape(text.translate(_BIDI), quote=True)


def _html_map(exp: Explanation, name: str, values: list[float], title: str | None = None) -> str:
    centre = contrast_centre(values, exp.tokens)
    shown = [v - centre for v in values]
    scale = _scale(shown, exp.tokens)
    out = [f'<div class="map"><h2>{_esc(title or name)}</h2>']
    explained = _explained_class(exp, name)
    if scale == 0:
        meaning = _flat(centre, values, exp.tokens)
    elif centre:
        meaning = (
            f"every score has one sign: white is the median {_fmt(centre, scale)}; red tokens "
            "matter more than a typical token, blue less"
        )
    elif explained:
        meaning = f"red supports {explained}, blue speaks against it (scaled to max |score|)"
    else:
        meaning = "red > 0, blue < 0 (scaled to max |score|)"
    grad = f"linear-gradient(to right,{_rgb_css(_BLUE)},#fff,{_rgb_css(_RED)})"
    if scale == 0:  # one value everywhere: a colour bar would promise a range there is not
        out.append(f'<div class="legend"><span>{_esc(meaning)}</span></div>')
    else:
        out.append(
            f'<div class="legend"><span>{_esc(_fmt(centre - scale, scale))}</span>'
            f'<span class="grad" style="background:{grad}"></span>'
            f"<span>{_esc(_fmt(centre + scale, scale))}</span><span>{_esc(meaning)}</span></div>"
        )
    note = _not_finite_note(values, exp.tokens)
    if note:
        out.append(f'<p class="meta warn">{_esc(note)}</p>')
    for segment in segments(exp):
        if segment == 1:
            out.append('<div class="seg">text pair</div>')
        parts: list[str] = []
        for span in layout(exp, segment):
            if span.token is None or span.token >= len(values):
                parts.append(_esc(span.text))
                continue
            value = values[span.token]
            tok = exp.tokens[span.token]
            # A word merged from pieces (Explanation.by_words) has no single id.
            ident = f" (id {tok.id})" if tok.id >= 0 else ""
            tip = f"{tok.text}{ident}: {_fmt(value, scale)}"
            tone = shown[span.token]
            bg, fg = color_for(tone, scale), _text_color(tone, scale)
            parts.append(
                f'<span class="tok" style="background:{_rgb_css(bg)};color:{_rgb_css(fg)}" '
                f'title="{_esc(tip)}" data-score="{value:.6g}">{_esc(span.text)}</span>'
            )
        out.append(f'<p class="text">{"".join(parts)}</p>')
    out.append("</div>")
    return "".join(out)


def _html_top(exp: Explanation, name: str, values: list[float]) -> str:
    scale = _scale(values, exp.tokens)
    ranked = sorted(
        ((i, v) for i, (t, v) in enumerate(zip(exp.tokens, values, strict=False)) if not t.special),
        # As ``Explanation.top(absolute=True)``: NaN last rather than scrambling the order.
        key=lambda iv: (math.isnan(iv[1]), -abs(iv[1])),
    )[:_TOP_K]
    rows = []
    for rank, (i, v) in enumerate(ranked, start=1):
        bg = color_for(v, scale)
        rows.append(
            f'<tr><td class="num">{rank}</td>'
            f'<td><span class="tok" style="background:{_rgb_css(bg)};'
            f'color:{_rgb_css(_text_color(v, scale))}">{_esc(_token_display(exp, i))}</span></td>'
            f'<td class="num">{_esc(_fmt(v, scale))}</td>'
            f'<td class="num">{exp.tokens[i].start}–{exp.tokens[i].end}</td></tr>'
        )
    return (
        f"<div><h2>Top tokens by |{_esc(name)}|</h2><table><tr><th>#</th><th>token</th>"
        f"<th>score</th><th>chars</th></tr>{''.join(rows)}</table></div>"
    )


def to_html(
    exp: Explanation, scores: str | Sequence[str] | None = None, fragment: bool = False
) -> str:
    """A self-contained HTML page: inline CSS only, no scripts, no external assets. With
    ``fragment``, the same content as one ``<div>`` to embed in another page (a notebook's
    output, a dashboard): its style sheet is scoped to that ``<div>``."""
    exp = exp.by_characters()  # pieces of one character cannot be shown apart
    names = _resolve(exp, scores)
    arrays = {name: exp.score_array(name) for name in names}
    # Multi-label: every explained label's map (target scores only), side by side.
    others = exp.label_explanations if scores is None else []
    target = exp.target_label or str(exp.target_index)
    if exp.multi_label:
        shown = ", ".join(exp.predicted_labels) or "no label over its threshold"
        target = ", ".join(e.target_label for e in [exp, *others])
    else:
        shown = exp.label
    title = f"Limelight: {shown}"
    where = "" if others else f" (index {exp.target_index})"
    if fragment:
        head = [
            f'<div class="{FRAGMENT_CLASS}" role="figure" aria-label="{_esc(title)}">',
            # the page's margin is the host's business: a notebook cell has its own
            f"<style>{_scoped_css(_CSS, FRAGMENT_CLASS)}\n.{FRAGMENT_CLASS}{{margin:.5rem 0}}"
            "</style>",
        ]
    else:
        head = [
            '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width,initial-scale=1">',
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
        ]
    out = [
        *head,
        f"<header><h1>Prediction: {_esc(shown)}</h1>",
        f'<p class="meta">explaining {"labels" if others else "class"} <b>{_esc(target)}</b>'
        f"{where} with method <b>{_esc(exp.method or '?')}</b></p>",
    ]
    if exp.model_name or exp.model_version:
        out.append(
            f'<p class="meta">model {_esc(exp.model_name)} version {_esc(exp.model_version)}</p>'
        )
    if exp.parameters:
        params = ", ".join(f"{k}={v}" for k, v in sorted(exp.parameters.items()))
        out.append(f'<p class="meta">parameters: {_esc(params)}</p>')
    if exp.truncated:
        note = _truncation(exp)
        out.append(f'<p class="meta warn">{_esc(note[0].upper() + note[1:])}.</p>')
    if exp.windows > 1:
        # As the terminal says it: the scores of a window's edges saw only part of the text.
        out.append(
            f'<p class="meta">Explained in {exp.windows} overlapping windows, stitched '
            "together.</p>"
        )
    out.append("</header>")

    rows = []
    predicted = set(exp.predicted_labels) if exp.multi_label else {exp.label}
    for name, p in exp.probabilities.items():
        cls = ' class="pred"' if name in predicted else ""
        pct = max(0.0, min(100.0, 100.0 * p))
        limit = exp.thresholds.get(name) if exp.multi_label else None
        note = f'<td class="num">threshold {limit:.2f}</td>' if limit is not None else ""
        rows.append(
            f"<tr{cls}><td>{_esc(name)}</td>"
            f'<td><div class="bar"><div class="fill" style="width:{pct:.1f}%"></div></div></td>'
            f'<td class="num">{p:.3f}</td>{note}</tr>'
        )
    out.append(f'<section class="probs"><table>{"".join(rows)}</table></section>')

    out.append('<section class="maps">')
    if others:
        out.extend(
            _html_map(e, "scores", e.score_array(), title=e.target_label) for e in [exp, *others]
        )
    else:
        out.extend(_html_map(exp, name, values) for name, values in arrays.items())
    out.append('</section><section class="tops">')
    if others:
        out.extend(_html_top(e, e.target_label, e.score_array()) for e in [exp, *others])
    else:
        out.extend(_html_top(exp, name, values) for name, values in arrays.items())
    out.append("</section>")

    t = exp.timings
    footer = [f"request {_esc(exp.request_id)}"] if exp.request_id else []
    if t.total_seconds:
        ms = {k: 1000 * v for k, v in t.to_dict().items() if k.endswith("_seconds")}
        footer.append(
            f"server time {ms['total_seconds']:.1f} ms (tokenise {ms['tokenize_seconds']:.1f},"
            f" forward {ms['forward_seconds']:.1f}, attribute {ms['attribute_seconds']:.1f},"
            f" batch {t.batch_size})"
        )
    out.append(f"<footer>{' · '.join(footer)}</footer>")
    out.append("</div>\n" if fragment else "</body></html>\n")
    return "".join(out)
