"""Fixtures of the job tests: a tiny random BERT classifier saved as safetensors."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

WORDS = [
    "the", "a", "movie", "film", "was", "is", "good", "bad", "great", "awful", "plot", "acting",
    "and", "but", "not", "very", "boring", "fun", "i", "it", "this", "love", "hate", ".", ",",
]  # fmt: skip


def build_tiny_bert(directory: Path) -> Path:
    """A 2-layer, 16-wide random BERT with a word-level vocabulary (built, never downloaded)."""
    import torch
    from transformers import (  # type: ignore[attr-defined]  # lazily exported, absent from stubs
        BertConfig,
        BertForSequenceClassification,
        BertTokenizerFast,
    )

    directory.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    config = BertConfig(  # type: ignore[call-arg]  # the stubs omit PretrainedConfig kwargs
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        num_labels=2,
        id2label={0: "negative", 1: "positive"},
        label2id={"negative": 0, "positive": 1},
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from limelight.models.loaded import load_model

    return load_model(tiny_model_dir)


@pytest.fixture
def redis_clean(redis_url: str) -> str:
    """``redis_url`` with an empty database."""
    import redis

    redis.Redis.from_url(redis_url).flushall()
    return redis_url


@pytest.fixture(params=["open", "acl", "narrow", "tls"])
def redis_queue(request: pytest.FixtureRequest) -> Iterator[str]:
    """An empty Redis job queue's URL: on an open server, as the ``limelight`` ACL user of a
    server that requires a password (``tests/conftest.py: REDIS_ACL``), as a user with only
    the commands the README lists (``REDIS_ACL_NARROW``: Redis must refuse it nothing, even
    what Limelight would survive, such as ``INFO``), and over mutual TLS."""
    import redis

    narrow = request.param == "narrow"
    if request.param in ("open", "tls"):
        url = admin = request.getfixturevalue(
            "redis_url" if request.param == "open" else "redis_tls_url"
        )
    else:
        acl = request.getfixturevalue("redis_acl")
        url, admin = (acl.narrow_url if narrow else acl.url), acl.admin_url
    server = redis.Redis.from_url(admin)
    server.flushall()
    server.acl_log_reset()
    yield str(url)
    if narrow:
        refused = [e for e in server.acl_log() if e.get("username") == "narrow"]
        assert not refused, f"REDIS_ACL_NARROW lacks what these were refused: {refused}"
