"""Tiny randomly initialised BERT classifiers saved with a real WordPiece tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification


def tiny_bert_config(num_hidden_layers: int = 2, **values: Any) -> BertConfig:
    """A 32-wide BERT config over the real WordPiece vocabulary (``values``: more fields)."""
    return BertConfig(  # type: ignore[call-arg]  # the stubs omit PretrainedConfig kwargs
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        intermediate_size=64,
        **values,
    )


def save_tiny_bert(
    out: Path,
    tokenizer_dir: Path,
    labels: Sequence[str],
    *,
    seed: int,
    problem_type: Literal["regression", "multi_label_classification"] | None = None,
    biases: Sequence[float] | None = None,
    edit: Callable[[Any], None] | None = None,
) -> Path:
    """A 2-layer, 32-wide BERT with ``labels`` saved to ``out`` (safetensors). ``biases`` set
    the classifier's biases (to put labels clearly over or under a threshold); ``edit`` changes
    the model in place before it is saved."""
    torch.manual_seed(seed)
    config = tiny_bert_config(
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
        problem_type=problem_type,
    )
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        if biases is not None:
            model.classifier.bias.copy_(torch.tensor(list(biases)))
        if edit is not None:
            edit(model)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out
