"""NormXLogit equals a direct computation from the model's weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from limelight.methods.normxlogit import NormXLogit
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime


def reference_bert(model: Any, ids: torch.Tensor, types: torch.Tensor) -> np.ndarray:
    """‖h_0[i]‖ · classifier(tanh(W_p h_L[i] + b_p)) written out from the weights."""
    with torch.no_grad():
        out = model(input_ids=ids, token_type_ids=types, output_hidden_states=True)
        h0, hl = out.hidden_states[0][0], out.hidden_states[-1][0]
        pooler = model.bert.pooler.dense
        pooled = torch.tanh(hl @ pooler.weight.T + pooler.bias)
        logat = pooled @ model.classifier.weight.T + model.classifier.bias
        return (h0.norm(dim=-1, keepdim=True) * logat).numpy()


def test_matches_direct_computation_on_demo_model(bert_tiny_dir: Path) -> None:
    loaded = load_model(bert_tiny_dir)
    runtime = TorchRuntime(loaded)
    texts = [("an astonishingly dull , lifeless film", None), ("a man sleeps", "a person rests")]
    encoded = [loaded.encode(t, p) for t, p in texts]
    outputs = runtime.run_inline(InlineBatch.from_encoded(encoded, loaded.pad_id))
    method = NormXLogit()
    for row, enc in enumerate(encoded):
        got = method.attribute(outputs, row, len(enc))
        ids = torch.tensor([enc.input_ids])
        types = torch.tensor([enc.token_type_ids])
        expected = reference_bert(loaded.model, ids, types)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        assert got.shape == (len(enc), 2)


def test_roberta_and_distilbert_heads(tmp_path: Path) -> None:
    """Head formulas for the other encoder families, written out independently."""
    for model_type, extra in [
        ("roberta", dict(pad_token_id=1)),
        ("distilbert", dict(dim=32, hidden_dim=64, n_layers=2, n_heads=2)),
    ]:
        torch.manual_seed(3)
        config = AutoConfig.for_model(
            model_type,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=100,
            num_labels=2,
            max_position_embeddings=40,
            **extra,
        )
        model = AutoModelForSequenceClassification.from_config(config).eval()
        ids = torch.tensor([[0, 11, 42, 7, 2]])
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
            h0, hl = out.hidden_states[0][0], out.hidden_states[-1][0]
            if model_type == "roberta":
                head = model.classifier
                logat = head.out_proj(torch.tanh(head.dense(hl)))
            else:
                logat = model.classifier(torch.relu(model.pre_classifier(hl)))
            expected = (h0.norm(dim=-1, keepdim=True) * logat).numpy()
        from limelight.models.adapters import adapter_for

        adapter = adapter_for(model)
        with torch.no_grad():
            base = adapter.run_base(ids, torch.ones_like(ids))
            got = (
                base.hidden_states[0].norm(dim=-1, keepdim=True)
                * adapter.head(base.last_hidden_state)
            )[0].numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_regression_head_uses_distance_to_prediction() -> None:
    from limelight.runtimes.base import InlineOutputs

    outputs = InlineOutputs(
        logits=np.array([[0.5]], dtype=np.float32),
        embedding_norms=np.array([[2.0, 1.0, 3.0]], dtype=np.float32),
        token_logits=np.array([[[0.5], [1.5], [-0.5]]], dtype=np.float32),
    )
    got = NormXLogit().attribute(outputs, 0, 3)
    np.testing.assert_allclose(got[:, 0], [0.0, 1.0, 3.0])
