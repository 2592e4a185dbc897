"""The classifier's own context-free lexicon: an evaluation reference, and an inline method.

Every vocabulary entry gets the change in each class's log-odds when the text is that one token
alone, against the empty text (``[CLS] v [SEP]`` against ``[CLS] [SEP]`` for BERT; whatever the
tokenizer's special tokens are around a single sequence). A token of a text then scores its
entry: a lookup that reads no context, so a method's lead over it is what context adds. On the
demo models it ranks well above NormXLogit (docs/distillation-lab.md, "A context-free lexicon").

The table is one batched pass over the vocabulary (about 15 s for MiniLM on two CPU cores).
``limelight lexicon`` saves it beside the model (``limelight.models.lexicon_table``; the sidecar
builds it into its cache directory at start-up with ``LIMELIGHT_LEXICON_BUILD``), where the
serving runtime looks tokens up in it and the inline method ``lexicon_lookup`` reads the rows:
what ``auto`` serves on a model without a distilled head. The ``lexicon`` job reads the saved
table, or builds one on first use and keeps it per model version for the life of the worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from limelight.core.types import Encoded, FloatArray
from limelight.locks import file_lock
from limelight.methods.base import ExtraOutputMethod, JobContext, JobMethod, MethodOutput, Param
from limelight.methods.search import batched_logits, class_values
from limelight.models.lexicon_table import (
    OUTPUT_NAME,
    LexiconCard,
    find_lexicon_dir,
    lexicon_unavailable_reason,
    load_lexicon,
    save_lexicon,
)

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel
    from limelight.settings import Settings


class _Table:
    """The logits of every one-token text [V, C] and of the empty text [C] (``None`` when the
    tokenizer adds no special tokens: the vocabulary's mean stands in for it)."""

    def __init__(self, single: torch.Tensor, empty: torch.Tensor | None) -> None:
        self.single = single
        self.empty = empty

    @property
    def reference(self) -> str:
        return "empty text" if self.empty is not None else "vocabulary mean"

    def column(self, target: int, multi_label: bool) -> torch.Tensor:
        """[V] every entry's change in ``target``'s value against the reference."""
        values = class_values(self.single, target, multi_label)
        if self.empty is not None:
            return values - class_values(self.empty[None], target, multi_label)[0]
        return values - values.mean()

    def matrix(self, multi_label: bool, special_ids: list[int]) -> FloatArray:
        """[V, C] every class's column (one for a regression head); special tokens' rows 0."""
        classes = self.single.shape[1]
        table = torch.stack([self.column(c, multi_label) for c in range(classes)], dim=1)
        table[[i for i in special_ids if 0 <= i < table.shape[0]]] = 0.0
        return np.asarray(table.numpy(), dtype=np.float32)


class Lexicon(JobMethod):
    name = "lexicon"
    description = (
        "Context-free reference: each token scores the change in the target's log-odds when the "
        "text is that token alone (one pass over the vocabulary, cached per model)."
    )
    params: ClassVar[Mapping[str, Param]] = {
        "batch_size": Param(int, 512, minimum=1, maximum=4096, help="vocabulary rows per forward"),
    }

    def __init__(self) -> None:
        self._tables: dict[str, FloatArray] = {}
        self._lock = threading.Lock()

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        table = self._table(ctx, int(params["batch_size"]))
        scores = table[encoded.input_ids, target].copy()
        scores[encoded.special_mask] = 0.0
        ctx.checkpoint(1.0, "done")
        return MethodOutput(
            scores=scores, details={"value": "log-odds of the target class, token alone"}
        )

    def _table(self, ctx: JobContext, batch_size: int) -> FloatArray:
        # The table saved beside the model, else one build per model version, even when several
        # jobs ask at once.
        with self._lock:
            table = self._tables.get(ctx.model.version)
            if table is None:
                saved = load_lexicon(ctx.model, ctx.settings.cache_dir)
                table = saved if saved is not None else lexicon_matrix(ctx, batch_size)
                self._tables[ctx.model.version] = table
            return table


class LexiconLookup(ExtraOutputMethod):
    name = "lexicon_lookup"
    description = (
        "The lexicon table built by `limelight lexicon`, looked up on the serving pass: each "
        "token's change in each class's log-odds alone; `auto` serves it without a distilled head."
    )
    output = OUTPUT_NAME
    needs = "the lexicon table"
    cache_dir: Path | None = None

    def configure(self, settings: Settings) -> None:
        """Look for the table in the cache directory too (built there at start-up)."""
        self.cache_dir = settings.cache_dir

    def check_model(self, model: LoadedModel) -> str:
        return lexicon_unavailable_reason(model, self.cache_dir)


def vocabulary_size(model: LoadedModel) -> int:
    """The ids the model embeds (added tokens included)."""
    return int(model.model.get_input_embeddings().num_embeddings)


def one_token_template(model: LoadedModel) -> tuple[list[int], int]:
    """The ids of a one-token text and where its token sits: the tokenizer's own special
    tokens around a single sequence, read off a tokenised one-letter text."""
    encoded = model.tokenizer("a", return_special_tokens_mask=True)
    ids, special = list(encoded["input_ids"]), list(encoded["special_tokens_mask"])
    slots = [i for i, flag in enumerate(special) if not flag]
    if not slots:
        raise ValueError("the tokenizer returned no token for a one-letter text")
    # A tokenizer that splits the letter further keeps its first piece only.
    template = [t for i, t in enumerate(ids) if special[i] or i == slots[0]]
    return template, slots[0]


def build_table(ctx: JobContext, batch_size: int) -> _Table:
    model = ctx.model
    template, slot = one_token_template(model)
    size = vocabulary_size(model)
    # Rows are short, but a large model's rows still count against the job memory budget.
    batch_size = min(batch_size, ctx.rows_per_pass(len(template), backward=False))
    chunks = []
    for start in range(0, size, batch_size):
        ctx.checkpoint(start / size, f"lexicon: {start:,} of {size:,} vocabulary entries")
        rows = [
            [*template[:slot], v, *template[slot + 1 :]]
            for v in range(start, min(size, start + batch_size))
        ]
        chunks.append(batched_logits(model, rows, None, batch_size))
    empty = list(model.tokenizer("")["input_ids"])
    return _Table(torch.cat(chunks), batched_logits(model, [empty], None)[0] if empty else None)


def lexicon_matrix(ctx: JobContext, batch_size: int) -> FloatArray:
    """The lexicon table of ``ctx.model``: [V, C], special tokens' rows 0."""
    table = build_table(ctx, batch_size)
    return table.matrix(ctx.model.is_multi_label, list(ctx.model.tokenizer.all_special_ids))


def write_lexicon(ctx: JobContext, out: Path, batch_size: int = 512) -> LexiconCard:
    """Build the lexicon table of ``ctx.model`` and save it with its card in ``out``."""
    began = time.perf_counter()
    table = build_table(ctx, batch_size)
    matrix = table.matrix(ctx.model.is_multi_label, list(ctx.model.tokenizer.all_special_ids))
    card = LexiconCard(
        model_version=ctx.model.version,
        vocabulary=int(matrix.shape[0]),
        num_labels=int(matrix.shape[1]),
        reference=table.reference,
        seconds=round(time.perf_counter() - began, 1),
    )
    save_lexicon(matrix, card, out)
    return card


def ensure_lexicon(
    ctx: JobContext, out: Path, cache_dir: Path | None = None, batch_size: int = 512
) -> LexiconCard | None:
    """Build the table of ``ctx.model`` into ``out`` unless one is found (beside the model, or
    in ``cache_dir``); under a file lock, so that processes starting together build it once
    and the others then find it. The new table's card, or None when one was found."""
    if find_lexicon_dir(ctx.model, cache_dir) is not None:
        return None
    with file_lock(out.parent / f".{out.name}.lock"):
        if find_lexicon_dir(ctx.model, cache_dir) is not None:  # built while we waited
            return None
        return write_lexicon(ctx, out, batch_size)
