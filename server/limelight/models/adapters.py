"""Head-on-top adapters: apply a classifier's own head to every token's final hidden state.

NormXLogit (DESIGN §3.1) needs LogAt_i = f_cls(h_L[i]) for every token i. Each adapter knows
where an architecture keeps its base model and its head, and which position the head normally
pools. The correctness anchor: ``head(h_L)[pooled position]`` equals the model's own logits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from limelight.errors import ModelLoadError


class HeadAdapter(ABC):
    """Architecture-specific access to a sequence classifier's base model and head."""

    #: model_type values of transformers configs this adapter serves.
    model_types: tuple[str, ...] = ()
    #: Whether the base model takes token_type_ids.
    uses_token_type_ids = False
    #: Decoder classifiers pool the last non-pad token; encoders the first token.
    pools_last_token = False

    def __init__(self, model: nn.Module) -> None:
        # Any: transformers' per-architecture attributes (bert, classifier, ...) are untyped.
        self.model: Any = model

    @property
    @abstractmethod
    def base(self) -> nn.Module:
        """The transformer without the classification head."""

    @abstractmethod
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., n, K] final hidden states -> [..., n, C] logits, each token pooled alone."""

    def pooled_index(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] the position whose head output is the model's logit (right padding assumed)."""
        if self.pools_last_token:
            return attention_mask.long().sum(dim=1) - 1
        return torch.zeros(attention_mask.shape[0], dtype=torch.long, device=attention_mask.device)

    def base_inputs(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        if inputs_embeds is not None:
            kwargs["inputs_embeds"] = inputs_embeds
        else:
            kwargs["input_ids"] = input_ids
        if self.uses_token_type_ids and token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        if self.pools_last_token:
            kwargs["use_cache"] = False
        return kwargs

    def run_base(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> Any:
        """Base forward with hidden states; returns the transformers output object."""
        kwargs = self.base_inputs(input_ids, attention_mask, token_type_ids, inputs_embeds)
        return self.base(**kwargs, output_hidden_states=True, output_attentions=output_attentions)

    def word_embeddings(self) -> nn.Module:
        emb = self.model.get_input_embeddings()
        assert isinstance(emb, nn.Module)
        return emb

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)


def _pool_each(pooler: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Run a first-token pooler on every token by making each token its own sequence."""
    lead, k = hidden.shape[:-1], hidden.shape[-1]
    out = pooler(hidden.reshape(-1, 1, k))
    return out.reshape(*lead, out.shape[-1])


class BertAdapter(HeadAdapter):
    """BERT and MiniLM: pooler (dense + tanh on the token), then the classifier."""

    model_types = ("bert",)
    uses_token_type_ids = True

    @property
    def base(self) -> nn.Module:
        return self.model.bert

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        pooler = self.model.bert.pooler
        pooled = _pool_each(pooler, hidden) if pooler is not None else hidden
        return self.model.classifier(pooled)


class DistilBertAdapter(HeadAdapter):
    """DistilBERT: pre_classifier + ReLU, then the classifier."""

    model_types = ("distilbert",)

    @property
    def base(self) -> nn.Module:
        return self.model.distilbert

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.classifier(torch.relu(self.model.pre_classifier(hidden)))


class RobertaAdapter(HeadAdapter):
    """RoBERTa and XLM-R: the classification head (dense + tanh + out_proj) on the token."""

    model_types = ("roberta", "xlm-roberta", "camembert")

    @property
    def base(self) -> nn.Module:
        return self.model.roberta

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return _pool_each(self.model.classifier, hidden)


class DebertaAdapter(HeadAdapter):
    """DeBERTa v2/v3: context pooler (dense + activation), then the classifier."""

    model_types = ("deberta-v2", "deberta")
    uses_token_type_ids = True

    @property
    def base(self) -> nn.Module:
        return self.model.deberta

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.classifier(_pool_each(self.model.pooler, hidden))


class DecoderAdapter(HeadAdapter):
    """GPT-2 and Llama-style decoders: the score head already sees every position; the
    model's logit is the last non-pad token's."""

    model_types = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma")
    pools_last_token = True

    @property
    def base(self) -> nn.Module:
        if hasattr(self.model, "transformer"):
            return self.model.transformer
        return self.model.model

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.score(hidden)


ADAPTERS: tuple[type[HeadAdapter], ...] = (
    BertAdapter,
    DistilBertAdapter,
    RobertaAdapter,
    DebertaAdapter,
    DecoderAdapter,
)


def supported_model_types() -> list[str]:
    return sorted(t for a in ADAPTERS for t in a.model_types)


def adapter_for(model: nn.Module) -> HeadAdapter:
    model_type = getattr(model.config, "model_type", "")
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls(model)
    raise ModelLoadError(
        f"architecture {model_type!r} is not supported; "
        f"supported: {', '.join(supported_model_types())}"
    )
