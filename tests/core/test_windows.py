"""``WindowLayout`` against a direct reference: every token of the text once, in text order,
with the mean of the rows of every window that saw it; the leading special tokens of the first
window and the trailing ones of the last. Pieces that share one span (a tokenizer that cuts a
Hangul syllable into its jamo) stay apart, a window beginning inside such a run included."""

from __future__ import annotations

import numpy as np
import pytest

from limelight.core.types import Encoded, TokenColumns, TokenInfo
from limelight.core.windows import WindowLayout


def document(rng: np.random.Generator, n: int) -> list[TokenInfo]:
    """``n`` word pieces with increasing character spans (some touching; about one in four
    sharing the span of the piece before it, with an id of its own)."""
    tokens: list[TokenInfo] = []
    at = 0
    for i in range(n):
        if tokens and rng.random() < 0.25:
            last = tokens[-1]
            tokens.append(TokenInfo(f"w{i}", 1000 + i, last.start, last.end, False))
            continue
        at += int(rng.integers(0, 3))
        width = int(rng.integers(1, 6))
        tokens.append(TokenInfo(f"w{i}", 1000 + i, at, at + width, False))
        at += width
    return tokens


def windows_of(body: list[TokenInfo], size: int, stride: int, columns: bool) -> list[Encoded]:
    """Windows of ``size`` pieces sharing ``stride``, each between [CLS] and [SEP]."""
    out, begin = [], 0
    while True:
        part = body[begin : begin + size]
        tokens = [TokenInfo("[CLS]", 101, 0, 0, True), *part, TokenInfo("[SEP]", 102, 0, 0, True)]
        seq = TokenColumns.of(tokens) if columns else tokens
        out.append(Encoded([t.id for t in tokens], None, seq, False))
        if begin + size >= len(body):
            return out
        begin += size - stride


def reference(
    windows: list[Encoded], arrays: list[np.ndarray]
) -> tuple[list[TokenInfo], np.ndarray]:
    """The stitched tokens and rows, one Python step per token (float64 means); a token is
    known by its id (each piece of ``document`` has its own, in text order)."""
    rows: dict[int, list[np.ndarray]] = {}
    names: dict[int, TokenInfo] = {}
    for window, array in zip(windows, arrays, strict=True):
        for row, token in enumerate(window.tokens):
            if not token.special:
                key = token.id
                rows.setdefault(key, []).append(np.asarray(array[row], dtype=np.float64))
                names.setdefault(key, token)
    first, last = list(windows[0].tokens), list(windows[-1].tokens)
    lead = [i for i, t in enumerate(first) if t.special and all(u.special for u in first[: i + 1])]
    trail = [i for i, t in enumerate(last) if t.special and all(u.special for u in last[i:])]
    which = {id(w): k for k, w in enumerate(windows)}
    first_array, last_array = arrays[which[id(windows[0])]], arrays[which[id(windows[-1])]]
    keys = sorted(rows)
    tokens = [first[i] for i in lead] + [names[k] for k in keys] + [last[i] for i in trail]
    stitched = (
        [np.asarray(first_array[i], dtype=np.float64) for i in lead]
        + [np.mean(rows[k], axis=0) for k in keys]
        + [np.asarray(last_array[i], dtype=np.float64) for i in trail]
    )
    return tokens, np.stack(stitched)


@pytest.mark.parametrize("seed", range(12))
def test_the_layout_matches_a_direct_stitch(seed: int) -> None:
    rng = np.random.default_rng(seed)
    body = document(rng, int(rng.integers(1, 400)))
    size = int(rng.integers(2, 64))
    stride = int(rng.integers(0, size // 2 + 1))
    windows = windows_of(body, size, stride, columns=bool(seed % 2))
    if seed % 3 == 0:
        windows.reverse()  # left truncation: the tokenizer returns the last window first
    layout = WindowLayout.of(windows)
    for shape in [(), (3,)]:
        arrays = [rng.standard_normal((len(w.tokens), *shape)).astype(np.float32) for w in windows]
        want_tokens, want = reference(windows, arrays)
        got = layout.stitch(arrays)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert list(layout.tokens) == want_tokens
    assert [t.text for t in layout.tokens[1:-1]] == [t.text for t in body]  # every piece once
    assert layout.tokens[0].special and layout.tokens[-1].special


def test_one_window_is_its_own_layout() -> None:
    body = document(np.random.default_rng(0), 10)
    (window,) = windows_of(body, 50, 0, columns=True)
    layout = WindowLayout.of([window])
    assert list(layout.tokens) == list(window.tokens)
    array = np.arange(len(body) + 2, dtype=np.float32)
    np.testing.assert_array_equal(layout.stitch([array]), array)
