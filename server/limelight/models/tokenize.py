"""Tokenising with offsets through private, fixed copies of the fast tokenizer's backend.

The Hugging Face wrapper (``tokenizer(text, truncation=..., max_length=..., stride=...)``)
reconfigures its one Rust backend on every call and then encodes with it. Two threads doing so
at once — the request path's tokenizer thread, a job worker, the windows of a long document —
can each encode with the other's settings (a document meant to be cut into 512-token windows
comes back as one window of 3,000 tokens, and the forward pass fails) or fail with "Already
borrowed". So everything the server tokenises goes through backends configured once, here, and
only read afterwards, which threads may do at the same time. Calling the backend directly also
skips the wrapper's conversion of every field to Python lists.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from limelight.core.types import Encoded, TokenColumns
from limelight.errors import InvalidArgument

_BACKENDS: weakref.WeakKeyDictionary[Any, dict[tuple[int | None, int], Any]] = (
    weakref.WeakKeyDictionary()
)
_BACKENDS_LOCK = threading.Lock()


def backend(tokenizer: Any, limit: int | None, stride: int = 0) -> Any:
    """``tokenizer``'s backend (a ``tokenizers.Tokenizer``) set up as the wrapper's
    ``tokenizer(..., truncation=limit is not None, max_length=limit, stride=stride)`` sets up
    its own: cut at ``limit`` tokens, special tokens included (the rest in
    ``Encoding.overflowing``, each piece overlapping the one before by ``stride`` tokens), or
    never cut when ``limit`` is None; no padding. One copy per setting, made on first use."""
    key = (limit, stride)
    with _BACKENDS_LOCK:
        per_setting = _BACKENDS.setdefault(tokenizer, {})
        found = per_setting.get(key)
        if found is None:
            from tokenizers import Tokenizer

            found = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
            found.no_padding()
            if limit is None:
                found.no_truncation()
            else:
                found.enable_truncation(
                    max_length=limit,
                    stride=stride,
                    strategy="longest_first",
                    direction=tokenizer.truncation_side,
                )
            found.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
            per_setting[key] = found
        return found


def check_has_tokens(encoding: Any) -> None:
    """Refuse an input the tokenizer kept nothing of but its special tokens: a text of
    zero-width or control characters passes "text is empty" (``str.strip`` keeps them), and
    its explanation would explain nothing. ``encoding``: a backend's ``Encoding`` or an
    ``Encoded``."""
    special = getattr(encoding, "special_tokens_mask", None)
    if special is None:
        special = TokenColumns.of(encoding.tokens).special
    if all(special):  # stops at the first content token
        raise InvalidArgument(
            "text is empty to the model: the tokenizer keeps none of its characters "
            "(zero-width, control or other invisible characters only)"
        )


def to_encoded(encoding: Any, paired: bool, with_types: bool, truncated: bool) -> Encoded:
    """An ``Encoded`` from a backend's ``Encoding``: its lists kept as they are, in columns.
    ``paired``: the input had a ``text_pair`` (segments from the encoding's sequence ids);
    ``with_types``: the model reads token type ids."""
    ids = encoding.ids
    segments = [s or 0 for s in encoding.sequence_ids] if paired else [0] * len(ids)
    tokens = TokenColumns(
        encoding.tokens, ids, encoding.offsets, encoding.special_tokens_mask, segments
    )
    return Encoded(ids, encoding.type_ids if with_types else None, tokens, truncated)
