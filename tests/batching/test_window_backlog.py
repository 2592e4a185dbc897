"""``truncation=window`` and ``max_pending``: a document of more windows than the inline backlog
can ever hold is refused for good (INVALID_ARGUMENT, saying which settings would let it
through), not RESOURCE_EXHAUSTED "retry later" on an idle server, where a retry never succeeds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from limelight_client import Client
from limelight_client.errors import InvalidArgument
from tests.conftest import windowed

LIMIT, STRIDE, PENDING = 32, 8, 4
SENTENCE = "the service was slow but the food arrived warm and the staff apologised twice "


def _text(sentences: int) -> str:
    return (SENTENCE * sentences).strip()


def test_a_document_of_more_windows_than_the_backlog_holds_is_refused_for_good(
    start_sidecar: Callable[..., Any], random_bert_dir: Path
) -> None:
    running = start_sidecar(
        model_dir=random_bert_dir, **windowed(LIMIT, STRIDE, max_pending=PENDING, jobs="off")
    )
    with Client(running.target, timeout=120) as client:
        fits = client.explain(_text(4), method="normxlogit")
        assert 1 < fits.windows <= PENDING
        with pytest.raises(InvalidArgument) as refused:
            client.explain(_text(30), method="normxlogit")
        # The server was idle: a second try is refused the same way, never admitted.
        with pytest.raises(InvalidArgument):
            client.explain(_text(30), method="normxlogit")
        assert client.explain("still serving", method="normxlogit").label
    message = str(refused.value)
    windows = int(message.split("needs ")[1].split(" windows")[0])
    assert windows > PENDING
    assert f"max_pending {PENDING}" in message
    assert f"LIMELIGHT_MAX_PENDING to at least {windows}" in message
    assert "LIMELIGHT_TRUNCATION=truncate" in message
    assert "retry later" not in message
