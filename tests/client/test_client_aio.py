"""The asyncio client against the same scripted real gRPC server."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from limelight_client import AsyncClient, JobState, _common, errors
from tests.client.llc_scripted import AnswersOutOfOrder, Placement, ScriptedServer, start_server

pytestmark = pytest.mark.asyncio

TEXT = "The movie wasn't bad at all!"


@asynccontextmanager
async def connect(scripted: ScriptedServer, **kw: object) -> AsyncIterator[AsyncClient]:
    """A fresh AsyncClient on the scripted server (fast retry backoff unless given)."""
    kw.setdefault("backoff", 0.01)
    async with AsyncClient(scripted.target, **kw) as client:  # type: ignore[arg-type]
        yield client


async def test_explain_model_drift(scripted: ScriptedServer) -> None:
    async with connect(scripted) as c:
        exp = await c.explain(TEXT, target=1, all_classes=True)
        assert exp.text == TEXT and exp.target_label == "positive"
        assert exp.class_scores is not None
        assert (await c.model()).default_method == "normxlogit"
        assert (await c.drift(top_k=3)).label("positive").alert
    assert scripted.servicer.calls_to("GetDrift")[0].request.top_k == 3


async def test_retries_unavailable(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("Explain", grpc.StatusCode.UNAVAILABLE, times=2)
    async with connect(scripted, retries=2) as c:
        assert (await c.explain(TEXT)).label == "negative"
        assert len(c._connections.every_channel()) == 1  # the replaced ones were closed
    calls = scripted.servicer.calls_to("Explain")
    # Each retry on a newly dialled connection: a draining worker answers again on its own.
    assert len(calls) == 3 and len({call.peer for call in calls}) == 3


async def test_gives_up_and_maps_errors(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("Explain", grpc.StatusCode.UNAVAILABLE, times=5)
    scripted.servicer.fail("GetModel", grpc.StatusCode.RESOURCE_EXHAUSTED, msg="queue full")
    async with connect(scripted, retries=1) as c:
        with pytest.raises(errors.Unavailable):
            await c.explain(TEXT)
        with pytest.raises(errors.ResourceExhausted, match="queue full"):
            await c.model()
    assert len(scripted.servicer.calls_to("Explain")) == 2
    assert len(scripted.servicer.calls_to("GetModel")) == 1


async def test_deadline_and_token(scripted: ScriptedServer) -> None:
    # The first call must reach the server (it is counted below) before its 1 s deadline, and
    # the 2 s delay must outlast that deadline: a second of slack each way for a busy machine.
    scripted.servicer.required_token = "tok"
    scripted.servicer.delays["GetModel"] = 2.0
    async with connect(scripted, token="tok", timeout=1.0) as c:
        with pytest.raises(errors.DeadlineExceeded):
            await c.model()
        assert (await c.model(timeout=30)).name == "tiny"
    calls = scripted.servicer.calls_to("GetModel")
    assert len(calls) == 2
    assert all(call.metadata["authorization"] == "Bearer tok" for call in calls)


async def test_an_infinite_timeout_is_no_deadline(scripted: ScriptedServer) -> None:
    async with connect(scripted, timeout=math.inf) as c:
        await c.explain(TEXT)
        assert c.timeout is None
    async with connect(scripted, timeout=10) as c:
        await c.model(timeout=math.inf)
        await c.explain(TEXT, timeout=math.inf)
        assert len([r async for r in c.explain_many([TEXT, TEXT], timeout=math.inf)]) == 2
        job = await c.submit(TEXT, "ok")
        assert (await job.result(timeout=math.inf)).text == TEXT
    for method in ("Explain", "GetModel", "ExplainStream"):
        # No deadline sent: the server reads one centuries away.
        for call in scripted.servicer.calls_to(method):
            assert call.time_remaining is not None and call.time_remaining > 1e9, call


@pytest.mark.parametrize("timeout", [math.nan, -1.0])
async def test_a_timeout_no_deadline_can_mean_is_refused(
    scripted: ScriptedServer, timeout: float
) -> None:
    said = "timeout must be a number of seconds >= 0, or None"
    with pytest.raises(ValueError, match=said):
        AsyncClient(scripted.target, timeout=timeout)
    async with connect(scripted) as c:
        job = await c.submit(TEXT, "hang")
        with pytest.raises(ValueError, match=said):
            await c.explain(TEXT, timeout=timeout)
        with pytest.raises(ValueError, match=said):
            await job.result(timeout=timeout)
        with pytest.raises(ValueError, match=said):
            await c.wait_ready(timeout=timeout)
    assert not scripted.servicer.calls_to("Explain")


@pytest.mark.parametrize("connections", [1, 3])
async def test_explain_many_sync_and_async_inputs(
    scripted: ScriptedServer, connections: int
) -> None:
    texts = [f"text {i} " + "x " * i for i in range(12)]

    async def agen() -> AsyncIterator[str]:
        for t in texts:
            await asyncio.sleep(0)
            yield t

    async with connect(scripted, connections=connections) as c:
        a = [e.text async for e in c.explain_many(texts)]
        b = [e.text async for e in c.explain_many(agen())]
        assert [e.text async for e in c.explain_many([])] == []
    assert a == texts and b == texts
    # The first two calls: a stream on each connection. (Of the empty call's streams, some may
    # be cancelled before they reach the server: nothing was sent on them.)
    streams = scripted.servicer.calls_to("ExplainStream")[: 2 * connections]
    assert len(streams) == 2 * connections
    assert len({s.peer for s in streams}) == connections
    assert sorted(s.request for s in streams[:connections]) == sorted(
        texts[k::connections] for k in range(connections)
    )


async def test_connections_are_spread_over_the_workers(scripted: ScriptedServer) -> None:
    """As with ``Client``: three connections on worker a of three re-dialled until each
    worker has one; the replaced channels are closed; a token goes with the questions."""
    placement = Placement(["a", "a", "a", "b", "a", "c"])
    scripted.servicer.instance_of, scripted.servicer.workers = placement, 3
    async with connect(scripted, connections=3, token="tok") as c:
        texts = [f"review {i}" for i in range(9)]
        assert [e.text async for e in c.explain_many(texts)] == texts
        assert len(c._connections.every_channel()) == 3
        for _ in range(3):
            await c.explain("a gorgeous film")
    asked = scripted.servicer.calls_to("GetModel")
    assert len(asked) == 6 and all(a.metadata["authorization"] == "Bearer tok" for a in asked)
    streams = scripted.servicer.calls_to("ExplainStream")
    assert sorted(placement.of[s.peer] for s in streams) == ["a", "b", "c"]
    explained = {call.peer for call in scripted.servicer.calls_to("Explain")}
    assert explained == {s.peer for s in streams}


async def test_a_moved_connection_is_spread_again_and_one_in_use_closed_after_its_stream(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As with ``Client``: b restarts and its connection is re-established on a while a stream
    uses it; the next look dials until it reaches the new b, and the replaced connection is
    closed when the stream ends, after its last answer."""
    monkeypatch.setattr(_common, "SPREAD_RECHECK_S", 0.0)
    placement = Placement(["a", "b", "b-restarted"])
    scripted.servicer.instance_of, scripted.servicer.workers = placement, 2
    texts = [f"review {i}" for i in range(6)]
    async with connect(scripted, connections=2) as c:
        await c.explain("a gorgeous film")  # spread already: a and b
        stream = c.explain_many(texts)
        got = [(await anext(stream)).text]
        on_b = next(peer for peer, worker in placement.of.items() if worker == "b")
        placement.of[on_b] = "a"
        await c.explain("a gorgeous film")
        assert len(c._connections.retired) == 1 and len(c._connections.every_channel()) == 3
        got += [e.text async for e in stream]
        assert got == texts
        assert not c._connections.retired and len(c._connections.every_channel()) == 2
        monkeypatch.setattr(_common, "SPREAD_RECHECK_S", 1000.0)
        await c.explain("a gorgeous film")
        await c.explain("a gorgeous film")
    last_two = [call.peer for call in scripted.servicer.calls_to("Explain")][-2:]
    assert sorted(placement.of[p] for p in last_two) == ["a", "b-restarted"]


