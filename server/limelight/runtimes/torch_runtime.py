"""The PyTorch runtime: one base forward pass yields logits, h_0 norms and per-token LogAt."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from limelight.core.types import FloatArray
from limelight.models.explainer_head import ExplainerHead, FrozenHead
from limelight.models.loaded import LoadedModel
from limelight.runtimes.base import InlineBatch, InlineHead, InlineOutputs, Runtime


def batch_tensors(
    batch: InlineBatch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """input ids, attention mask and token types (or None) of ``batch`` on ``device``."""
    ids = torch.from_numpy(batch.input_ids).to(device)
    mask = torch.from_numpy(batch.attention_mask).to(device)
    types = (
        torch.from_numpy(batch.token_type_ids).to(device)
        if batch.token_type_ids is not None
        else None
    )
    return ids, mask, types


class TorchRuntime(Runtime):
    name = "torch"

    def __init__(self, model: LoadedModel, heads: Mapping[str, InlineHead] | None = None) -> None:
        """``heads``: extra per-token heads run on the same forward pass (see InlineHead);
        explainer heads are served in their frozen form (FrozenHead: the same scores, fewer
        operations per call)."""
        self.model = model
        self.heads: dict[str, InlineHead] = {
            name: FrozenHead(head) if isinstance(head, ExplainerHead) else head
            for name, head in (heads or {}).items()
        }

    @property
    def head_names(self) -> frozenset[str]:
        return frozenset(self.heads)

    def _tensors(
        self, batch: InlineBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return batch_tensors(batch, self.model.device)

    @torch.inference_mode()
    def run_inline(self, batch: InlineBatch) -> InlineOutputs:
        ids, mask, types = self._tensors(batch)
        adapter = self.model.adapter
        out = adapter.run_base(ids, mask, types)
        h0 = out.hidden_states[0]
        token_logits = adapter.head(out.last_hidden_state)  # [B, n, C]
        # The model's own pooling: the head output at the pooled position, the head on the
        # masked mean (mean pooling) or the mean of the token logits (late pooling).
        logits = adapter.logits_from(out.last_hidden_state, mask, token_logits)
        norms = h0.float().norm(dim=-1)
        extra = {
            name: head(out.hidden_states, norms, token_logits, mask).float().cpu().numpy()
            for name, head in self.heads.items()
        }
        return InlineOutputs(
            logits=logits.float().cpu().numpy(),
            embedding_norms=norms.cpu().numpy(),
            token_logits=token_logits.float().cpu().numpy(),
            extra=extra,
        )

    @torch.inference_mode()
    def forward_logits(self, batch: InlineBatch) -> FloatArray:
        ids, mask, types = self._tensors(batch)
        kwargs = self.model.adapter.base_inputs(ids, mask, types)
        logits = self.model.model(**kwargs).logits
        return np.asarray(logits.float().cpu().numpy(), dtype=np.float32)
