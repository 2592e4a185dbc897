"""A client's life against a real sidecar (or the scripted server): closed while a run goes on,
closed before ``wait_ready``, garbage collected without ``close``, an ``AsyncClient`` used from
another event loop; and runs of ``explain_many`` that meet an item that is not a text."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
import warnings
import weakref
from typing import Any

import grpc
import pytest

from limelight_client import AsyncClient, Client
from limelight_client.errors import Cancelled
from tests.client.llc_scripted import ScriptedServer
from tests.conftest import RunningSidecar

#: How long a check waits for what it expects before it fails (no timing is asserted).
PATIENCE_S = 60.0

TEXTS = [f"text number {i}" for i in range(9)]


def _watchdogs() -> int:
    return sum(t.name == "limelight-lane-watchdog" for t in threading.enumerate())


def test_a_stream_client_collected_unclosed_releases_its_streams_and_threads(
    sidecar: RunningSidecar,
) -> None:
    before = _watchdogs()
    client = Client(sidecar.target, timeout=60, single_calls="stream")
    assert client.explain("a fine film").label
    (lane,) = client._connections.open[0].lanes  # the idle stream the call left open
    call = lane._call
    gone = weakref.ref(client)
    assert _watchdogs() == before + 1
    with pytest.warns(ResourceWarning, match="unclosed Client"):
        del client
        gc.collect()
    assert gone() is None
    deadline = time.monotonic() + PATIENCE_S
    while (_watchdogs() > before or not call.done()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert call.done(), "the pooled stream is still open"
    assert _watchdogs() == before, "the watchdog thread is still running"


#: What an ``AsyncClient`` collected unclosed warns, the fix included.
UNCLOSED_ASYNC = (
    r"unclosed AsyncClient\(.*\): close it \(`await client\.close\(\)`, or use it in `async with`\)"
)


async def _until(done: Any, what: str) -> None:
    """Wait, in the event loop, until ``done()`` is true (``PATIENCE_S`` at most)."""
    deadline = time.monotonic() + PATIENCE_S
    while not done():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
@pytest.mark.parametrize("single_calls", ["unary", "stream"])
async def test_an_async_client_collected_unclosed_warns_and_closes_its_channel(
    scripted: ScriptedServer, single_calls: Any
) -> None:
    """Its loop still running: the channel is closed, the pooled stream ended as ``close``
    ends it (gracefully: OK, not CANCELLED)."""
    client = AsyncClient(scripted.target, timeout=60, single_calls=single_calls)
    assert (await client.explain("a fine film")).label
    conn = client._connections.open[0]
    channel = conn.channel
    calls = [lane._call for lane in conn.lanes]  # the idle stream the call left open
    assert len(calls) == (single_calls == "stream")
    gone = weakref.ref(client)
    del conn
    with pytest.warns(ResourceWarning, match=UNCLOSED_ASYNC):
        del client
        gc.collect()
    assert gone() is None
    await _until(
        lambda: channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN,
        "the channel is still open",
    )
    for call in calls:
        assert call.done(), "the pooled stream is still open"
        assert await call.code() is grpc.StatusCode.OK


@pytest.mark.asyncio
async def test_an_async_client_dropped_in_another_thread_is_closed_in_its_own_loop(
    scripted: ScriptedServer,
) -> None:
    """The last reference goes in another thread: the close is handed to the client's loop."""
    client = AsyncClient(scripted.target, timeout=60, single_calls="stream")
    assert (await client.explain("a fine film")).label
    channel = client._connections.open[0].channel
    (lane,) = client._connections.open[0].lanes
    call = lane._call
    held = [client]
    del client, lane

    def drop() -> list[warnings.WarningMessage]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            held.clear()
            gc.collect()
        return caught

    caught = await asyncio.to_thread(drop)
    assert [str(w.message) for w in caught if w.category is ResourceWarning]
    await _until(call.done, "the pooled stream is still open")
    await _until(
        lambda: channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN,
        "the channel is still open",
    )


@pytest.mark.asyncio
async def test_a_closed_async_client_collected_warns_nothing(scripted: ScriptedServer) -> None:
    async with AsyncClient(scripted.target, timeout=60, single_calls="stream") as client:
        assert (await client.explain("a fine film")).label
    holder = {"client": client}
    del client
    assert resource_warnings_as_collected(holder) == []


