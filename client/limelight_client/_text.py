"""Token text helpers shared by the result types and the renderers (no other SDK imports)."""

from __future__ import annotations

__all__ = ["TARGET_SCORES", "strip_piece_marker"]

#: The name under which ``Explanation.scores`` is addressed in ``score_array`` and the renderers.
TARGET_SCORES = "scores"


def strip_piece_marker(text: str) -> str:
    """A token string without its tokenizer marker (WordPiece ``##``, BPE ``Ġ``/``Ċ``,
    SentencePiece ``▁``)."""
    for marker in ("##", "Ġ", "▁", "Ċ"):
        if text.startswith(marker):
            return text[len(marker) :]
    return text
