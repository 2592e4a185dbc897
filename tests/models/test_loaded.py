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


# --- limits and padding the config or the tokenizer leave undeclared -------------------------

LONG_TEXT = " ".join(["this film is a long and winding story that never ends"] * 30)


def test_gpt2_without_a_pad_token_takes_padded_batches(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Stock GPT-2 declares no pad_token_id, and transformers' classifier then refuses batches
    of more than one row. The pad id Limelight pads with is declared at load time, and the
    classifier's own forward on a padded batch gives each row its logits alone."""
    import torch

    from tests.models.tiny_families import save_tiny, stock_logits

    directory = save_tiny(tmp_path, tokenizer_dir, "gpt2")
    loaded = load_model(directory)
    assert loaded.config.pad_token_id == loaded.pad_id
    rows = [loaded.encode(t).input_ids for t in ("a witty and gorgeous film", "dull")]
    ids = torch.full((2, len(rows[0])), loaded.pad_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        batch = loaded.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        derived = loaded.adapter.logits(ids, mask)
    expected = stock_logits(directory, rows)
    torch.testing.assert_close(batch.float(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(derived.float(), expected, atol=1e-5, rtol=1e-5)


def test_no_pad_declared_where_every_text_ends_with_the_pad_id(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Where the tokenizer's pad token ends every text (here [SEP]), declaring it would move the
    classifier's pooled token: the config is left as it was, and the adapter's batched logits
    (the base, then the head at each row's last attended token) are still the model's own."""
    import torch

    from tests.models.tiny_families import SEP, save_tiny, stock_logits

    directory = save_tiny(tmp_path, tokenizer_dir, "gpt2", tokenizer_values={"pad_token": "[SEP]"})
    loaded = load_model(directory)
    assert loaded.pad_id == SEP and loaded.config.pad_token_id is None
    rows = [loaded.encode(t).input_ids for t in ("a witty and gorgeous film", "dull")]
    assert all(r[-1] == SEP for r in rows)
    ids = torch.full((2, len(rows[0])), SEP)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        derived = loaded.adapter.logits(ids, mask)
    torch.testing.assert_close(derived.float(), stock_logits(directory, rows), atol=1e-5, rtol=1e-5)


def test_positions_offset_past_the_padding_index_limit_the_input(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """RoBERTa's position ids start at padding_idx + 1: a table of 66 rows with padding_idx 1
    holds 64 tokens. With a tokenizer that declares no model_max_length, the limit is 64, not
    66, and the longest input runs (truncated, and in windows)."""
    import torch

    from tests.models.tiny_families import save_tiny

    directory = save_tiny(
        tmp_path, tokenizer_dir, "roberta", max_position_embeddings=66, no_model_max_length=True
    )
    loaded = load_model(directory)
    assert loaded.max_tokens == 64
    encoded = loaded.encode(LONG_TEXT)
    assert len(encoded) == 64 and encoded.truncated
    ids = torch.tensor([encoded.input_ids])
    with torch.no_grad():
        out = loaded.adapter.run_base(ids, torch.ones_like(ids))
        loaded.model(input_ids=ids)
    assert out.last_hidden_state.shape[1] == 64
    with pytest.raises((IndexError, RuntimeError)), torch.no_grad():  # one more: out of range
        loaded.model(input_ids=torch.cat([ids, ids[:, -1:]], dim=1))


@pytest.mark.parametrize("model_type", ["t5", "bloom"])
def test_a_model_without_a_position_limit_loads_with_the_default_limit(
    model_type: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Relative (T5) and ALiBi (BLOOM) positions set no limit, and a tokenizer may declare no
    model_max_length: the limit is then the settings' default (or the one passed)."""
    from limelight.models.loaded import DEFAULT_MAX_TOKENS
    from tests.models.tiny_families import save_tiny

    directory = save_tiny(tmp_path, tokenizer_dir, model_type, no_model_max_length=True)
    loaded = load_model(directory)
    assert loaded.max_tokens == DEFAULT_MAX_TOKENS == 512
    encoded = loaded.encode(LONG_TEXT, max_tokens=128)
    assert len(encoded) == 128 and encoded.truncated
    assert load_model(directory, default_max_tokens=1024).max_tokens == 1024


def test_a_config_that_lost_its_labels_is_named(random_bert_dir: Path, tmp_path: Path) -> None:
    """config.json without id2label declares 2 labels; the classifier has 3 outputs."""
    directory = tmp_path / "model"
    shutil.copytree(random_bert_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    for key in ("id2label", "label2id", "num_labels"):
        config.pop(key, None)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as caught:
        load_model(directory)
    message = str(caught.value)
    assert "config.json declares 2 labels" in message
    assert "have 3 outputs" in message and "id2label" in message
