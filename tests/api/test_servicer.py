"""The servicer's shutdown of calls still open (``end_calls``), driven as gRPC drives a
stream handler: pull an answer, send it, pull the next."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from limelight.api.servicer import ExplainerServicer
from limelight.metrics import Metrics


class Context:
    """What the guard asks of a grpc.aio context: the status it sets, no deadline."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def time_remaining(self) -> float | None:
        return None


@pytest.mark.asyncio
async def test_a_stream_waiting_on_its_send_ends_itself_unavailable() -> None:
    # A client that reads slower than the server answers: the handler waits inside gRPC's send
    # for it. Cancelled there, the call ended with no status at all until the server's final
    # stop, a whole grace period later; it ends UNAVAILABLE once that answer is sent.
    servicer = ExplainerServicer(Metrics(CollectorRegistry()))
    context = Context()
    reader_caught_up = asyncio.Event()
    sent: list[int] = []

    async def answers() -> AsyncIterator[Any]:
        for i in range(5):
            yield i

    async def grpc_handler() -> None:
        stream = servicer._guard_stream("ExplainStream", context, answers, sized=True)  # type: ignore[arg-type]
        async for answer in stream:
            sent.append(answer)
            await reader_caught_up.wait()  # the send, held by flow control

    task = asyncio.create_task(grpc_handler())
    while not sent:
        await asyncio.sleep(0)
    assert servicer.end_calls() == 1
    await asyncio.sleep(0)
    assert not task.done()  # not cancelled inside the send
    reader_caught_up.set()
    await asyncio.wait_for(task, 60)  # a hang guard
    assert sent == [0]
    assert context.code is grpc.StatusCode.UNAVAILABLE and "shutting down" in context.details


@pytest.mark.asyncio
async def test_a_stream_waiting_for_work_is_ended_unavailable_at_once() -> None:
    servicer = ExplainerServicer(Metrics(CollectorRegistry()))
    context = Context()
    never = asyncio.Event()

    async def answers() -> AsyncIterator[Any]:
        yield 0
        await never.wait()  # the next answer is being computed (or the client sends nothing)
        yield 1

    async def grpc_handler() -> list[int]:
        stream = servicer._guard_stream("ExplainStream", context, answers, sized=True)  # type: ignore[arg-type]
        return [answer async for answer in stream]

    task = asyncio.create_task(grpc_handler())
    for _ in range(10):
        await asyncio.sleep(0)
    assert servicer.end_calls() == 1
    assert await asyncio.wait_for(task, 60) == [0]
    assert context.code is grpc.StatusCode.UNAVAILABLE
