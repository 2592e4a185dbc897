"""The explainer head, its card, and loading it beside the model it belongs to.

The head reads only what the inline forward pass already has — the hidden states of a few
layers, the embedding norms and the per-token head logits — and emits one score per token
and class. It is bound to one model by the model's fingerprint: a head distilled for another
model refuses to load.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from limelight.errors import FailedPrecondition
from limelight.models.loaded import LoadedModel

HEAD_DIRNAME = "limelight_distilled"
CARD_FORMAT = "limelight-distilled-head/1"


@dataclass
class HeadCard:
    """What the head is, what it learned from and how well it did on held-out texts."""

    model_version: str
    layers: list[int]
    hidden_size: int
    num_labels: int
    width: int
    teacher: str
    teacher_params: dict[str, Any] = field(default_factory=dict)
    data: str = ""
    train_texts: int = 0
    validation_texts: int = 0
    validation: dict[str, float] = field(default_factory=dict)
    parameters: int = 0
    seed: int = 0
    format: str = CARD_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> HeadCard:
        data = json.loads(text)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class ExplainerHead(nn.Module):
    """Per-token MLP over [h_l for l in layers] ⊕ log‖h_0‖ ⊕ LogAt → one score per class."""

    def __init__(self, layers: list[int], hidden_size: int, num_labels: int, width: int) -> None:
        super().__init__()
        self.layers = list(layers)
        features = hidden_size * len(layers) + 1 + num_labels
        # Normalise each feature group so layers of different scale train alike.
        self.norm = nn.LayerNorm(features, elementwise_affine=False)
        self.mlp = nn.Sequential(
            nn.Linear(features, width), nn.GELU(), nn.Linear(width, num_labels)
        )

    def features(
        self,
        hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor],
        embedding_norms: torch.Tensor,
        token_logits: torch.Tensor,
    ) -> torch.Tensor:
        parts = [hidden_states[layer].float() for layer in self.layers]
        parts.append(torch.log1p(embedding_norms.float()).unsqueeze(-1))
        parts.append(token_logits.float())
        return self.norm(torch.cat(parts, dim=-1))

    def forward(
        self,
        hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor],
        embedding_norms: torch.Tensor,
        token_logits: torch.Tensor,
    ) -> torch.Tensor:
        return self.score(self.features(hidden_states, embedding_norms, token_logits))

    def score(self, features: torch.Tensor) -> torch.Tensor:
        return self.mlp(features)  # type: ignore[no-any-return]


def head_dir(model: LoadedModel) -> Path:
    return model.directory / HEAD_DIRNAME


def save_head(head: ExplainerHead, card: HeadCard, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    card.parameters = sum(p.numel() for p in head.parameters())
    save_file(
        {k: v.contiguous() for k, v in head.state_dict().items()}, directory / "head.safetensors"
    )
    (directory / "card.json").write_text(card.to_json())
    return directory


def read_card(directory: Path) -> HeadCard | None:
    path = directory / "card.json"
    return HeadCard.from_json(path.read_text()) if path.exists() else None


def check_card(card: HeadCard, model: LoadedModel) -> str:
    """Empty when ``card`` belongs to ``model``; otherwise why not and what to do."""
    if card.format != CARD_FORMAT:
        return f"the distilled head has format {card.format!r}; expected {CARD_FORMAT!r}"
    if card.model_version != model.version:
        return (
            f"the distilled head was trained for model version {card.model_version}, but this "
            f"model is {model.version}; run `limelight distill --model {model.directory}` again"
        )
    if card.hidden_size != model.hidden_size or card.num_labels != model.num_labels:
        return "the distilled head does not match this model's hidden size or labels"
    return ""


def load_head(model: LoadedModel, directory: Path | None = None) -> ExplainerHead:
    """Load the head beside ``model`` (or from ``directory``); refuses another model's head."""
    directory = directory or head_dir(model)
    card = read_card(directory)
    if card is None:
        raise FailedPrecondition(
            f"no distilled head at {directory}; create one with "
            f"`limelight distill --model {model.directory} --teacher integrated_gradients`"
        )
    reason = check_card(card, model)
    if reason:
        raise FailedPrecondition(reason)
    head = ExplainerHead(card.layers, card.hidden_size, card.num_labels, card.width)
    head.load_state_dict(load_file(directory / "head.safetensors"))
    return head.eval().to(model.device)