def resource_warnings_as_collected(holder: dict[str, AsyncClient]) -> list[str]:
    """The ``ResourceWarning``s raised as the only reference to a client (``holder``'s) is
    dropped and collected; fails unless the client is gone then."""
    gone = weakref.ref(holder["client"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        holder.clear()
        gc.collect()
    assert gone() is None
    return [str(w.message) for w in caught if w.category is ResourceWarning]


def test_an_async_client_collected_after_its_loop_closed_warns_and_raises_nothing(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``asyncio.run`` closed the loop its channels and stream belong to: nothing can be
    ended from the finalizer then, and nothing may be raised from it."""
    made: dict[str, AsyncClient] = {}

    async def first() -> str:
        made["client"] = AsyncClient(scripted.target, timeout=60, single_calls="stream")
        return (await made["client"].explain("a fine film")).label

    assert asyncio.run(first())
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    gone = weakref.ref(made["client"])
    with pytest.warns(ResourceWarning, match=UNCLOSED_ASYNC):
        made.clear()
        gc.collect()
    assert gone() is None
    assert not unraisable, [u.exc_value for u in unraisable]


def _closing_midway(client: Any, texts: list[str], after: int) -> Any:
    """Answers of a packed run over ``texts``, closing ``client`` after ``after`` of them."""
    got = 0
    for _ in client.explain_many(texts, texts_per_call=64):
        got += 1
        if got == after:
            client.close()
    return got


def test_close_during_a_packed_run_raises_cancelled(sidecar: RunningSidecar) -> None:
    """The run has sent its first calls; closed after the first answer, its next call is
    made on a closed channel: ``Cancelled``, not grpc's ``ValueError``."""
    texts = [f"review {i}" for i in range(64 * 6)]
    client = Client(sidecar.target, timeout=60)
    with pytest.raises(Cancelled):
        _closing_midway(client, texts, after=1)


@pytest.mark.asyncio
async def test_close_during_an_async_packed_run_raises_cancelled(
    sidecar: RunningSidecar,
) -> None:
    texts = [f"review {i}" for i in range(64 * 6)]
    client = AsyncClient(sidecar.target, timeout=60)
    with pytest.raises(Cancelled):
        async for _ in client.explain_many(texts, texts_per_call=64):
            await client.close()


#: Calls an ``AsyncClient`` may have in flight when another task closes it, each left
#: unanswered by the scripted server (its "stall" text, its "hang" job).
IN_FLIGHT = ["explain unary", "explain stream", "explain_many", "job.watch"]


async def _unanswered(client: AsyncClient, kind: str, seen: list[Any]) -> None:
    """A call of ``kind`` (``IN_FLIGHT``) that the scripted server does not answer (in full);
    what it yields meanwhile goes to ``seen``."""
    if kind.startswith("explain "):
        await client.explain("stall")
    elif kind == "explain_many":
        async for r in client.explain_many(["a fine film", "stall"]):
            seen.append(r)
    else:
        job = await client.submit("a fine film", "hang")
        async for info in job.watch():
            seen.append(info)


async def _held_by_the_server(
    scripted: ScriptedServer, kind: str, seen: list[Any], task: asyncio.Task[None]
) -> None:
    """Wait until the call of ``task`` (``_unanswered``) waits for its answer (or ended)."""

    def held() -> bool:
        if kind == "explain unary":
            return bool(scripted.servicer.calls_to("Explain"))
        if kind == "job.watch":
            return bool(seen)  # the job's first state came: the watch waits for the next
        return any(r.text == "stall" for r in scripted.servicer.streamed)

    await _until(lambda: held() or task.done(), "the call never reached the server")


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", IN_FLIGHT)
async def test_close_cuts_an_async_call_in_flight_with_cancelled(
    scripted: ScriptedServer, kind: str
) -> None:
    """Another task closes the client: the call raises ``Cancelled`` as the sync client's
    does, not the ``asyncio.CancelledError`` grpc.aio ends it with (which would read as the
    task itself cancelled, and pass by ``except Exception``)."""
    single_calls: Any = "stream" if kind == "explain stream" else "unary"
    client = AsyncClient(scripted.target, timeout=60, single_calls=single_calls)
    seen: list[Any] = []
    task = asyncio.create_task(_unanswered(client, kind, seen))
    await _held_by_the_server(scripted, kind, seen, task)
    await client.close()
    await asyncio.wait([task])
    assert not task.cancelled(), "a bare CancelledError, in a task nobody cancelled"
    error = task.exception()
    assert isinstance(error, Cancelled), repr(error)
    assert "this client is closed" in str(error)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", IN_FLIGHT)
async def test_a_task_cancelled_as_its_client_closes_is_cancelled(
    scripted: ScriptedServer, kind: str
) -> None:
    """A real ``Task.cancel`` still propagates as ``CancelledError``, the client closed or not."""
    single_calls: Any = "stream" if kind == "explain stream" else "unary"
    client = AsyncClient(scripted.target, timeout=60, single_calls=single_calls)
    seen: list[Any] = []
    task = asyncio.create_task(_unanswered(client, kind, seen))
    await _held_by_the_server(scripted, kind, seen, task)
    task.cancel()
    await client.close()
    await asyncio.wait([task])
    assert task.cancelled(), repr(task.exception())


def test_an_async_client_whose_loop_ended_can_be_closed(scripted: ScriptedServer) -> None:
    """``asyncio.run`` ended the loop its channels belonged to (and took them): closing it
    from another loop marks it closed, without an error or a later ``ResourceWarning``."""
    made: dict[str, AsyncClient] = {}

    async def first() -> str:
        made["client"] = AsyncClient(scripted.target, timeout=60, single_calls="stream")
        return (await made["client"].explain("a fine film")).label

    assert asyncio.run(first())
    client = made.pop("client")
    asyncio.run(client.close())
    assert client._connections.closed
    made["client"] = client
    del client
    unclosed = resource_warnings_as_collected(made)
    # (Other warnings may come of what earlier tests left for the collector.)
    assert not [m for m in unclosed if "AsyncClient" in m], unclosed


def test_an_async_client_made_with_no_event_loop_says_where_to_make_it(
    scripted: ScriptedServer,
) -> None:
    """After an ``asyncio.run`` the thread has no default loop for grpc.aio to bind to."""

    async def nothing() -> None:
        pass

    asyncio.run(nothing())
    with pytest.raises(RuntimeError, match="no event loop to make this AsyncClient in") as e:
        AsyncClient(scripted.target)
    assert "one event loop only" in str(e.value)
    assert "async with AsyncClient(...) as client:" in str(e.value)


def test_wait_ready_on_a_closed_client_raises_cancelled_at_once(sidecar: RunningSidecar) -> None:
    client = Client(sidecar.target)
    client.close()
    with pytest.raises(Cancelled):
        client.wait_ready(timeout=PATIENCE_S)


@pytest.mark.asyncio
async def test_async_wait_ready_on_a_closed_client_raises_cancelled(
    sidecar: RunningSidecar,
) -> None:
    client = AsyncClient(sidecar.target)
    await client.close()
    with pytest.raises(Cancelled):
        await client.wait_ready(timeout=PATIENCE_S)


def test_an_async_client_used_in_another_event_loop_says_so(sidecar: RunningSidecar) -> None:
    """Two ``asyncio.run`` calls are two event loops (so this test runs them itself)."""
    made: dict[str, AsyncClient] = {}

    async def first() -> str:
        made["client"] = AsyncClient(sidecar.target, timeout=60)
        return (await made["client"].explain("a fine film")).label

    assert asyncio.run(first())
    with pytest.raises(RuntimeError, match="one event loop only") as wrong:
        asyncio.run(made["client"].explain("a fine film"))
    assert "now closed" in str(wrong.value)

    async def batch() -> Any:
        return [r async for r in made["client"].explain_many(["a", "b"], texts_per_call=2)]

    with pytest.raises(RuntimeError, match="one event loop only"):
        asyncio.run(batch())


def test_packed_run_answers_the_items_before_one_that_is_not_a_text(
    sidecar: RunningSidecar,
) -> None:
    with Client(sidecar.target, timeout=60) as client:
        for per_call in (1, 4, 16):
            got: list[str | None] = []
            with pytest.raises(TypeError):
                for r in client.explain_many([*TEXTS, 3], texts_per_call=per_call):  # type: ignore[list-item]
                    got.append(r.text)
            assert got == TEXTS, per_call

        def lazily() -> Any:
            yield from TEXTS
            yield 3
            yield "never sent"

        got = []
        with pytest.raises(TypeError):
            for r in client.explain_many(lazily(), texts_per_call=4):
                got.append(r.text)
        assert got == TEXTS


@pytest.mark.asyncio
async def test_async_packed_run_answers_the_items_before_one_that_is_not_a_text(
    sidecar: RunningSidecar,
) -> None:
    async with AsyncClient(sidecar.target, timeout=60) as client:
        for per_call in (1, 4, 16):
            got: list[str | None] = []
            with pytest.raises(TypeError):
                async for r in client.explain_many([*TEXTS, 3], texts_per_call=per_call):  # type: ignore[list-item]
                    got.append(r.text)
            assert got == TEXTS, per_call


def test_submit_refuses_a_text_that_is_not_a_str(sidecar: RunningSidecar) -> None:
    with Client(sidecar.target, timeout=60) as client:
        with pytest.raises(TypeError, match="text must be a str"):
            client.submit(None, "random")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="text_pair must be a str"):
            client.submit("a film", "random", text_pair=3)  # type: ignore[arg-type]
