"""A long document's windows go to the micro-batcher as a whole: admitted together or refused
together, and withdrawn together once one of them fails, so that an overloaded or failing
server computes no window of a document whose answer is already an error."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from limelight.core.service import ExplanationService
from limelight.core.types import ExplainInput
from limelight.core.windows import encode_windows
from limelight.errors import InvalidArgument
from limelight.runtimes.base import InlineBatch, InlineOutputs
from tests.conftest import inline_service

WAIT_S = 60.0
"""A hang guard, not a speed limit."""
DOCUMENT = " ".join(
    f"the service was slow in part {i} but the food arrived warm" for i in range(12)
)


def windowed_service(bert_tiny_dir: Path, **settings: Any) -> ExplanationService:
    values: dict[str, Any] = dict(
        truncation="window",
        max_tokens=32,
        window_stride=8,
        max_batch_size=1,  # one window per forward pass: each one counted
        max_batch_wait_ms=0,
    )
    values.update(settings)
    service: ExplanationService = inline_service(bert_tiny_dir, **values)
    return service


def count_forwards(service: ExplanationService, fail: bool = False) -> list[int]:
    """Record the length of every batch the runtime is asked for (``fail``: refuse each)."""
    seen: list[int] = []
    run_inline = service.runtime.run_inline

    def recording(batch: InlineBatch) -> InlineOutputs:
        seen.append(int(batch.input_ids.shape[0]))
        if fail:
            raise RuntimeError("the runtime failed")
        return run_inline(batch)

    service.runtime.run_inline = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.asyncio
async def test_a_document_is_admitted_whole_or_refused_whole(bert_tiny_dir: Path) -> None:
    service = windowed_service(bert_tiny_dir, max_pending=4)
    await service.start()
    try:
        assert (
            len(encode_windows(service.model, DOCUMENT, 32, 8)) > 4
        )  # more than the backlog holds
        seen = count_forwards(service)
        # More windows than the backlog can ever hold: refused for good (a "retry later"
        # could never succeed), before any window is computed.
        with pytest.raises(InvalidArgument, match=r"needs \d+ windows, more than the 4"):
            await service.explain(ExplainInput(text=DOCUMENT))
        assert seen == [] and service._batcher is not None and service._batcher.pending == 0
        # The server goes on: a short text is answered.
        assert (await service.explain(ExplainInput(text="a witty film"))).label
    finally:
        await service.close()


@pytest.mark.asyncio
async def test_the_other_windows_are_withdrawn_once_one_fails(bert_tiny_dir: Path) -> None:
    service = windowed_service(bert_tiny_dir)
    await service.start()
    try:
        whole = await service.explain(ExplainInput(text=DOCUMENT))
        assert whole.windows > 4
        seen = count_forwards(service, fail=True)
        with pytest.raises(RuntimeError, match="the runtime failed"):
            await service.explain(ExplainInput(text=DOCUMENT))
        batcher = service._batcher
        assert batcher is not None
        assert await batcher.drain(WAIT_S)  # whatever was still queued has run by now
        # The failing window, and at most the one the inference thread took next before the
        # failure reached the document; the rest were never computed.
        assert 1 <= len(seen) <= 2 < whole.windows
    finally:
        await service.close()


@pytest.mark.asyncio
async def test_a_document_admitted_before_a_reload_is_explained_by_one_runtime(
    bert_tiny_dir: Path,
) -> None:
    """A hot reload swaps the runtime between two batches; a document whose windows straddle
    that moment is still computed window by window on the runtime it was admitted with, and the
    requests after the swap on the new one."""
    import asyncio
    import threading

    from limelight.app import build_runtime

    service = windowed_service(bert_tiny_dir, warmup=False)  # every forward a window's
    await service.start()
    try:
        old = service.runtime
        new = build_runtime(service.settings, service.model)
        ran: list[str] = []
        gate = threading.Event()

        def recording(runtime: Any, name: str) -> None:
            run_inline = runtime.run_inline

            def run(batch: InlineBatch) -> InlineOutputs:
                ran.append(name)
                gate.wait(WAIT_S)  # hang guard: the first window waits for the swap
                return run_inline(batch)

            runtime.run_inline = run

        recording(old, "old")
        recording(new, "new")
        document = asyncio.ensure_future(service.explain(ExplainInput(text=DOCUMENT)))
        while not ran:  # the first window is in the inference thread
            await asyncio.sleep(0.01)
        swapped = asyncio.ensure_future(service.swap_runtime(new, service.drift))
        await asyncio.sleep(0.05)  # the swap waits behind the first window
        gate.set()
        await swapped
        whole = await document
        assert ran == ["old"] * whole.windows
        after = await service.explain(ExplainInput(text=DOCUMENT))
        assert ran[whole.windows :] == ["new"] * after.windows
        assert after.attribution.scores.tolist() == pytest.approx(whole.attribution.scores.tolist())
    finally:
        await service.close()


@pytest.mark.asyncio
async def test_every_piece_of_a_character_cut_into_several_is_explained(
    bert_tiny_dir: Path,
) -> None:
    # BERT's tokenizer cuts a Hangul syllable into its jamo, pieces with the same character
    # span: stitching by span alone kept only the first of them (802 of 1,302 tokens).
    service = windowed_service(bert_tiny_dir, max_batch_size=8)
    text = "한국어 문장 " * 40 + "the food arrived warm " * 30
    await service.start()
    try:
        explanation = await asyncio.wait_for(
            service.explain(ExplainInput(text=text)), timeout=WAIT_S
        )
        whole = service.model.tokenizer(text)["input_ids"]
        assert [t.id for t in explanation.tokens] == whole
        assert len(explanation.attribution.scores) == len(whole)
    finally:
        await service.close()
