"""A Rust panic in a native library (tokenizers) reaches Python as pyo3's PanicException, a
BaseException that ``except Exception`` misses: it left the call unanswered until its deadline,
was counted as OK and ended the batcher's loop. It is now one batch's failure."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from limelight.batching import MicroBatcher
from limelight.errors import ends_the_caller
from limelight.models.loaded import load_model
from limelight.models.tokenize import backend

TEXT = "a gorgeous, witty, seductive movie that never lets up"


@pytest.mark.asyncio
async def test_a_native_panic_fails_its_batch_and_the_batcher_goes_on(bert_tiny_dir: Path) -> None:
    tokenizer = load_model(bert_tiny_dir).tokenizer
    # Four tokens a window, two of them special, overlapping by two: tokenizers panics.
    panicking = backend(tokenizer, 4, 2)
    with pytest.raises(BaseException) as raised:
        panicking.encode(TEXT, add_special_tokens=True)
    assert not isinstance(raised.value, Exception) and not ends_the_caller(raised.value)

    def process(texts: list[str]) -> list[int]:
        if "panic" in texts:
            panicking.encode(TEXT, add_special_tokens=True)
        return [len(tokenizer(t)["input_ids"]) for t in texts]

    batcher = MicroBatcher(
        process, executor=ThreadPoolExecutor(1), max_batch_size=1, max_wait_s=0, max_pending=10
    )
    await batcher.start()
    try:
        with pytest.raises(RuntimeError, match="PanicException"):
            await asyncio.wait_for(batcher.submit("panic"), 30)
        # The loop is alive: the next item is answered.
        assert await asyncio.wait_for(batcher.submit(TEXT), 30) > 2
    finally:
        await batcher.stop()


def test_what_ends_a_caller_still_does() -> None:
    for exc in (asyncio.CancelledError(), KeyboardInterrupt(), SystemExit(1), GeneratorExit()):
        assert ends_the_caller(exc)
    assert not ends_the_caller(ValueError("one call's failure"))
