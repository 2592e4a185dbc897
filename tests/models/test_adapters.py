"""Every head-on-top adapter reproduces its model's own logits from the pooled position."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from limelight.errors import ModelLoadError
from limelight.models.adapters import adapter_for
from limelight.models.loaded import load_model

_SMALL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    vocab_size=120,
    num_labels=3,
    max_position_embeddings=64,
)

# One row per architecture family the sidecar supports (random small configs).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "bert": {},
    "distilbert": dict(dim=32, hidden_dim=64, n_layers=2, n_heads=2),
    "roberta": dict(pad_token_id=1),
    "xlm-roberta": dict(pad_token_id=1),
    "deberta-v2": dict(relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=0),
    "llama": dict(num_key_value_heads=2, pad_token_id=0),
}


def tiny_model(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**_SMALL, **ARCHITECTURES[model_type]})
    if model_type == "gpt2":
        config.bos_token_id = config.eos_token_id = 2
    return AutoModelForSequenceClassification.from_config(config).eval()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 120, (3, 11), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # a right-padded row
    mask[2, 4:] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_head_at_pooled_position_reproduces_logits(model_type: str) -> None:
    model = tiny_model(model_type)
    adapter = adapter_for(model)
    ids, mask = padded_batch()
    with torch.no_grad():
        # Reference: each row alone, unpadded, through the model's own forward.
        expected = torch.cat(
            [model(input_ids=ids[i : i + 1, : int(mask[i].sum())]).logits for i in range(3)]
        )
        out = adapter.run_base(ids, mask)
        token_logits = adapter.head(out.last_hidden_state)
        got = token_logits[torch.arange(3), adapter.pooled_index(mask)]
    assert token_logits.shape == (3, 11, 3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_real_weights_bert_tiny(bert_tiny_dir: Path) -> None:
    loaded = load_model(bert_tiny_dir)
    enc = loaded.tokenizer(["a witty, gorgeous film", "dull"], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = loaded.model(**enc).logits
        out = loaded.adapter.run_base(
            enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]
        )
        got = loaded.adapter.head(out.last_hidden_state)[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_real_weights_minilm(minilm_dir: Path) -> None:
    loaded = load_model(minilm_dir)
    enc = loaded.tokenizer(["an utterly charming movie"], return_tensors="pt")
    with torch.no_grad():
        expected = loaded.model(**enc).logits
        out = loaded.adapter.run_base(enc["input_ids"], enc["attention_mask"])
        got = loaded.adapter.head(out.last_hidden_state)[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_unsupported_architecture_is_named() -> None:
    config = AutoConfig.for_model("albert", **{**_SMALL, "embedding_size": 16})
    model = AutoModelForSequenceClassification.from_config(config)
    with pytest.raises(ModelLoadError, match=r"albert.*supported"):
        adapter_for(model)
