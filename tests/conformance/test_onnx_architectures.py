"""ONNX export parity (logits, embedding norms, per-token logits, an explainer head's scores)
for the families added to EXPORTABLE, on tiny random-init models with right-padded batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from limelight.errors import FailedPrecondition
from limelight.models.explainer_head import ExplainerHead
from limelight.models.loaded import LoadedModel, load_model
from limelight.models.tiny import tiny_config
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.onnx_export import (
    EXPORTABLE,
    NOT_EXPORTABLE,
    export_onnx,
    input_names,
    read_description,
)
from limelight.runtimes.onnx_runtime import OnnxRuntime

ort = pytest.importorskip("onnxruntime")

NAMED = [
    "albert",
    "bart",
    "electra",
    "gemma",
    "gemma2",
    "modernbert",
    "mpnet",
    "phi",
    "phi3",
    "t5",
    "xlnet",
]
#: Their heads read the last end-of-sequence token: the WordPiece [SEP] (id 102).
ENCODER_DECODERS = {"bart", "bigbird_pegasus", "mbart", "mt5", "mvp", "plbart", "t5", "umt5"}
ORIGINAL = {"bert", "distilbert", "roberta", "xlm-roberta", "deberta-v2", "gpt2", "llama"}
OTHERS = [t for t in EXPORTABLE if t not in ORIGINAL and t not in NAMED]


def build(model_type: str, directory: Path, tokenizer_dir: Path, **values: Any) -> LoadedModel:
    torch.manual_seed(0)
    if model_type in ENCODER_DECODERS:
        values = {"eos_token_id": 102, **values}
    config = tiny_config(model_type, vocab_size=30522, **values)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return load_model(directory)


BATCHES = [
    ["a witty and gorgeous film , sadly too long", "dull"],
    ["x " * 30, "the plot is thin but the acting is great", "meh"],  # another shape
]


def feeds_for(model: LoadedModel, texts: list[str]) -> dict[str, np.ndarray]:
    """Right-padded graph inputs; token types are zeros where the tokenizer gives none, as the
    ONNX runtime feeds them."""
    enc = model.tokenizer(texts, padding=True, return_tensors="np")
    zeros = np.zeros_like(enc["input_ids"])
    return {name: np.asarray(enc.get(name, zeros), dtype=np.int64) for name in input_names(model)}


def random_head(model: LoadedModel, width: int = 8) -> ExplainerHead:
    """An explainer head reading the embeddings and the last hidden state, every weight
    random (``width=0``: a linear head, its standardisation random too)."""
    ids = torch.tensor([model.encode("a witty film").input_ids])
    with torch.no_grad():
        last = len(model.adapter.run_base(ids, torch.ones_like(ids), None).hidden_states) - 1
    torch.manual_seed(1)
    head = ExplainerHead(
        [0, last],
        model.hidden_size,
        model.num_labels,
        width=width,
        attention_heads=4 if width else 0,
    ).eval()
    with torch.no_grad():
        for p in [*head.parameters(), *head.buffers()]:
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return head


def check_parity(model: LoadedModel, out: Path) -> None:
    head, linear = random_head(model), random_head(model, width=0)
    export_onnx(model, out, heads={"distilled": head, "linear": linear})
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    served = OnnxRuntime(out, model)
    for texts in BATCHES:
        feeds = feeds_for(model, texts)
        names = ["logits", "embedding_norms", "token_logits", "head_distilled", "head_linear"]
        # A graph may leave out the mask where no node reads it (as the runtime feeds it).
        taken = {i.name for i in session.get_inputs()}
        assert set(read_description(out)["inputs"]) == taken
        logits, norms, token_logits, scores, linear_scores = session.run(
            names, {k: v for k, v in feeds.items() if k in taken}
        )
        tensors = {name: torch.from_numpy(value) for name, value in feeds.items()}
        mask = tensors["attention_mask"]
        with torch.no_grad():
            base = model.adapter.run_base(tensors["input_ids"], mask, tensors.get("token_type_ids"))
            expected_tokens = model.adapter.head(base.last_hidden_state)
            expected_logits = model.adapter.pooled_logits(base.last_hidden_state, mask)
            expected_norms = base.hidden_states[0].norm(dim=-1)
            expected_scores = head(base.hidden_states, expected_norms, expected_tokens, mask)
            expected_linear = linear(base.hidden_states, expected_norms, expected_tokens, mask)
        np.testing.assert_allclose(logits, expected_logits.numpy(), atol=1e-4)
        # The runtime the sidecar serves feeds the graph the inputs it takes.
        batch = InlineBatch(
            feeds["input_ids"],
            feeds["attention_mask"],
            feeds.get("token_type_ids"),
            [int(n) for n in feeds["attention_mask"].sum(axis=1)],
        )
        np.testing.assert_allclose(served.run_inline(batch).logits, logits, atol=1e-5)
        keep = mask.bool().numpy()  # padded positions are not compared
        np.testing.assert_allclose(norms[keep], expected_norms.numpy()[keep], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(token_logits[keep], expected_tokens.numpy()[keep], atol=1e-4)
        np.testing.assert_allclose(scores[keep], expected_scores.numpy()[keep], atol=2e-4)
        np.testing.assert_allclose(
            linear_scores[keep], expected_linear.numpy()[keep], atol=2e-4, rtol=1e-4
        )


@pytest.mark.parametrize("model_type", NAMED)
def test_onnx_parity(model_type: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    model = build(model_type, tmp_path / model_type, tokenizer_dir)
    check_parity(model, tmp_path / "graph.onnx")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", OTHERS)
def test_onnx_parity_other_families(model_type: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    model = build(model_type, tmp_path / model_type, tokenizer_dir)
    check_parity(model, tmp_path / "graph.onnx")


@pytest.mark.parametrize(
    ("model_type", "pooling"),
    [("modernbert", "mean"), ("eurobert", "late"), ("eurobert", "mean"), ("eurobert", "bos")],
)
def test_onnx_parity_of_each_pooling(
    model_type: str, pooling: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Mean- and late-pooled heads: the graph's logits are the model's own (transformers'
    forward on the same right-padded batch), besides the parity with the adapter."""
    model = build(model_type, tmp_path / model_type, tokenizer_dir, classifier_pooling=pooling)
    out = tmp_path / "graph.onnx"
    check_parity(model, out)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    feeds = feeds_for(model, BATCHES[0])
    (logits,) = session.run(["logits"], feeds)
    with torch.no_grad():
        expected = model.model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits
    np.testing.assert_allclose(logits, expected.numpy(), atol=1e-4)


def test_not_exportable_is_refused_with_the_list(tmp_path: Path, tokenizer_dir: Path) -> None:
    model = build("mixtral", tmp_path / "mixtral", tokenizer_dir)
    assert "mixtral" in NOT_EXPORTABLE
    with pytest.raises(FailedPrecondition, match="histc"):
        export_onnx(model, tmp_path / "graph.onnx")
