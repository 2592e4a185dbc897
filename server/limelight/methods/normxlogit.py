"""NormXLogit: ‖h_0[i]‖₂ · f_cls(h_L[i]), every class in one pass.

From "NormXLogit: The Head-on-Top Never Lies" (arXiv 2411.16252).
Method note: docs/methods/normxlogit.md.
"""

from __future__ import annotations

import numpy as np

from limelight.core.types import FloatArray
from limelight.methods.base import InlineMethod
from limelight.runtimes.base import InlineOutputs


class NormXLogit(InlineMethod):
    name = "normxlogit"
    description = (
        "Embedding norm times the head-on-top logit of each token; one forward pass, all classes."
    )

    def attribute(self, outputs: InlineOutputs, row: int, length: int) -> FloatArray:
        if outputs.normxlogit is not None:  # computed in the runtime's pass
            computed: FloatArray = outputs.normxlogit[row, :length]
            return computed
        norms = outputs.embedding_norms[row, :length, None]  # [n, 1]
        token_logits = outputs.token_logits[row, :length]  # [n, C]
        if token_logits.shape[1] == 1:
            # Regression: the paper's distance of each token's prediction to the model's.
            # Larger = the token alone would move the prediction further (unsigned).
            predicted = outputs.logits[row, 0]
            return np.asarray(norms * np.abs(token_logits - predicted), dtype=np.float32)
        scores: FloatArray = norms * token_logits  # float32: the runtimes' outputs are
        return scores