@pytest.mark.parametrize("connections", [1, 2])
async def test_explain_many_server_error(scripted: ScriptedServer, connections: int) -> None:
    got: list[str | None] = []
    async with connect(scripted, connections=connections) as c:
        with pytest.raises(errors.InvalidArgument, match="boom"):
            # Nothing is sent after "boom": when the server aborts while grpc.aio is still
            # writing requests, grpc-core may report INTERNAL instead of the server's status.
            async for e in c.explain_many(["ok", "boom"]):
                got.append(e.text)
    assert got == ["ok"]
    assert len(scripted.servicer.calls_to("ExplainStream")) == connections  # not opened again


DROPS = ["a", "b", "drop 1", "c", "d", "e", "drop 2", "f", "g"]


@pytest.mark.parametrize("given", ["list", "async generator"])
@pytest.mark.parametrize("connections", [1, 2])
async def test_explain_many_stream_is_opened_again_after_unavailable(
    scripted: ScriptedServer, connections: int, given: str
) -> None:
    """See the sync client's test. The async generator pauses after each "drop", so the
    failed stream's request iterator is still waiting for the input's next item when the
    stream is opened again: that item must still go out, once, and the new stream waits for
    it rather than pulling past it."""

    async def slow() -> AsyncIterator[str]:
        for text in DROPS:
            yield text
            if text.startswith("drop"):
                await asyncio.sleep(0.2)

    texts = slow() if given == "async generator" else DROPS
    async with connect(scripted, connections=connections) as c:
        assert [e.text async for e in c.explain_many(texts)] == DROPS
    assert len(scripted.servicer.calls_to("ExplainStream")) == connections + 2
    assert scripted.servicer.dropped == {"drop 1", "drop 2"}


