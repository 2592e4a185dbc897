"""A runtime that also looks every token up in the model's lexicon table (one gather per batch,
no model call): the rows the inline method ``lexicon_lookup`` reads."""

from __future__ import annotations

import numpy as np

from limelight.core.types import FloatArray
from limelight.models.lexicon_table import OUTPUT_NAME
from limelight.runtimes.base import InlineBatch, InlineOutputs, Runtime


class LexiconRuntime(Runtime):
    """``inner`` (torch or ONNX Runtime) plus ``extra["lexicon"]``: [B, n, C] table rows."""

    def __init__(self, inner: Runtime, table: FloatArray) -> None:
        self.inner = inner
        self.table = np.asarray(table, dtype=np.float32)
        self.name = inner.name

    @property
    def head_names(self) -> frozenset[str]:
        return self.inner.head_names | {OUTPUT_NAME}

    def run_inline(self, batch: InlineBatch) -> InlineOutputs:
        outputs = self.inner.run_inline(batch)
        outputs.extra[OUTPUT_NAME] = self.table[batch.input_ids]
        return outputs

    def forward_logits(self, batch: InlineBatch) -> FloatArray:
        return self.inner.forward_logits(batch)
