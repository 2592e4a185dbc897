"""The served path hands token counts to the batcher: real requests of mixed lengths are
batched by the length policy, every one of them gets its own correct explanation, and the
batch metrics count what ran."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from limelight.batching import LengthPolicy
from limelight.core.types import ExplainInput
from limelight.metrics import Metrics
from limelight.runtimes.base import InlineBatch, InlineOutputs
from tests.conftest import inline_service


@pytest.mark.asyncio
async def test_mixed_lengths_are_batched_by_the_policy(bert_tiny_dir: Path) -> None:
    metrics = Metrics()
    service = inline_service(
        bert_tiny_dir, metrics, max_batch_size=8, max_batch_tokens=512, batch_bucket_floor=32
    )
    widths: list[list[int]] = []
    run_inline = service.runtime.run_inline

    def recording(batch: InlineBatch) -> InlineOutputs:
        widths.append(list(batch.lengths))
        return run_inline(batch)

    service.runtime.run_inline = recording  # type: ignore[method-assign]
    short = "a gorgeous, witty, seductive movie"
    long = " ".join(["the plot is thin but the cast is charming"] * 60)  # > 256 tokens
    texts = [long if i % 3 == 0 else f"{short} {i}" for i in range(36)]

    async def go() -> list[int]:
        await service.start()
        try:
            done = await asyncio.gather(*(service.explain(ExplainInput(text=t)) for t in texts))
            # One at a time on an idle server: tokenised in place, no tokenizer-thread hop.
            assert service._tokenizer is not None
            queued: list[object] = []
            submit = service._tokenizer.submit

            async def counting(item: tuple[str, str | None]) -> object:
                queued.append(item)
                return await submit(item)

            service._tokenizer.submit = counting  # type: ignore[assignment,method-assign]
            alone = [await service.explain(ExplainInput(text=t)) for t in texts[1:3]]
            assert queued == []
        finally:
            await service.close()
        for together, single in zip(done[1:3], alone, strict=True):
            assert together.label == single.label
            assert len(together.tokens) == len(single.tokens)
        return [len(e.tokens) for e in done]

    lengths = await go()
    assert any(n > 256 for n in lengths) and any(n <= 32 for n in lengths)
    policy = LengthPolicy(8, 512, 32)
    batched = [w for w in widths[1:] if len(w) > 1]  # after the warm-up
    assert batched, widths  # concurrent requests did share forward passes
    for w in widths[1:]:
        assert len({policy.bucket(n) for n in w}) == 1, w
        assert len(w) <= 8 and (len(w) == 1 or len(w) * max(w) <= 512), w
    # The batch metrics count every served forward pass's tokens, as run (the warm-up aside).
    sample = metrics.registry.get_sample_value
    assert sample("limelight_batch_size_count") == len(widths) - 1
    assert sample("limelight_batch_tokens_total", {"kind": "input"}) == sum(map(sum, widths[1:]))
    padded = sum(len(w) * max(w) for w in widths[1:])
    assert sample("limelight_batch_tokens_total", {"kind": "padded"}) == padded
