"""Token text helpers shared by the result types and the renderers (no other SDK imports)."""

from __future__ import annotations

import unicodedata

__all__ = ["TARGET_SCORES", "apart", "splits_at", "strip_piece_marker", "word_boundary"]

#: The name under which ``Explanation.scores`` is addressed in ``score_array`` and the renderers.
TARGET_SCORES = "scores"

#: CJK ideographs, which BERT's basic pre-tokenizer makes one word each (its ``_is_chinese_char``
#: ranges: the CJK Unified Ideographs and their extensions, and the compatibility ideographs;
#: not Hiragana, Katakana or Hangul, whose words are runs of letters as in other scripts).
_CJK_IDEOGRAPHS = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


def strip_piece_marker(text: str) -> str:
    """A token string without its tokenizer marker (WordPiece ``##``, BPE ``Ġ``/``Ċ``,
    SentencePiece ``▁``)."""
    for marker in ("##", "Ġ", "▁", "Ċ"):
        if text.startswith(marker):
            return text[len(marker) :]
    return text


def apart(char: str, punctuation: bool = True) -> bool:
    """Whether BERT's basic pre-tokenizer makes ``char`` a word of its own: a CJK ideograph,
    or (``punctuation``) a punctuation character — Unicode's P* categories and every ASCII
    symbol (``$``, ``+``, ``^``, ``~``, ...), as BERT's ``_is_punctuation`` has it."""
    code = ord(char)
    if any(low <= code <= high for low, high in _CJK_IDEOGRAPHS):
        return True
    if not punctuation:
        return False
    if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def word_boundary(before: str, after: str, punctuation: bool = True) -> bool:
    """Whether two touching pieces, the first ending in character ``before`` and the next
    starting with ``after``, belong to different words as BERT's basic pre-tokenizer defines
    words: whitespace between them, or either character one that stands apart (``apart``).
    An empty side (unknown) is a boundary."""
    if not before or not after:
        return True
    return any(c.isspace() or apart(c, punctuation) for c in (before, after))


#: Apostrophes that stay inside a word between letters ("don't", "it’s"), for legibility: BERT
#: splits them off, but a heat-map of "don", "'", "t" reads worse than one of "don't".
_APOSTROPHES = "'\u2019"


def splits_at(source: str, index: int, punctuation: bool = True) -> bool:
    """Whether a word ends between ``source[index - 1]`` and ``source[index]``: by
    :func:`word_boundary`, except at an apostrophe between two letters."""
    before, after = source[index - 1], source[index]
    if punctuation and (after in _APOSTROPHES or before in _APOSTROPHES):
        left = index - 1 if after in _APOSTROPHES else index - 2
        right = index + 1 if after in _APOSTROPHES else index
        if left >= 0 and right < len(source) and source[left].isalpha() and source[right].isalpha():
            return False
    return word_boundary(before, after, punctuation)
