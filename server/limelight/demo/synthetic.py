"""The SLALOM paper's synthetic linear dataset and a tiny transformer.

The dataset is appendix E.1 of "Attention Mechanisms Don't Learn Additive Models: Rethinking
Feature Importance for Transformers" (arXiv 2405.13536).

Ten words carry fixed log-odds weights; a sample is a bag of independently drawn words whose
label is Bernoulli(sigmoid(Σ weights)). The data are linear in the word counts by construction,
yet a transformer trained on them does not represent a linear model (the paper's proposition
4.1) — which is what makes the set a good anchor for surrogate explanations: the *ranking* of
the words is known, the transformer's exact function is not linear.

Our copy of the paper lists the weights but not the words' occurrence probabilities (its
table 3 row is missing), so :data:`SYNTHETIC_PROBABILITIES` is our choice: neutral filler
words are the most frequent, strong words the rarest, as in natural text.

Everything here is deterministic for a seed and builds in seconds on one CPU core:
:func:`build_synthetic_model` writes an ordinary Hugging Face classifier directory (safetensors,
a word-level fast tokenizer with offsets) that :func:`limelight.models.loaded.load_model` loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    AutoConfig,
    BertConfig,
    BertForSequenceClassification,
    PreTrainedTokenizerFast,
)

SYNTHETIC_WORDS: tuple[str, ...] = (
    "the",
    "we",
    "movie",
    "watch",
    "good",
    "best",
    "perfect",
    "ok",
    "bad",
    "worst",
)
"""The paper's ten-word vocabulary (appendix E.1, table 3)."""

SYNTHETIC_WEIGHTS: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.6, 1.0, 1.5, -0.6, -1.0, -1.5)
"""Log-odds weight of each word in :data:`SYNTHETIC_WORDS` (the paper's values)."""

SYNTHETIC_PROBABILITIES: tuple[float, ...] = (
    0.16,
    0.12,
    0.12,
    0.12,
    0.09,
    0.07,
    0.05,
    0.11,
    0.09,
    0.07,
)
"""Occurrence probability of each word (our choice; see the module docstring)."""

SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
LABELS: tuple[str, str] = ("negative", "positive")


@dataclass(frozen=True)
class SyntheticData:
    """Samples of the linear dataset."""

    word_ids: list[list[int]]
    """Each sample as indices into :data:`SYNTHETIC_WORDS`."""
    log_odds: npt.NDArray[np.float64]
    """Σ of the words' weights per sample (the true linear log-odds)."""
    labels: npt.NDArray[np.int64]
    """Bernoulli(sigmoid(log_odds)) draws."""

    def texts(self) -> list[str]:
        return [" ".join(SYNTHETIC_WORDS[i] for i in ids) for ids in self.word_ids]


def sample_linear_dataset(
    n: int, seed: int, mean_length: int = 15, max_length: int = 30
) -> SyntheticData:
    """``n`` samples: length ~ Binomial(max_length, mean/max) (at least 1), words i.i.d."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(rng.binomial(max_length, mean_length / max_length, size=n), 1)
    probs = np.asarray(SYNTHETIC_PROBABILITIES, dtype=np.float64)
    probs = probs / probs.sum()
    weights = np.asarray(SYNTHETIC_WEIGHTS, dtype=np.float64)
    word_ids = [rng.choice(len(SYNTHETIC_WORDS), size=int(k), p=probs).tolist() for k in lengths]
    log_odds = np.array([weights[ids].sum() for ids in word_ids], dtype=np.float64)
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-log_odds))).astype(np.int64)
    return SyntheticData(word_ids=word_ids, log_odds=log_odds, labels=labels)


def build_word_tokenizer(words: Sequence[str] = SYNTHETIC_WORDS) -> PreTrainedTokenizerFast:
    """A whitespace word-level fast tokenizer with BERT-style special tokens and offsets."""
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *words))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=64,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def build_tiny_classifier(
    vocab_size: int, seed: int, layers: int = 1, hidden: int = 32, heads: int = 2
) -> BertForSequenceClassification:
    """A small randomly initialised binary BERT classifier (deterministic for ``seed``)."""
    config = AutoConfig.for_model(
        "bert",
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        type_vocab_size=2,
        num_labels=2,
        id2label=dict(enumerate(LABELS)),
        label2id={name: i for i, name in enumerate(LABELS)},
        pad_token_id=0,
    )
    assert isinstance(config, BertConfig)
    with torch.random.fork_rng(devices=[]):  # seed the init without touching global RNG state
        torch.manual_seed(seed)
        model = BertForSequenceClassification(config)
    return model


def train_classifier(
    model: BertForSequenceClassification,
    tokenizer: PreTrainedTokenizerFast,
    data: SyntheticData,
    seed: int,
    epochs: int = 3,
    batch_size: int = 64,
    lr: float = 3e-3,
) -> None:
    """Fit ``model`` to ``data`` with AdamW on the cross-entropy (in place; ends in eval mode)."""
    encoded = tokenizer(data.texts())["input_ids"]
    labels = torch.as_tensor(data.labels)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    pad = int(tokenizer.pad_token_id or 0)
    model.train()
    with torch.random.fork_rng(devices=[]):  # dropout draws stay out of the global RNG
        torch.manual_seed(seed)
        for _ in range(epochs):
            order = torch.randperm(len(encoded), generator=generator).tolist()
            for start in range(0, len(order), batch_size):
                rows = order[start : start + batch_size]
                width = max(len(encoded[r]) for r in rows)
                ids = torch.full((len(rows), width), pad, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for k, r in enumerate(rows):
                    ids[k, : len(encoded[r])] = torch.as_tensor(encoded[r])
                    mask[k, : len(encoded[r])] = 1
                loss = model(input_ids=ids, attention_mask=mask, labels=labels[rows]).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    model.eval()


def build_synthetic_model(
    out_dir: Path,
    seed: int = 0,
    n_train: int = 6000,
    epochs: int = 3,
    layers: int = 1,
) -> Path:
    """Train a tiny BERT on the linear dataset and save it as a classifier directory."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_word_tokenizer()
    model = build_tiny_classifier(len(tokenizer), seed=seed, layers=layers)
    train_classifier(model, tokenizer, sample_linear_dataset(n_train, seed=seed), seed, epochs)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def word_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Token id of each word in :data:`SYNTHETIC_WORDS`."""
    ids = tokenizer.convert_tokens_to_ids(list(SYNTHETIC_WORDS))
    assert isinstance(ids, list)
    return [int(i) for i in ids]
