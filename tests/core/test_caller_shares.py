"""Each caller's share of the inline backlog (``max_pending_per_caller``): a tenant sending
faster than the model serves is refused past its share while another tenant goes on; a batch
is admitted whole or refused; a stream is paced, not ended; in-process callers are not
counted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from limelight.core.caller_shares import CallerShares
from limelight.core.service import ExplanationService
from limelight.core.types import ExplainInput, Explanation
from limelight.errors import InvalidArgument, ResourceExhausted
from tests.conftest import inline_service
from tests.core.test_service_streams import held_forwards, wait_for


def test_a_share_is_given_back_and_a_caller_seen_once_is_not_kept() -> None:
    shares = CallerShares(2)
    with shares.take("a", 2):
        refused = pytest.raises(ResourceExhausted, match=r"waiting \(2, limit 2 per caller\)")
        with refused, shares.take("a"):
            pass
        with shares.take("b"), shares.take(None, 5):  # another caller; an in-process one
            assert shares.held("b") == 1
    assert shares._held == {}
    with pytest.raises(InvalidArgument, match="3 inputs, more than the 2"), shares.take("a", 3):
        pass
    with CallerShares(None).take("a", 10_000):
        pass


async def held_service(
    bert_tiny_dir: Path,
) -> tuple[ExplanationService, threading.Event, list[int]]:
    """A started service whose shares are 2 per caller, one input per forward pass, every
    forward pass held until the gate opens (and the list they are recorded in)."""
    service: ExplanationService = inline_service(
        bert_tiny_dir, max_batch_size=1, max_batch_wait_ms=0, max_pending_per_caller=2
    )
    await service.start()
    gate = threading.Event()
    return service, gate, held_forwards(service, gate)


@pytest.mark.asyncio
async def test_one_caller_past_its_share_is_refused_while_another_goes_on(
    bert_tiny_dir: Path,
) -> None:
    service, gate, seen = await held_service(bert_tiny_dir)
    try:
        text = ExplainInput(text="a witty film")
        mine = [asyncio.ensure_future(service.explain(text, "token:a")) for _ in range(2)]
        await wait_for(lambda: len(seen) == 1)  # one in the forward pass, one queued
        with pytest.raises(ResourceExhausted, match="too many of your inline requests"):
            await service.explain(text, "token:a")
        with pytest.raises(ResourceExhausted):  # a batch: all of it or none
            await service.explain_batch([text], "token:a")
        theirs = asyncio.ensure_future(service.explain_batch([text, text], "token:b"))
        in_process = asyncio.ensure_future(service.explain(text))
        gate.set()
        answers = [*await asyncio.gather(*mine), *await theirs, await in_process]
        assert all(isinstance(a, Explanation) for a in answers) and len(answers) == 5
        assert service._shares._held == {}
        # Given back: the caller is served again.
        assert (await service.explain(text, "token:a")).label
    finally:
        gate.set()
        await service.close()


@pytest.mark.asyncio
async def test_a_stream_past_its_share_is_paced_not_ended(bert_tiny_dir: Path) -> None:
    service, gate, seen = await held_service(bert_tiny_dir)
    try:
        most = 0

        async def inputs() -> AsyncIterator[ExplainInput]:
            for i in range(8):
                yield ExplainInput(text=f"a witty film, part {i}")

        async def read() -> list[object]:
            nonlocal most
            out: list[object] = []
            async for answer in service.explain_many(inputs(), window=8, caller="token:a"):
                most = max(most, service._shares.held("token:a"))
                out.append(answer)
            return out

        reading = asyncio.ensure_future(read())
        await wait_for(lambda: len(seen) == 1)
        await asyncio.sleep(0.05)  # the stream's other inputs wait for room, not in the queue
        batcher = service._batcher
        assert batcher is not None and batcher.pending == 1
        with pytest.raises(ResourceExhausted):  # the caller's share is the stream's now
            await service.explain(ExplainInput(text="dull"), "token:a")
        gate.set()
        answers = await reading
        assert len(answers) == 8 and all(isinstance(a, Explanation) for a in answers)
        assert most <= 2 and service._shares._held == {}
    finally:
        gate.set()
        await service.close()
