"""A full inline backlog paces streams and refuses single calls at once; one call's many inputs
do not fill the backlog ahead of everyone else's."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from unittest import mock

import pytest

from limelight.core.service import ExplanationService
from limelight.core.types import ExplainInput, Explanation
from limelight.errors import ResourceExhausted
from tests.conftest import inline_service
from tests.core.test_service_streams import held_forwards, wait_for


async def held(
    bert_tiny_dir: Path, **settings: object
) -> tuple[ExplanationService, threading.Event, list[int]]:
    """A started service, one input per forward pass, every forward pass held until the gate
    opens (and the list they are recorded in)."""
    service: ExplanationService = inline_service(
        bert_tiny_dir, max_batch_size=1, max_batch_wait_ms=0, **settings
    )
    await service.start()
    gate = threading.Event()
    return service, gate, held_forwards(service, gate)


async def texts(name: str, count: int) -> AsyncIterator[ExplainInput]:
    for i in range(count):
        yield ExplainInput(text=f"a witty film, {name} {i}")


@pytest.mark.asyncio
async def test_streams_wait_for_room_in_a_full_backlog_and_single_calls_are_refused_at_once(
    bert_tiny_dir: Path,
) -> None:
    """Each stream reads inputs ahead (so batches fill): three of them overfill a backlog of
    two, and every stream was ended by the refusal of its input (seventeen streams did on the
    default backlog of 1,024). Streams are paced; a single call is refused, before its text is
    tokenized for nothing."""
    service, gate, seen = await held(bert_tiny_dir, max_pending=2)
    try:

        async def read(name: str) -> list[object]:
            return [a async for a in service.explain_many(texts(name, 4), window=8)]

        streams = [asyncio.ensure_future(read(name)) for name in ("a", "b", "c")]
        batcher = service._batcher
        assert batcher is not None
        await wait_for(lambda: len(seen) == 1 and batcher.pending == 2)
        await asyncio.sleep(0.05)  # the other inputs wait for room
        assert not any(s.done() for s in streams), [s.exception() for s in streams if s.done()]
        with (
            mock.patch.object(service, "encode_async", wraps=service.encode_async) as encode,
            pytest.raises(ResourceExhausted, match="inline backlog is full"),
        ):
            await service.explain(ExplainInput(text="a dull film"))
        encode.assert_not_called()
        gate.set()
        answers = await asyncio.gather(*streams)
        assert [len(a) for a in answers] == [4, 4, 4]
        assert all(isinstance(x, Explanation) for a in answers for x in a)
    finally:
        gate.set()
        await service.close()


@pytest.mark.asyncio
async def test_one_call_s_inputs_queue_two_batches_at_a_time(bert_tiny_dir: Path) -> None:
    """A call of many inputs keeps one batch running and the next queued, not all of its inputs
    in the backlog: a single call that comes meanwhile waits behind two batches, not behind
    the whole call (4 clients of 256 inputs each held single calls 80x longer)."""
    service, gate, seen = await held(bert_tiny_dir)
    try:
        many = [ExplainInput(text=f"a witty film, part {i}") for i in range(20)]
        call = asyncio.ensure_future(service.explain_batch(many))
        batcher = service._batcher
        assert batcher is not None
        await wait_for(lambda: len(seen) == 1)
        await asyncio.sleep(0.05)
        assert batcher.pending == 1  # two batches of one: one running, one queued
        single = asyncio.ensure_future(service.explain(ExplainInput(text="a dull film")))
        await wait_for(lambda: batcher.pending == 2)
        gate.set()
        answers = await call
        assert len(answers) == 20 and (await single).label
    finally:
        gate.set()
        await service.close()
