"""A tiny BERT whose decision is controlled by one known token, trained here in seconds.

Every sentence is filler words plus at most one trigger: ``excellent`` -> class 1 (pos),
``terrible`` -> class 0 (neg). Sentences without a trigger are trained towards 50/50, and fillers
are randomly replaced by [MASK] during training, so masking a trigger moves the prediction to
"undecided" instead of into the unknown.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import (  # type: ignore[attr-defined]
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
)

from limelight.evaluation.runner import EvalExample
from limelight.models.loaded import LoadedModel, load_model

FILLERS = ("the", "movie", "was", "and", "plot")
TRIGGERS = {"terrible": 0, "excellent": 1}


@dataclass
class TriggerSetup:
    model: LoadedModel
    directory: Path
    examples: list[EvalExample]
    """Held-out sentences with gold labels and the trigger's character span as evidence."""


def sentence(rng: random.Random, trigger: str | None) -> tuple[str, tuple[int, int] | None]:
    words = [rng.choice(FILLERS) for _ in range(rng.randint(5, 9))]
    if trigger is None:
        return " ".join(words), None
    at = rng.randint(0, len(words))
    words.insert(at, trigger)
    start = len(" ".join(words[:at])) + (1 if at else 0)
    return " ".join(words), (start, start + len(trigger))


def _tokenizer(out: Path) -> BertTokenizerFast:
    # A vocabulary of just these words keeps the embedding (and training) tiny.
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *FILLERS, *TRIGGERS]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return BertTokenizerFast(vocab=str(out / "vocab.txt"), do_lower_case=True)


def _train(out: Path) -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    tok = _tokenizer(out)
    config = BertConfig(  # type: ignore[call-arg]
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
        id2label={0: "neg", 1: "pos"},
        label2id={"neg": 0, "pos": 1},
    )
    model = BertForSequenceClassification(config)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(300):
        ids_list, targets = [], []
        for _ in range(32):
            trigger = rng.choice([None, "terrible", "excellent", "terrible", "excellent"])
            text, _ = sentence(rng, trigger)
            ids = tok(text)["input_ids"]
            trig_ids = {tok.convert_tokens_to_ids(t) for t in TRIGGERS}
            ids = [
                tok.mask_token_id
                if 0 < i < len(ids) - 1 and ids[i] not in trig_ids and rng.random() < 0.3
                else t
                for i, t in enumerate(ids)
            ]
            ids_list.append(ids)
            target = [0.5, 0.5] if trigger is None else [0.0, 0.0]
            if trigger is not None:
                target[TRIGGERS[trigger]] = 1.0
            targets.append(target)
        width = max(map(len, ids_list))
        batch = torch.zeros(len(ids_list), width, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for r, ids in enumerate(ids_list):
            batch[r, : len(ids)] = torch.tensor(ids)
            mask[r, : len(ids)] = 1
        logits = model(input_ids=batch, attention_mask=mask).logits
        loss = F.cross_entropy(logits, torch.tensor(targets))
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


@pytest.fixture(scope="session")
def trigger_setup(tmp_path_factory: pytest.TempPathFactory) -> TriggerSetup:
    out = tmp_path_factory.mktemp("trigger-bert")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a busy machine
    try:
        _train(out)
    finally:
        torch.set_num_threads(threads)
    model = load_model(out)
    rng = random.Random(1)
    examples = []
    for i in range(40):
        trigger = "excellent" if i % 2 else "terrible"
        text, span = sentence(rng, trigger)
        assert span is not None
        examples.append(EvalExample(text, TRIGGERS[trigger], evidence=(span,)))
    return TriggerSetup(model, out, examples)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny models: one thread avoids OpenMP contention on a busy machine; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
