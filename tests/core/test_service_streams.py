"""A stream whose reader goes away (the client cancelled, its deadline passed) leaves nothing
behind: every answer begun for it is withdrawn — including the one the feeder holds while it
waits for room — and no task's outcome is left for asyncio to log as an error."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from limelight.core.service import ExplanationService
from limelight.core.types import ExplainInput
from limelight.runtimes.base import InlineBatch, InlineOutputs
from tests.conftest import inline_service

WAIT_S = 60.0
"""A hang guard, not a speed limit."""


def one_at_a_time(bert_tiny_dir: Path) -> ExplanationService:
    # One input per forward pass: each one counted.
    service: ExplanationService = inline_service(
        bert_tiny_dir, max_batch_size=1, max_batch_wait_ms=0
    )
    return service


def held_forwards(service: ExplanationService, gate: threading.Event) -> list[int]:
    """Every forward pass waits for ``gate``; returns the list they are recorded in."""
    seen: list[int] = []
    run_inline = service.runtime.run_inline

    def held(batch: InlineBatch) -> InlineOutputs:
        seen.append(int(batch.input_ids.shape[0]))
        gate.wait(WAIT_S)
        return run_inline(batch)

    service.runtime.run_inline = held  # type: ignore[method-assign]
    return seen


async def wait_for(condition: Any) -> None:
    until = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < until, "timed out"
        await asyncio.sleep(0.01)


# The deadline: the first input must reach the forward pass within it (a second of slack for a
# busy machine), and the inputs withdrawn after the cancel see it pass.
@pytest.mark.asyncio
@pytest.mark.parametrize("deadline_s", [None, 1.0], ids=["no-deadline", "deadline"])
async def test_a_stream_left_by_its_reader_leaves_nothing_running(
    bert_tiny_dir: Path, deadline_s: float | None
) -> None:
    service = one_at_a_time(bert_tiny_dir)
    await service.start()
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    gate = threading.Event()
    try:
        seen = held_forwards(service, gate)
        read = 0

        async def inputs() -> AsyncIterator[ExplainInput]:
            nonlocal read
            while True:  # an endless stream: the feeder always has the next input in hand
                read += 1
                deadline = None if deadline_s is None else time.monotonic() + deadline_s
                yield ExplainInput(text=f"a witty film, part {read}", deadline=deadline)

        async def reader() -> None:
            async for _ in service.explain_many(inputs(), window=2):
                pass

        reading = asyncio.ensure_future(reader())
        # The first input is in the forward pass; two more fill the queue; the feeder holds a
        # fourth, waiting for room.
        await wait_for(lambda: len(seen) == 1 and read >= 4)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        if deadline_s is not None:
            await asyncio.sleep(deadline_s)  # the withdrawn inputs' deadlines pass as well
        gate.set()
        batcher = service._batcher
        assert batcher is not None
        await wait_for(lambda: batcher.idle)
        # A later request runs at once, alone: nothing left over from the stream ran before it
        # or beside it.
        assert (await service.explain(ExplainInput(text="a witty film"))).label
        assert seen == [1, 1]
        gc.collect()  # asyncio reports an unretrieved exception when the task is collected
        await asyncio.sleep(0)
        assert reported == []
    finally:
        gate.set()
        loop.set_exception_handler(None)
        await service.close()


@pytest.mark.asyncio
async def test_a_draining_server_fails_the_call_not_each_input(bert_tiny_dir: Path) -> None:
    # With continue_on_error every input got "the server is draining" in its place: the call
    # succeeded, so a client never retried or went to another server.
    from limelight.errors import Unavailable

    service = inline_service(bert_tiny_dir)
    await service.start()
    try:
        await service.drain(0.5)
        inputs = [ExplainInput(text=t, continue_on_error=True) for t in ("a fine film", "dull")]
        with pytest.raises(Unavailable, match="draining"):
            await service.explain_each(inputs)
    finally:
        await service.close()


@pytest.mark.asyncio
async def test_a_target_the_model_lacks_is_refused_before_any_model_work(
    bert_tiny_dir: Path,
) -> None:
    """A class index out of range is refused where an unknown label is, before the input is
    tokenised or run: of several inputs sent at once the first bad one in order is named, not
    the first to come out of a forward pass."""
    from limelight.core.types import TargetSpec
    from limelight.errors import InvalidArgument

    service = inline_service(bert_tiny_dir)  # two classes: fresh and rotten
    await service.start()
    try:
        open_gate = threading.Event()
        open_gate.set()
        seen = held_forwards(service, open_gate)  # every forward pass, none held
        encoded: list[str] = []
        encode = service.encode_async

        async def counted(text: str, *rest: Any) -> Any:
            encoded.append(text)
            return await encode(text, *rest)

        service.encode_async = counted  # type: ignore[method-assign]
        inputs = [
            ExplainInput(text="a witty film", target=TargetSpec(index=2)),
            ExplainInput(text="a dull film", target=TargetSpec(label="no such label")),
        ]
        with pytest.raises(InvalidArgument, match=r"^input 0: target index 2 is out of range"):
            await service.explain_batch(inputs)
        alone = ExplainInput(text="a witty film", target=TargetSpec(index=-1))
        with pytest.raises(InvalidArgument, match=r"^target index -1 is out of range"):
            await service.explain(alone)
        assert (encoded, seen) == ([], [])
    finally:
        await service.close()
