"""Read-only forward passes in bfloat16: they really compute in it, stay close to float32, and
fall back to float32 where the device would emulate it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from limelight.demo.synthetic import build_synthetic_model, sample_linear_dataset
from limelight.models import precision
from limelight.models.loaded import load_model
from limelight.models.precision import read_precision, reading


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_synthetic_model(tmp_path_factory.mktemp("synthetic"), seed=0, n_train=2000)


def test_bfloat16_is_used_only_where_it_is_native(
    synthetic: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = load_model(synthetic)
    assert read_precision(model.device, "float32") == "float32"
    monkeypatch.setattr(precision, "bfloat16_is_native", lambda device: True)
    assert read_precision(model.device, "bfloat16") == "bfloat16"
    monkeypatch.setattr(precision, "bfloat16_is_native", lambda device: False)
    with caplog.at_level(logging.WARNING, logger="limelight.models.precision"):
        assert read_precision(model.device, "bfloat16") == "float32"
    assert "float32" in caplog.text
    with pytest.raises(ValueError, match="precision"):
        read_precision(model.device, "float16")


def test_a_bfloat16_read_computes_in_bfloat16_close_to_float32(synthetic: Path) -> None:
    model = load_model(synthetic)
    texts = sample_linear_dataset(8, seed=3).texts()
    batch = model.tokenizer(texts, padding=True, return_tensors="pt")
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.inference_mode():
        exact = model.model(input_ids=ids, attention_mask=attn).logits
        with reading(model.device, "bfloat16"):
            low = model.model(input_ids=ids, attention_mask=attn).logits
        with reading(model.device, "float32"):
            again = model.model(input_ids=ids, attention_mask=attn).logits
    assert exact.dtype == again.dtype == torch.float32 and low.dtype == torch.bfloat16
    assert torch.equal(exact, again)
    p, q = exact.softmax(-1), low.float().softmax(-1)
    assert not torch.equal(p, q)  # really another precision
    assert (p - q).abs().max() < 0.02