async def test_explain_many_stream_gives_up_after_its_retries(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("ExplainStream", grpc.StatusCode.UNAVAILABLE, times=10)
    async with connect(scripted, retries=2) as c:
        # The server's message, or, when grpc.aio lost it to a request being written as the
        # stream ended (see ``wrote_past_the_end``), the client's own.
        with pytest.raises(errors.Unavailable, match=r"scripted UNAVAILABLE|while a request"):
            [e async for e in c.explain_many(["a", "b"])]
    assert len(scripted.servicer.calls_to("ExplainStream")) == 3


async def test_jobs(scripted: ScriptedServer) -> None:
    async with connect(scripted) as c:
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
    keys = [c.request.idempotency_key for c in scripted.servicer.calls_to("SubmitJob")]
    assert len(set(keys)) == 4 and all(keys)


@pytest.mark.parametrize("connections", [1, 3])
async def test_explain_many_bad_item(scripted: ScriptedServer, connections: int) -> None:
    async with connect(scripted, connections=connections) as c:
        with pytest.raises(TypeError):
            async for _ in c.explain_many(["fine", 42]):  # type: ignore[list-item]
                pass


@pytest.mark.parametrize("connections", [1, 3])
async def test_explain_many_raises_the_inputs_error_after_its_items(
    scripted: ScriptedServer, connections: int
) -> None:
    async def breaks() -> AsyncIterator[str]:
        for i in range(5):
            yield f"text {i}"
        raise OSError("the input broke")

    async with connect(scripted, connections=connections) as c:
        got: list[str | None] = []
        with pytest.raises(OSError, match="the input broke"):
            async for r in c.explain_many(breaks()):
                got.append(r.text)
        assert got == [f"text {i}" for i in range(5)]
        assert [r.text async for r in c.explain_many(["again"])] == ["again"]


@pytest.mark.parametrize("connections", [1, 2])
async def test_explain_many_packed_sync_and_async_inputs(
    scripted: ScriptedServer, connections: int
) -> None:
    texts = [f"text {i} " + "x " * i for i in range(10)]

    async def agen() -> AsyncIterator[str]:
        for t in texts:
            await asyncio.sleep(0)
            yield t

    async with connect(scripted, connections=connections, spread=False) as c:
        a = [e.text async for e in c.explain_many(texts, texts_per_call=4)]
        b = [e.text async for e in c.explain_many(agen(), texts_per_call=4)]
        assert [e.text async for e in c.explain_many([], texts_per_call=4)] == []
        with pytest.raises(ValueError, match="texts_per_call"):
            c.explain_many(texts, texts_per_call=0)
    assert a == texts and b == texts
    calls = scripted.servicer.calls_to("ExplainBatch")
    assert sorted(len(call.request.requests) for call in calls) == [2, 2, 4, 4, 4, 4]
    assert len({call.peer for call in calls}) == connections
    assert not scripted.servicer.calls_to("ExplainStream")


async def test_explain_many_packed_answers_a_trickle_as_it_comes(
    scripted: ScriptedServer,
) -> None:
    more = asyncio.Event()

    async def trickle() -> AsyncIterator[str]:
        yield "first"
        yield "second"
        # Before the client asks for more input, it must have answered what it has.
        await asyncio.wait_for(more.wait(), 30)
        yield "third"

    async with connect(scripted) as c:
        it = c.explain_many(trickle(), texts_per_call=16)
        assert [(await anext(it)).text, (await anext(it)).text] == ["first", "second"]
        more.set()
        assert [e.text async for e in it] == ["third"]
        stalled = asyncio.Event()

        async def stalls() -> AsyncIterator[str]:
            yield "only"
            await stalled.wait()
            yield "never"

        # The run's deadline: long enough for "only" to be answered on a busy machine, then
        # spent waiting for input that does not come.
        it = c.explain_many(stalls(), texts_per_call=4, timeout=2.0)
        assert (await anext(it)).text == "only"
        with pytest.raises(errors.DeadlineExceeded, match="waiting for input"):
            await anext(it)
    sizes = [len(call.request.requests) for call in scripted.servicer.calls_to("ExplainBatch")]
    assert sum(sizes) == 4 and max(sizes) <= 2  # calls went with what had arrived


async def test_explain_many_packed_timeout_is_measured_from_the_last_answer(
    scripted: ScriptedServer,
) -> None:
    """The first call answered last, 2 s after it was sent, while the server answered one of
    the run's calls every 0.5 s: within the 1.5 s timeout (a whole second of slack for a busy
    machine); a call nobody answers fails the run instead of hanging it."""
    texts = [f"text {i}" for i in range(8)]
    servicer = AnswersOutOfOrder(order=["text 6", "text 4", "text 2", "text 0"], gap=0.5)
    server = start_server(servicer)
    try:
        async with connect(server, timeout=1.5) as c:
            assert [e.text async for e in c.explain_many(texts, texts_per_call=2)] == texts
            servicer.answered = 0
            assert [e.text async for e in c.explain_many(iter(texts), texts_per_call=2)] == texts
    finally:
        server.server.stop(grace=None)
    scripted.servicer.delays["ExplainBatch"] = 1.0
    async with connect(scripted, timeout=0.2, retries=3) as c:
        with pytest.raises(errors.DeadlineExceeded, match=r"none came within 0\.2 s"):
            [e async for e in c.explain_many(["a", "b"], texts_per_call=2)]
    assert len(scripted.servicer.calls_to("ExplainBatch")) == 1  # not sent again


@pytest.mark.timeout(60)  # the bug this guards against is a hang
async def test_explain_many_stream_timeout_counts_only_the_servers_silence(
    scripted: ScriptedServer,
) -> None:
    """See the sync client's tests: a stream the server stops answering fails the run after
    the client's timeout; an input and a caller slower than it, or a server that answers
    every 0.2 s, do not."""

    async def slow_input() -> AsyncIterator[str]:
        for i, text in enumerate("abc"):
            if i:
                await asyncio.sleep(1.0)
            yield text

    loop = asyncio.get_running_loop()
    start = loop.time()
    async with connect(scripted, timeout=0.8, retries=3) as c:
        assert [e.text async for e in c.explain_many(slow_input())] == list("abc")
        got: list[str | None] = []
        async for e in c.explain_many(list("abc")):
            got.append(e.text)
            await asyncio.sleep(1.0)
        assert got == list("abc")
        scripted.servicer.stream_gap = 0.2
        texts = [f"text {i}" for i in range(8)]
        assert [e.text async for e in c.explain_many(texts)] == texts
        assert loop.time() - start > 2.0  # so the timeout would have ended bounded runs
        scripted.servicer.stream_gap = 0.0
        got = []
        with pytest.raises(errors.DeadlineExceeded, match=r"none came within 0\.8 s"):
            async for e in c.explain_many(["a", "stall", "c"]):
                got.append(e.text)
    assert got == ["a"]
    assert len(scripted.servicer.calls_to("ExplainStream")) == 4  # not opened again


async def test_explain_many_packed_sends_input_that_comes_while_it_waits() -> None:
    """See the sync client's test: the second call goes out while the first waits."""
    servicer = AnswersOutOfOrder(order=["c", "a"], gap=0.0)
    server = start_server(servicer)

    async def pauses() -> AsyncIterator[str]:
        for text in ["a", "b"]:
            yield text
        await asyncio.sleep(0.2)  # a pause: the first call goes out alone
        for text in ["c", "d"]:
            yield text

    try:
        async with connect(server, timeout=10.0) as c:
            got = [e.text async for e in c.explain_many(pauses(), texts_per_call=2)]
    finally:
        server.server.stop(grace=None)
    assert got == list("abcd")


async def test_explain_many_packed_retries_and_errors(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("ExplainBatch", grpc.StatusCode.UNAVAILABLE)
    texts = [f"text {i}" for i in range(6)]
    got: list[str | None] = []
    async with connect(scripted) as c:
        assert [e.text async for e in c.explain_many(texts, texts_per_call=2)] == texts
        assert len(scripted.servicer.calls_to("ExplainBatch")) == 4  # one sent again
        with pytest.raises(errors.InvalidArgument, match="input 1: boom"):
            async for e in c.explain_many(["ok", "fine", "ok too", "boom"], texts_per_call=2):
                got.append(e.text)
    assert got == ["ok", "fine"]
