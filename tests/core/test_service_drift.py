"""The service observes answers for drift after they are given, in the drift feeder's thread:
an answer never waits for the monitor, a monitor that falls behind loses (and counts) answers
rather than holding requests, and a drift report includes every answer observed so far."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from limelight.app import build_application
from limelight.core.types import ExplainInput
from limelight.metrics import Metrics
from limelight.settings import Settings

WAIT_S = 60.0
"""A hang guard, not a speed limit."""


@pytest.mark.asyncio
async def test_answers_do_not_wait_for_the_drift_monitor(bert_tiny_dir: Path) -> None:
    texts = ["a gorgeous, witty, seductive movie", "an overwrought misfire", "dull", "fine"]
    tokenizer = AutoTokenizer.from_pretrained(bert_tiny_dir)
    sizes = [len(tokenizer(t)["input_ids"]) for t in texts]
    settings = Settings(
        model_dir=bert_tiny_dir,
        jobs="off",
        metrics_port=0,
        default_method="normxlogit",
        drift_bootstrap_n=100,  # every observed answer goes into the reference: countable
        drift_min_count=100,  # at most the bootstrap: settings refuse a larger one
        drift_queue_tokens=sizes[0] + sizes[1],  # room for the first two answers' tokens
    )
    metrics = Metrics()
    service = build_application(settings, metrics).service
    await service.start()
    try:
        first = await service.explain(ExplainInput(text=texts[0]))
        assert (await service.drift_report(5)).reference_count == 1
        feeder = service._drift_feeder
        assert feeder is not None
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            held.set()
            release.wait(WAIT_S)

        feeder.put(hold)
        assert await asyncio.to_thread(held.wait, WAIT_S)
        # The monitor is stuck: the answers still come; the first two fill the queue's tokens,
        # the two after them find no room and are counted.
        answers = [
            await asyncio.wait_for(service.explain(ExplainInput(text=t)), WAIT_S) for t in texts
        ]
        assert [a.label for a in answers[:1]] == [first.label]
        dropped = metrics.registry.get_sample_value("limelight_drift_dropped_total")
        assert dropped == 2
        release.set()
        report = await service.drift_report(5)  # waits for the two queued answers
        assert report.reference_count == 3
        assert report.reference_state == "building"
    finally:
        release.set()
        await service.close()
    assert feeder.pending() == 0
    assert not feeder.put(lambda: None)  # closed with the service
