"""``single_calls="stream"``: single ``explain`` calls as messages on pooled ``ExplainStream``
calls — the same answers and errors as unary calls, one stream reused by calls one after
another, one input in flight per stream, deadlines and retries kept; against the real sidecar
and, for failures no real server produces on demand, the scripted one."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from limelight_client import AsyncClient, Client, Explanation, _common, _lanes
from limelight_client.errors import DeadlineExceeded, InvalidArgument, Unavailable
from limelight_client.proto import explainer_pb2 as pb
from tests.client.llc_scripted import Placement, ScriptedServer
from tests.conftest import RunningSidecar

TEXTS = ["a gorgeous, moving film", "an unwatchable, overwrought misfire of a film", "fine."]


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(sidecar: RunningSidecar) -> Samples:
    body = urllib.request.urlopen(sidecar.metrics_url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def count(values: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in values.items() if n == name and set(labels.items()) <= set(ls))


def same(a: Explanation, b: Explanation) -> None:
    assert a.label == b.label and a.method == b.method
    assert [t.text for t in a.tokens] == [t.text for t in b.tokens]
    # Batched with other inputs or alone: equal to float noise.
    assert a.scores == pytest.approx(b.scores, rel=1e-4, abs=1e-4)
    assert a.probabilities == pytest.approx(b.probabilities, abs=1e-5)


def test_invalid_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="single_calls"):
        Client("127.0.0.1:1", single_calls="datagram")  # type: ignore[arg-type]


def test_sync_answers_and_errors_match_unary_calls(sidecar: RunningSidecar) -> None:
    before = samples(sidecar)
    with (
        Client(sidecar.target, timeout=60) as unary,
        Client(sidecar.target, timeout=60, single_calls="stream") as streamed,
    ):
        for text in TEXTS:
            same(streamed.explain(text), unary.explain(text))
        same(
            streamed.explain("good", text_pair="bad", target="rotten", all_classes=True),
            unary.explain("good", text_pair="bad", target="rotten", all_classes=True),
        )
        assert streamed.explain("good", request_id="mine-1").request_id == "mine-1"
        # A refused input raises what a unary call raises, and the stream goes on serving.
        with pytest.raises(InvalidArgument, match="text is empty"):
            streamed.explain("")
        with pytest.raises(InvalidArgument, match="unknown label"):
            streamed.explain("good", target="meh")
        same(streamed.explain(TEXTS[0]), unary.explain(TEXTS[0]))
        # Calls one after another reuse one stream.
        assert len(streamed._connections.open[0].lanes) == 1
    after = samples(sidecar)
    # The streamed inputs never made an Explain call.
    explain_calls = count(after, "limelight_request_duration_seconds_count", rpc="Explain")
    explain_calls -= count(before, "limelight_request_duration_seconds_count", rpc="Explain")
    assert explain_calls == len(TEXTS) + 2  # the unary client's only
    errors = count(after, "limelight_item_errors_total", rpc="ExplainStream")
    assert errors - count(before, "limelight_item_errors_total", rpc="ExplainStream") == 2


def test_async_answers_and_errors_match_unary_calls(sidecar: RunningSidecar) -> None:
    async def run() -> None:
        async with (
            AsyncClient(sidecar.target, timeout=60) as unary,
            AsyncClient(sidecar.target, timeout=60, single_calls="stream") as streamed,
        ):
            for text in TEXTS:
                same(await streamed.explain(text), await unary.explain(text))
            with pytest.raises(InvalidArgument, match="text is empty"):
                await streamed.explain("")
            assert len(streamed._connections.open[0].lanes) == 1
            # Concurrent calls each take a stream of their own: answers stay with their text.
            texts = [f"{TEXTS[i % 3]} take {i}" for i in range(12)]
            got = await asyncio.gather(*(streamed.explain(t) for t in texts))
            assert [e.text for e in got] == texts
            lanes = len(streamed._connections.open[0].lanes)
            assert 1 < lanes <= len(texts)
            for text, e in zip(texts, got, strict=True):
                same(e, await unary.explain(text))

    asyncio.run(run())


def test_concurrent_threads_share_the_pool(sidecar: RunningSidecar) -> None:
    texts = [f"{TEXTS[i % 3]}, take {i}" for i in range(40)]
    results: dict[int, Explanation] = {}
    with Client(sidecar.target, timeout=60, single_calls="stream") as client:

        def work(k: int) -> None:
            for i in range(k, len(texts), 4):
                results[i] = client.explain(texts[i])

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 1 <= len(client._connections.open[0].lanes) <= 4
    assert [results[i].text for i in range(len(texts))] == texts


def test_each_input_asks_for_its_error_in_place_and_carries_its_budget(
    scripted: ScriptedServer,
) -> None:
    # Without a deadline the input carries no budget; with one, a budget (its size is the time
    # left when sent: checked exactly on ``lane_request`` below, not against a clock).
    with Client(scripted.target, timeout=None, single_calls="stream") as client:
        client.explain("one")
        client.explain("two", timeout=5)
    assert len(scripted.servicer.calls_to("ExplainStream")) == 1  # one stream for both
    first, second = scripted.servicer.streamed
    assert first.continue_on_error and second.continue_on_error
    assert first.timeout_seconds == 0
    assert second.timeout_seconds > 0


def test_lane_request_sets_the_flag_and_the_time_left_as_the_budget() -> None:
    sent = _lanes.lane_request(pb.ExplainRequest(text="a"), 2.5)
    assert sent.continue_on_error and sent.timeout_seconds == 2.5
    unbounded = _lanes.lane_request(pb.ExplainRequest(text="a", timeout_seconds=9.0), None)
    assert unbounded.continue_on_error and unbounded.timeout_seconds == 0


@pytest.fixture(params=["sync", "asyncio"])
def explain(
    request: pytest.FixtureRequest, scripted: ScriptedServer
) -> Iterator[Callable[..., Explanation]]:
    """``explain(text, **kwargs)`` through a streamed client of either kind (retries 2)."""
    if request.param == "sync":
        with Client(scripted.target, retries=2, backoff=0.01, single_calls="stream") as client:
            yield client.explain
        return
    loop = asyncio.new_event_loop()
    aclient = loop.run_until_complete(_async_client(scripted.target))
    yield lambda text, **kw: loop.run_until_complete(aclient.explain(text, **kw))
    loop.run_until_complete(aclient.close())
    loop.close()


async def _async_client(target: str) -> AsyncClient:
    return AsyncClient(target, retries=2, backoff=0.01, single_calls="stream")


def test_a_stream_that_stops_answering_fails_at_the_deadline(
    explain: Callable[..., Explanation], scripted: ScriptedServer
) -> None:
    with pytest.raises(DeadlineExceeded):
        # The stream must reach the server (it is counted below) within the deadline: a
        # second of slack for a busy machine.
        explain("stall", timeout=1.0)
    # The stalled stream is given up; the next call opens another.
    assert explain("after").text == "after"
    assert len(scripted.servicer.calls_to("ExplainStream")) == 2


def test_a_stream_ended_with_unavailable_is_retried_on_a_new_one(
    explain: Callable[..., Explanation], scripted: ScriptedServer
) -> None:
    assert explain("warm").text == "warm"
    assert explain("drop me").text == "drop me"  # the first stream fails, a second answers
    assert len(scripted.servicer.calls_to("ExplainStream")) == 2
    assert [r.text for r in scripted.servicer.streamed] == ["warm", "drop me", "drop me"]


def test_a_stream_ended_without_an_answer_is_retried_then_unavailable(
    explain: Callable[..., Explanation], scripted: ScriptedServer
) -> None:
    with pytest.raises(Unavailable, match="ended the stream"):
        explain("hang up", timeout=10)
    assert len(scripted.servicer.calls_to("ExplainStream")) == 3  # the first try and 2 retries


def test_closing_the_client_ends_its_idle_streams_gracefully(scripted: ScriptedServer) -> None:
    # Ended by the server after their input was closed (OK), not cut by the channel's close
    # (which the sidecar's metrics would count as CANCELLED).
    client = Client(scripted.target, single_calls="stream")
    client.explain("one")
    lanes = list(client._connections.open[0].lanes)
    assert lanes and all(lane.usable() for lane in lanes)
    client.close()
    assert not client._connections.open[0].lanes
    assert lanes[0]._call.code() == grpc.StatusCode.OK

    async def run() -> None:
        aclient = AsyncClient(scripted.target, single_calls="stream")
        await aclient.explain("two")
        (lane,) = aclient._connections.open[0].lanes
        await aclient.close()
        assert await lane._call.code() == grpc.StatusCode.OK

    asyncio.run(run())


def test_an_old_stream_is_ended_gracefully_and_replaced(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stream would keep its connection past the server's GOAWAY (max_connection_age_s),
    # where unary calls move on: lanes are renewed. Young for as long as a busy machine takes
    # over the second call, then old after a sleep longer than the age.
    monkeypatch.setattr(_lanes, "LANE_MAX_AGE_S", 60.0)
    with Client(scripted.target, single_calls="stream") as client:
        client.explain("one")
        (old,) = client._connections.open[0].lanes
        client.explain("two")
        assert client._connections.open[0].lanes == [old]  # young: reused
        monkeypatch.setattr(_lanes, "LANE_MAX_AGE_S", 0.3)
        time.sleep(0.4)
        client.explain("three")
        (new,) = client._connections.open[0].lanes
        assert new is not old
        # The old stream's input was ended, not cancelled: the server closed it with OK.
        ended = threading.Event()
        old._call.add_done_callback(lambda _: ended.set())
        assert ended.wait(10)
        assert old._call.code() == grpc.StatusCode.OK
    assert len(scripted.servicer.calls_to("ExplainStream")) == 2

    async def run() -> None:
        async with AsyncClient(scripted.target, single_calls="stream") as client:
            await client.explain("four")
            (old,) = client._connections.open[0].lanes
            await asyncio.sleep(0.4)
            await client.explain("five")
            assert client._connections.open[0].lanes != [old]
            assert await old._call.code() == grpc.StatusCode.OK

    asyncio.run(run())
    assert len(scripted.servicer.calls_to("ExplainStream")) == 4


def test_a_connection_replaced_by_spreading_ends_its_idle_streams_gracefully(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two connections spread over workers a and b, an idle stream on each; b's connection
    then re-established on a: the next look replaces one of the two, and its idle stream is
    ended (OK on the server), not cut by the channel's close (CANCELLED)."""
    monkeypatch.setattr(_common, "SPREAD_RECHECK_S", 0.0)  # look before every explanation

    def move_b_to_a(placement: Placement) -> None:
        on_b = next(peer for peer, worker in placement.of.items() if worker == "b")
        placement.of[on_b] = "a"

    placement = Placement(["a", "b", "b-restarted"])
    scripted.servicer.instance_of, scripted.servicer.workers = placement, 2
    with Client(scripted.target, connections=2, single_calls="stream") as client:
        client.explain("one")
        client.explain("two")  # the next connection in turn: a stream idle on each
        lanes = _idle(client)
        assert len(lanes) == 2
        move_b_to_a(placement)
        client.explain("three")
        ended = threading.Event()
        (lane,) = [lane for lane in lanes if lane not in _idle(client)]
        lane._call.add_done_callback(lambda _: ended.set())
        assert ended.wait(10)
        assert lane._call.code() == grpc.StatusCode.OK

    async def run() -> None:
        placement = Placement(["a", "b", "b-restarted"])
        scripted.servicer.instance_of = placement
        async with AsyncClient(scripted.target, connections=2, single_calls="stream") as client:
            await client.explain("four")
            await client.explain("five")
            lanes = _idle(client)
            assert len(lanes) == 2
            move_b_to_a(placement)
            await client.explain("six")
            (lane,) = [lane for lane in lanes if lane not in _idle(client)]
            assert await asyncio.wait_for(lane._call.code(), 10) == grpc.StatusCode.OK

    asyncio.run(run())


def _idle(client: Client | AsyncClient) -> list[Any]:
    """The idle streams of the client's current connections."""
    return [lane for conn in client._connections.open for lane in conn.lanes]
