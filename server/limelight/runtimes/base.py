"""The Runtime interface: what the inline path needs from torch or ONNX Runtime."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from limelight.core.types import Encoded, FloatArray, IntArray


@dataclass
class InlineBatch:
    """Right-padded inputs of one micro-batch."""

    input_ids: IntArray
    attention_mask: IntArray
    token_type_ids: IntArray | None
    lengths: list[int]

    @classmethod
    def from_encoded(cls, items: list[Encoded], pad_id: int) -> InlineBatch:
        width = max(len(e) for e in items)
        ids = np.full((len(items), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(items), width), dtype=np.int64)
        types = None
        if items[0].token_type_ids is not None:
            types = np.zeros((len(items), width), dtype=np.int64)
        for row, e in enumerate(items):
            ids[row, : len(e)] = e.input_ids
            mask[row, : len(e)] = 1
            if types is not None and e.token_type_ids is not None:
                types[row, : len(e)] = e.token_type_ids
        return cls(ids, mask, types, [len(e) for e in items])

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class InlineOutputs:
    """Everything the inline methods read, from one forward pass."""

    logits: FloatArray
    """[B, C] the model's own logits."""
    embedding_norms: FloatArray
    """[B, n] L2 norm of the embedding-layer output h_0 per token."""
    token_logits: FloatArray
    """[B, n, C] the model's head applied to each token's final hidden state (LogAt)."""
    extra: dict[str, FloatArray] = field(default_factory=dict)
    """[B, n, C] outputs of extra inline heads (e.g. the distilled explainer), by name."""
    normxlogit: FloatArray | None = None
    """[B, n, C] NormXLogit itself (``embedding_norms`` times ``token_logits``) when the runtime
    computed it in its pass (ONNX graphs of classifiers); None: the method multiplies."""


class InlineHead(Protocol):
    """An extra per-token head computed from the serving forward pass (torch module)."""

    def __call__(
        self,
        hidden_states: tuple[Any, ...],
        embedding_norms: Any,
        token_logits: Any,
        attention_mask: Any,
    ) -> Any:
        """hidden_states: h_0..h_L [B, n, K] each; norms [B, n]; token_logits [B, n, C];
        attention_mask [B, n] (1 = token, 0 = padding) -> [B, n, C] scores."""
        ...


class Runtime(ABC):
    """Runs the served model for the inline path."""

    name: str

    @abstractmethod
    def run_inline(self, batch: InlineBatch) -> InlineOutputs:
        """One forward pass returning logits and the NormXLogit inputs."""

    @abstractmethod
    def forward_logits(self, batch: InlineBatch) -> FloatArray:
        """A plain classification forward pass (the benchmark baseline)."""

    @property
    def head_names(self) -> frozenset[str]:
        """Names of the extra inline heads this runtime computes (keys of ``extra``)."""
        return frozenset()

    def warmup(self, batch: InlineBatch) -> None:
        self.run_inline(batch)
