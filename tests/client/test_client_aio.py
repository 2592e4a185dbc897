"""The asyncio client against the same scripted real gRPC server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
import pytest

from limelight_client import AsyncClient, JobState, errors
from tests.client.llc_scripted import ScriptedServer

TEXT = "The movie wasn't bad at all!"
T = TypeVar("T")


def run(scripted: ScriptedServer, body: Callable[[AsyncClient], Awaitable[T]], **kw: object) -> T:
    """Run ``body`` with a fresh AsyncClient inside its own event loop."""

    async def main() -> T:
        kw.setdefault("backoff", 0.01)
        async with AsyncClient(scripted.target, **kw) as client:  # type: ignore[arg-type]
            return await body(client)

    return asyncio.run(main())


def test_explain_model_drift(scripted: ScriptedServer) -> None:
    async def body(c: AsyncClient) -> None:
        exp = await c.explain(TEXT, target=1, all_classes=True)
        assert exp.text == TEXT and exp.target_label == "positive"
        assert exp.class_scores is not None
        assert (await c.model()).default_method == "normxlogit"
        assert (await c.drift(top_k=3)).label("positive").alert

    run(scripted, body)
    assert scripted.servicer.calls_to("GetDrift")[0].request.top_k == 3


def test_retries_unavailable(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("Explain", grpc.StatusCode.UNAVAILABLE, times=2)

    async def body(c: AsyncClient) -> str:
        return (await c.explain(TEXT)).label

    assert run(scripted, body, retries=2) == "negative"
    assert len(scripted.servicer.calls_to("Explain")) == 3


def test_gives_up_and_maps_errors(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("Explain", grpc.StatusCode.UNAVAILABLE, times=5)
    scripted.servicer.fail("GetModel", grpc.StatusCode.RESOURCE_EXHAUSTED, msg="queue full")

    async def body(c: AsyncClient) -> None:
        with pytest.raises(errors.Unavailable):
            await c.explain(TEXT)
        with pytest.raises(errors.ResourceExhausted, match="queue full"):
            await c.model()

    run(scripted, body, retries=1)
    assert len(scripted.servicer.calls_to("Explain")) == 2
    assert len(scripted.servicer.calls_to("GetModel")) == 1


def test_deadline_and_token(scripted: ScriptedServer) -> None:
    scripted.servicer.required_token = "tok"
    scripted.servicer.delays["GetModel"] = 0.5

    async def body(c: AsyncClient) -> None:
        with pytest.raises(errors.DeadlineExceeded):
            await c.model()
        assert (await c.model(timeout=5)).name == "tiny"

    run(scripted, body, token="tok", timeout=0.1)
    calls = scripted.servicer.calls_to("GetModel")
    assert len(calls) == 2
    assert all(call.metadata["authorization"] == "Bearer tok" for call in calls)


def test_explain_many_sync_and_async_inputs(scripted: ScriptedServer) -> None:
    texts = [f"text {i} " + "x " * i for i in range(12)]

    async def agen() -> AsyncIterator[str]:
        for t in texts:
            await asyncio.sleep(0)
            yield t

    async def body(c: AsyncClient) -> tuple[list[str | None], list[str | None]]:
        a = [e.text async for e in c.explain_many(texts)]
        b = [e.text async for e in c.explain_many(agen())]
        return a, b

    a, b = run(scripted, body)
    assert a == texts and b == texts


def test_explain_many_server_error(scripted: ScriptedServer) -> None:
    async def body(c: AsyncClient) -> list[str | None]:
        got: list[str | None] = []
        with pytest.raises(errors.InvalidArgument, match="boom"):
            # Nothing is sent after "boom": when the server aborts while grpc.aio is still
            # writing requests, grpc-core may report INTERNAL instead of the server's status.
            async for e in c.explain_many(["ok", "boom"]):
                got.append(e.text)
        return got

    assert run(scripted, body) == ["ok"]


def test_jobs(scripted: ScriptedServer) -> None:
    async def body(c: AsyncClient) -> None:
        job = await c.submit(TEXT, "ok", n_samples=10)
        states = [i.state async for i in job.watch()]
        assert states == [JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED]
        exp = await job.result()
        assert exp.text == TEXT and exp.method == "ok"

        flaky = await c.submit(TEXT, "flaky")
        assert (await flaky.result(timeout=10)).method == "flaky"

        failing = await c.submit(TEXT, "boom")
        with pytest.raises(errors.JobFailed, match="out of memory"):
            await failing.result(timeout=10)

        hanging = await c.submit(TEXT, "hang")
        with pytest.raises(TimeoutError):
            await hanging.result(timeout=0.2)
        assert (await hanging.cancel()).state is JobState.CANCELLED
        with pytest.raises(errors.JobCancelled):
            await (await c.job(hanging.id)).result()

        listed = await c.jobs(states="cancelled")
        assert [j.id for j in listed] == [hanging.id]
        with pytest.raises(errors.NotFound):
            await c.job("missing")

    run(scripted, body)
    keys = [c.request.idempotency_key for c in scripted.servicer.calls_to("SubmitJob")]
    assert len(set(keys)) == 4 and all(keys)


def test_explain_many_bad_item(scripted: ScriptedServer) -> None:
    async def body(c: AsyncClient) -> None:
        with pytest.raises(TypeError):
            async for _ in c.explain_many(["fine", 42]):  # type: ignore[list-item]
                pass

    run(scripted, body)
