"""Tiny random-init classifiers of other families than BERT, saved with the real WordPiece
tokenizer, for the limits and padding a model's config and tokenizer may leave undeclared."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

SEP = 102  # the WordPiece tokenizer's [SEP]: the last token of every encoded text

SMALL: dict[str, dict[str, Any]] = {
    # As stock GPT-2: no pad_token_id in the config.
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=SEP),
    "roberta": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        pad_token_id=1,
    ),
    "bloom": dict(hidden_size=32, n_layer=2, n_head=2, pad_token_id=0),
    "distilbert": dict(dim=32, hidden_dim=64, n_layers=2, n_heads=2, max_position_embeddings=64),
    "t5": dict(
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        pad_token_id=0,
        eos_token_id=SEP,
        decoder_start_token_id=0,
    ),
}


def save_tiny(
    out: Path,
    tokenizer_dir: Path,
    model_type: str,
    *,
    num_labels: int = 3,
    seed: int = 0,
    tokenizer_values: dict[str, Any] | None = None,
    no_model_max_length: bool = False,
    **config_values: Any,
) -> Path:
    """A tiny ``model_type`` classifier saved to ``out`` with the WordPiece tokenizer.

    ``tokenizer_values``: tokenizer settings (e.g. ``pad_token``); ``no_model_max_length``:
    the tokenizer declares no ``model_max_length`` (transformers then reads a huge one)."""
    torch.manual_seed(seed)
    values = {**SMALL.get(model_type, {}), **config_values}
    values.setdefault("eos_token_id", SEP)
    config = AutoConfig.for_model(model_type, vocab_size=30522, num_labels=num_labels, **values)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, **(tokenizer_values or {}))
    tokenizer.save_pretrained(out)
    if no_model_max_length:
        path = out / "tokenizer_config.json"
        saved = json.loads(path.read_text())
        saved.pop("model_max_length", None)
        path.write_text(json.dumps(saved))
    return out


def stock_logits(model_dir: Path, rows: list[list[int]]) -> torch.Tensor:
    """[len(rows), C] transformers' own logits of each row run alone (unpadded)."""
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    params = inspect.signature(model.forward).parameters
    extra = {"use_cache": False} if "use_cache" in params else {}
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([r]), **extra).logits for r in rows]).float()
