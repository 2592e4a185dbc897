"""Fixtures of the method tests: loaded real models (tiny random BERT, BERT-tiny demo)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from limelight.methods.base import JobContext
from limelight.models.loaded import LoadedModel, load_model
from limelight.settings import Settings


@pytest.fixture(scope="session")
def random_bert(random_bert_dir: Path) -> LoadedModel:
    return load_model(random_bert_dir)


@pytest.fixture(scope="session")
def bert_tiny(bert_tiny_dir: Path) -> LoadedModel:
    return load_model(bert_tiny_dir)


@pytest.fixture
def make_ctx() -> Callable[..., JobContext]:
    """``make_ctx(model, **settings)``: a JobContext that records progress in ``.progress``."""

    def make(model: LoadedModel, **settings: Any) -> JobContext:
        progress: list[tuple[float, str]] = []
        ctx = JobContext(
            model=model,
            settings=Settings(**settings),
            report=lambda fraction, message: progress.append((fraction, message)),
        )
        ctx.progress = progress  # type: ignore[attr-defined]
        return ctx

    return make
