"""Loading model directories: safetensors only, no remote code, offsets and limits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from limelight.errors import InvalidArgument, ModelLoadError
from limelight.models.loaded import fingerprint, load_model


def test_labels_and_metadata(random_bert_dir: Path) -> None:
    model = load_model(random_bert_dir)
    assert model.labels == ["negative", "neutral", "positive"]
    assert model.architecture == "bert"
    assert model.version == fingerprint(random_bert_dir)
    assert model.label_index("neutral") == 1
    with pytest.raises(InvalidArgument, match="unknown label 'bogus'"):
        model.label_index("bogus")


def test_offsets_point_into_the_text(random_bert_dir: Path) -> None:
    model = load_model(random_bert_dir)
    text = "Unbelievably witty, isn't it?"
    enc = model.encode(text)
    assert enc.tokens[0].special and enc.tokens[-1].special
    for tok in enc.tokens:
        if not tok.special:
            piece = text[tok.start : tok.end].lower()
            assert piece == tok.text.removeprefix("##")


def test_text_pair_segments(random_bert_dir: Path) -> None:
    model = load_model(random_bert_dir)
    enc = model.encode("a man sleeps", "a person rests")
    segments = [t.segment for t in enc.tokens if not t.special]
    assert segments == [0, 0, 0, 1, 1, 1]
    assert enc.token_type_ids is not None and enc.token_type_ids[-1] == 1


def test_truncate_or_reject(random_bert_dir: Path) -> None:
    model = load_model(random_bert_dir)
    text = "word " * 50
    enc = model.encode(text, max_tokens=16)
    assert len(enc) == 16 and enc.truncated and enc.tokens[-1].special
    with pytest.raises(InvalidArgument, match="limit is 16"):
        model.encode(text, max_tokens=16, truncation="reject")


def test_refuses_pickled_weights_and_remote_code(random_bert_dir: Path, tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    shutil.copytree(random_bert_dir, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(pickled)

    remote = tmp_path / "remote"
    shutil.copytree(random_bert_dir, remote)
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoModelForSequenceClassification": "evil.Model"}
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        load_model(remote)

    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "missing")


@pytest.mark.parametrize("kind", ["masked-lm", "token-classification"])
def test_refuses_a_checkpoint_without_a_trained_classifier(
    kind: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """transformers loads a masked-LM or token-classification directory as a sequence
    classifier with random weights where its own are missing (and only logs it); Limelight
    refuses it instead of serving random predictions."""
    from transformers import AutoTokenizer, BertForMaskedLM, BertForTokenClassification

    from tests.tiny_bert import tiny_bert_config

    config = tiny_bert_config(num_hidden_layers=1, num_labels=2)
    model = BertForMaskedLM(config) if kind == "masked-lm" else BertForTokenClassification(config)
    model.save_pretrained(tmp_path, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path)
    architecture = type(model).__name__
    with pytest.raises(ModelLoadError) as caught:
        load_model(tmp_path)
    message = str(caught.value)
    assert "bert.pooler.dense.weight" in message and "random values" in message
    assert f"config.json names {architecture}, not a sequence classifier" in message
    assert ("classifier.weight" in message) == (kind == "masked-lm")  # same shape: it loads


def test_a_complete_checkpoint_reports_nothing_missing(random_bert_dir: Path) -> None:
    """The check reads transformers' own loading report: a saved sequence classifier has
    every weight, so nothing is refused (and the logits are the saved model's)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    loaded = load_model(random_bert_dir)
    saved = AutoModelForSequenceClassification.from_pretrained(random_bert_dir).eval()
    ids = torch.tensor([loaded.tokenizer("a short probe")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, saved(input_ids=ids).logits)
