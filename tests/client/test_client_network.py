"""The sync client against a real grpc.server with scripted behaviour: retries, deadlines,
metadata, error mapping, streaming and jobs."""

from __future__ import annotations

import itertools
import math
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import pytest

from limelight.api.ports import free_port
from limelight_client import Client, JobState, _common, _streams, errors
from limelight_client._common import RetryPolicy
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc as pb_grpc
from tests.client.llc_scripted import AnswersOutOfOrder, Placement, ScriptedServer, start_server
from tests.client.test_client_errors import CLASSES

TEXT = "The movie wasn't bad at all!"


def client_for(s: ScriptedServer, **kw: object) -> Client:
    kw.setdefault("backoff", 0.01)
    return Client(s.target, **kw)  # type: ignore[arg-type]


# -- basics ------------------------------------------------------------------------------------


def test_explain_roundtrip(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        exp = c.explain(TEXT, target="positive", all_classes=True, method="normxlogit")
    req = scripted.servicer.calls_to("Explain")[0].request
    assert req.text == TEXT and req.method == "normxlogit" and req.all_classes
    assert req.target.WhichOneof("kind") == "label" and req.target.label == "positive"
    assert not req.HasField("text_pair")
    assert req.request_id  # generated for correlation
    assert exp.request_id == req.request_id
    assert exp.text == TEXT
    assert exp.target_label == "positive" and exp.class_scores is not None
    assert [t.text for t in exp.tokens if not t.special][:2] == ["The", "movie"]


def test_explain_target_index_text_pair_and_request_id(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        exp = c.explain("A man sleeps.", "Nobody sleeps.", target=0, request_id="mine")
    req = scripted.servicer.calls_to("Explain")[0].request
    assert req.target.WhichOneof("kind") == "index" and req.target.index == 0
    assert req.text_pair == "Nobody sleeps." and req.request_id == "mine"
    assert exp.text_pair == "Nobody sleeps." and exp.target_index == 0


def test_target_type_checked(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c, pytest.raises(TypeError):
        c.explain(TEXT, target=True)
    assert scripted.servicer.calls_to("Explain") == []


def test_model_and_drift(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        info = c.model()
        drift = c.drift(top_k=7)
    assert info.labels == ["negative", "positive"] and info.supports_text_pair
    assert info.method("decoded_gradcam").unavailable_reason == "no LM head"
    assert scripted.servicer.calls_to("GetDrift")[0].request.top_k == 7
    assert drift.alerts[0].label == "positive"
    assert drift.generated_at is not None and drift.generated_at.year == 2023


# -- retries and backoff -----------------------------------------------------------------------


def test_retries_unavailable_then_succeeds(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("Explain", grpc.StatusCode.UNAVAILABLE, times=2)
    with client_for(scripted, retries=3, backoff=0.05) as client:
        exp = client.explain(TEXT)
        channels = client._connections.every_channel()
    calls = scripted.servicer.calls_to("Explain")
    assert len(calls) == 3
    assert exp.label == "negative"
    # Equal-jitter backoff: the n-th wait is at least backoff * 2**n / 2.
    gaps = [b.time - a.time for a, b in itertools.pairwise(calls)]
    assert gaps[0] >= 0.025 and gaps[1] >= 0.05
    # The same request (same correlation id) is retried, each time on a newly dialled
    # connection (a worker draining for a restart would answer again on the one it has);
    # the replaced connections are closed.
    assert len({c.request.request_id for c in calls}) == 1
    assert len({c.peer for c in calls}) == 3
    assert len(channels) == 1


def test_gives_up_after_retries(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("GetModel", grpc.StatusCode.UNAVAILABLE, times=10, msg="draining")
    with client_for(scripted, retries=2) as c, pytest.raises(errors.Unavailable) as info:
        c.model()
    assert len(scripted.servicer.calls_to("GetModel")) == 3
    assert info.value.message == "draining"
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_no_retries_when_disabled(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("Explain", grpc.StatusCode.UNAVAILABLE, times=1)
    with client_for(scripted, retries=0) as c, pytest.raises(errors.Unavailable):
        c.explain(TEXT)
    assert len(scripted.servicer.calls_to("Explain")) == 1


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.FAILED_PRECONDITION,
    ],
)
def test_other_codes_are_not_retried(scripted: ScriptedServer, code: grpc.StatusCode) -> None:
    scripted.servicer.fail("Explain", code, times=3)
    with client_for(scripted, retries=3) as c, pytest.raises(errors.LimelightError):
        c.explain(TEXT)
    assert len(scripted.servicer.calls_to("Explain")) == 1


def test_retry_stops_at_the_deadline(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("Explain", grpc.StatusCode.UNAVAILABLE, times=50)
    with (
        client_for(scripted, retries=20, backoff=0.3, timeout=0.5) as c,
        pytest.raises((errors.Unavailable, errors.DeadlineExceeded)),
    ):
        c.explain(TEXT)
    # Waits of >=0.15, >=0.3, >=0.6 s: at most three attempts fit into 0.5 s.
    assert 1 <= len(scripted.servicer.calls_to("Explain")) <= 3


def test_retry_policy_delays() -> None:
    policy = RetryPolicy(retries=5, backoff=0.1, max_backoff=0.5)
    rng = random.Random(0)
    for attempt in range(8):
        d = min(0.1 * 2**attempt, 0.5)
        delays = [policy.delay(attempt, rng) for _ in range(200)]
        assert all(d / 2 <= x <= d for x in delays)
        assert len(set(delays)) > 150  # jittered, not a constant
    assert RetryPolicy.retryable(grpc.StatusCode.UNAVAILABLE)
    assert not RetryPolicy.retryable(grpc.StatusCode.DEADLINE_EXCEEDED)
    with pytest.raises(ValueError):
        RetryPolicy(retries=-1)


def test_server_down_raises_unavailable() -> None:
    port = free_port()  # nobody listens there
    with (
        Client(f"127.0.0.1:{port}", retries=1, backoff=0.01) as c,
        pytest.raises(errors.Unavailable),
    ):
        c.model()


def test_server_started_late_is_reached_by_retries(scripted: ScriptedServer) -> None:
    # The server answers UNAVAILABLE for a while (e.g. not warmed up yet) then serves.
    scripted.servicer.fail("GetModel", grpc.StatusCode.UNAVAILABLE, times=4)
    with client_for(scripted, retries=5, backoff=0.02) as c:
        assert c.model().name == "tiny"
    assert len(scripted.servicer.calls_to("GetModel")) == 5


# -- deadlines ---------------------------------------------------------------------------------


def test_every_call_carries_a_deadline(scripted: ScriptedServer) -> None:
    with client_for(scripted, timeout=7.0) as c:
        c.explain(TEXT)
        c.model(timeout=3.0)
    explain, model = scripted.servicer.calls
    # The server's view of the deadline is a little coarse (timer granularity).
    assert explain.time_remaining is not None and 0 < explain.time_remaining <= 7.1
    assert model.time_remaining is not None and 0 < model.time_remaining <= 3.1


def test_an_infinite_timeout_is_no_deadline(scripted: ScriptedServer) -> None:
    """``math.inf`` means what None does, for the client's default and for one call (added
    to the clock, it would be a deadline gRPC takes as already past)."""
    with client_for(scripted, timeout=math.inf) as c:
        c.explain(TEXT)
        assert c.timeout is None
    with client_for(scripted, timeout=10) as c:
        c.model(timeout=math.inf)
        c.explain(TEXT, timeout=math.inf)
        assert len(c.explain_batch([TEXT, TEXT], timeout=math.inf)) == 2
        assert len(list(c.explain_many([TEXT, TEXT], timeout=math.inf))) == 2
        assert len(list(c.explain_many([TEXT] * 3, timeout=math.inf, texts_per_call=2))) == 3
        assert c.submit(TEXT, "ok").result(timeout=math.inf).text == TEXT
    for method in ("Explain", "GetModel", "ExplainBatch", "ExplainStream"):
        # No deadline sent: the server reads one centuries away.
        for call in scripted.servicer.calls_to(method):
            assert call.time_remaining is not None and call.time_remaining > 1e9, call


@pytest.mark.parametrize("timeout", [math.nan, -1.0])
def test_a_timeout_no_deadline_can_mean_is_refused(
    scripted: ScriptedServer, timeout: float
) -> None:
    said = "timeout must be a number of seconds >= 0, or None"
    with pytest.raises(ValueError, match=said):
        client_for(scripted, timeout=timeout)
    with client_for(scripted) as c:
        job = c.submit(TEXT, "hang")
        with pytest.raises(ValueError, match=said):
            c.explain(TEXT, timeout=timeout)
        with pytest.raises(ValueError, match=said):
            list(c.explain_many([TEXT], timeout=timeout))
        with pytest.raises(ValueError, match=said):
            job.result(timeout=timeout)
        with pytest.raises(ValueError, match=said):
            c.wait_ready(timeout=timeout)
    assert not scripted.servicer.calls_to("Explain")
    assert not scripted.servicer.calls_to("ExplainStream")


def test_deadline_exceeded_is_not_retried(scripted: ScriptedServer) -> None:
    # The call must reach the server (it is counted below) within the 1 s timeout, and the 2 s
    # delay must outlast it: a second of slack each way for a busy machine.
    scripted.servicer.delays["Explain"] = 2.0
    with (
        client_for(scripted, timeout=1.0, retries=3) as c,
        pytest.raises(errors.DeadlineExceeded) as info,
    ):
        c.explain(TEXT)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(scripted.servicer.calls_to("Explain")) == 1


def test_per_call_timeout_overrides_default(scripted: ScriptedServer) -> None:
    scripted.servicer.delays["Explain"] = 0.3
    with client_for(scripted, timeout=0.05) as c:
        assert c.explain(TEXT, timeout=5.0).label == "negative"
        with pytest.raises(errors.DeadlineExceeded):
            c.explain(TEXT)


# -- metadata and error mapping ----------------------------------------------------------------


def test_bearer_token_sent_on_every_call(scripted: ScriptedServer) -> None:
    scripted.servicer.required_token = "s3cret"
    with client_for(scripted, token="s3cret") as c:
        c.explain(TEXT)
        c.model()
        list(c.explain_many(["a b", "c"]))
        job = c.submit(TEXT, "ok")
        job.result(timeout=10)
    methods = {call.method for call in scripted.servicer.calls}
    assert {"Explain", "GetModel", "ExplainStream", "SubmitJob", "WatchJob"} <= methods
    assert all(
        call.metadata.get("authorization") == "Bearer s3cret" for call in scripted.servicer.calls
    )


def test_missing_token_is_unauthenticated(scripted: ScriptedServer) -> None:
    scripted.servicer.required_token = "s3cret"
    with client_for(scripted) as c, pytest.raises(errors.Unauthenticated) as info:
        c.explain(TEXT)
    assert "bearer token" in info.value.message
    with client_for(scripted, token="wrong") as c, pytest.raises(errors.Unauthenticated):
        c.model()


def test_token_must_be_one_line() -> None:
    with pytest.raises(ValueError):
        Client("127.0.0.1:1", token="a\nb")


@pytest.mark.parametrize(("code", "cls"), CLASSES, ids=[c.name for c, _ in CLASSES])
def test_error_mapping(
    scripted: ScriptedServer, code: grpc.StatusCode, cls: type[errors.LimelightError]
) -> None:
    scripted.servicer.fail("Explain", code, msg=f"server says {code.name}")
    with client_for(scripted, retries=0) as c, pytest.raises(errors.LimelightError) as info:
        c.explain(TEXT)
    assert type(info.value) is cls
    assert info.value.code == code
    assert info.value.message == f"server says {code.name}"
    assert code.name in str(info.value)
    assert isinstance(info.value.__cause__, grpc.RpcError)


def test_unimplemented_rpc_maps_to_unimplemented() -> None:
    # A server without the Explainer service at all (e.g. pointing at the wrong port).
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", retries=0) as c, pytest.raises(errors.Unimplemented):
            c.model()
    finally:
        server.stop(None)


# -- streaming ---------------------------------------------------------------------------------


def test_explain_many_in_order_with_texts(scripted: ScriptedServer) -> None:
    texts = [f"review number {i} " + "word " * (i % 5) for i in range(40)]
    with client_for(scripted) as c:
        results = list(c.explain_many(iter(texts), all_classes=True))
    assert [r.text for r in results] == texts
    for text, r in zip(texts, results, strict=True):
        words = [t for t in r.tokens if not t.special]
        assert [text[t.start : t.end] for t in words] == text.split()
        assert r.class_scores is not None
    assert len(scripted.servicer.calls_to("ExplainStream")) == 1
    with client_for(scripted) as c:
        assert list(c.explain_many([])) == []


def test_explain_many_text_pairs(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        results = list(c.explain_many([("A man sleeps.", "Nobody sleeps."), "plain"]))
    assert results[0].text_pair == "Nobody sleeps." and results[1].text_pair is None


@pytest.mark.parametrize("connections", [1, 3])
def test_explain_many_server_error(scripted: ScriptedServer, connections: int) -> None:
    with client_for(scripted, connections=connections) as c:
        it = c.explain_many(["fine", "boom", "never"])
        assert next(it).text == "fine"
        with pytest.raises(errors.InvalidArgument, match="boom"):
            list(it)
    # At most one stream per connection: none opened again after the error. (A stream the
    # client closed before the server's thread started its handler is not recorded at all:
    # under load the third of three sometimes is not.)
    assert 1 <= len(scripted.servicer.calls_to("ExplainStream")) <= connections


DROPS = ["a", "b", "drop 1", "c", "d", "e", "drop 2", "f", "g"]


@pytest.mark.parametrize("given", [list, iter], ids=["list", "iterator"])
@pytest.mark.parametrize("connections", [1, 2])
def test_explain_many_stream_is_opened_again_after_unavailable(
    scripted: ScriptedServer, connections: int, given: Callable[[list[str]], Iterable[str]]
) -> None:
    """A stream that fails with UNAVAILABLE (a worker going away ends its streams so) is opened
    again, and what it had been sent and not answered goes out again, in order: the run ends
    with every answer, in input order, none twice."""
    with client_for(scripted, connections=connections) as c:
        before = [conn.channel for conn in c._connections.open]
        assert [r.text for r in c.explain_many(given(DROPS))] == DROPS
        # Each failed stream's connection was dialled again (its worker may be draining, and
        # would keep answering on it); the old ones were closed once the run ended.
        assert len(c._connections.every_channel()) == connections
        assert not set(before) & set(c._connections.every_channel())
        for channel in before:
            with pytest.raises(ValueError, match="closed channel"):
                pb_grpc.ExplainerStub(channel).GetModel(pb.GetModelRequest(), timeout=5)
    streams = scripted.servicer.calls_to("ExplainStream")
    assert len(streams) == connections + 2
    if connections == 1:  # each stream opened again went on a new connection
        assert len({s.peer for s in streams}) == 3
    assert scripted.servicer.dropped == {"drop 1", "drop 2"}


def test_explain_many_stream_gives_up_after_its_retries(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("ExplainStream", grpc.StatusCode.UNAVAILABLE, times=10)
    with (
        client_for(scripted, retries=2) as c,
        pytest.raises(errors.Unavailable, match="scripted UNAVAILABLE"),
    ):
        list(c.explain_many(["a", "b"]))
    assert len(scripted.servicer.calls_to("ExplainStream")) == 3


@pytest.mark.parametrize("connections", [1, 3])
def test_explain_many_bad_item_raises_type_error(
    scripted: ScriptedServer, connections: int
) -> None:
    with client_for(scripted, connections=connections) as c, pytest.raises(TypeError):
        list(c.explain_many(["fine", 42]))  # type: ignore[list-item]
    with client_for(scripted, connections=connections) as c, pytest.raises(TypeError):
        list(c.explain_many(["fine", None, "more"]))  # type: ignore[list-item]  # not an end


@pytest.mark.parametrize("connections", [1, 3])
def test_explain_many_early_break_cancels(scripted: ScriptedServer, connections: int) -> None:
    def endless() -> Iterator[str]:
        i = 0
        while True:
            yield f"text {i}"
            i += 1

    with client_for(scripted, connections=connections) as c:
        for n, _ in enumerate(c.explain_many(endless())):
            if n == 5:
                break
        # The channel is still usable after the abandoned stream.
        assert c.model().name == "tiny"


# -- explain_many in ExplainBatch calls (texts_per_call) -----------------------------------------


def batch_sizes(s: ScriptedServer) -> list[int]:
    return [len(c.request.requests) for c in s.servicer.calls_to("ExplainBatch")]


def test_explain_many_packed_in_calls_of_n_in_order(scripted: ScriptedServer) -> None:
    texts = [f"review number {i} " + "word " * (i % 5) for i in range(10)]
    items: list[str | tuple[str, str | None]] = [*texts, ("A man sleeps.", "Nobody sleeps.")]
    with client_for(scripted) as c:
        results = list(c.explain_many(iter(items), target="positive", texts_per_call=4))
        assert list(c.explain_many([], texts_per_call=4)) == []
    assert [r.text for r in results] == [*texts, "A man sleeps."]
    assert results[-1].text_pair == "Nobody sleeps."
    assert all(r.target_label == "positive" for r in results)
    assert sorted(batch_sizes(scripted)) == [3, 4, 4]  # and no call for the empty input
    assert not scripted.servicer.calls_to("ExplainStream")
    # Each answer is the one for its own request (the calls may arrive in any order).
    sent = {
        r.request_id: r.text
        for c in scripted.servicer.calls_to("ExplainBatch")
        for r in c.request.requests
    }
    assert [sent[r.request_id] for r in results] == [r.text for r in results]


def test_explain_many_packed_spreads_calls_over_connections(scripted: ScriptedServer) -> None:
    with client_for(scripted, connections=2, spread=False) as c:
        texts = [f"text {i}" for i in range(40)]
        assert [r.text for r in c.explain_many(texts, texts_per_call=5)] == texts
    peers = [call.peer for call in scripted.servicer.calls_to("ExplainBatch")]
    # In turn (the calls in flight may reach the server in either order).
    assert sorted(Counter(peers).values()) == [4, 4]


def test_explain_many_packed_retries_an_unavailable_call(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("ExplainBatch", grpc.StatusCode.UNAVAILABLE, times=2)
    texts = [f"text {i}" for i in range(12)]
    with client_for(scripted) as c:
        assert [r.text for r in c.explain_many(texts, texts_per_call=4)] == texts
        assert len(c._connections.every_channel()) == 1  # the replaced ones were closed
    # The two calls that failed were sent again: their inputs are the ones answered, each time
    # on a newly dialled connection (the failed one's worker may be draining).
    assert sorted(batch_sizes(scripted)) == [4] * 5
    peers = [call.peer for call in scripted.servicer.calls_to("ExplainBatch")]
    assert len(set(peers)) == 3
    with client_for(scripted, retries=0) as c:
        scripted.servicer.fail("ExplainBatch", grpc.StatusCode.UNAVAILABLE)
        with pytest.raises(errors.Unavailable):
            list(c.explain_many(texts, texts_per_call=4))


@pytest.mark.parametrize("connections", [1, 3])
def test_explain_many_packed_server_error(scripted: ScriptedServer, connections: int) -> None:
    with client_for(scripted, connections=connections) as c:
        it = c.explain_many(["fine", "also fine", "boom", "never"], texts_per_call=2)
        assert [next(it).text, next(it).text] == ["fine", "also fine"]
        with pytest.raises(errors.InvalidArgument, match="input 0: boom"):
            list(it)
        with pytest.raises(TypeError):
            list(c.explain_many(["fine", 42], texts_per_call=2))  # type: ignore[list-item]


def test_explain_many_packed_reads_the_input_a_window_ahead(scripted: ScriptedServer) -> None:
    pulled = 0

    def endless() -> Iterator[str]:
        nonlocal pulled
        for i in itertools.count():
            pulled += 1
            yield f"text {i}"

    with client_for(scripted, connections=2, spread=False) as c:
        for n, _ in enumerate(c.explain_many(endless(), texts_per_call=3)):
            if n == 4:
                break
        # The window of calls in flight, one more once the first was answered, and what the
        # reading thread holds: a queue of one call's items and the item it waits to add.
        assert pulled <= 3 * (_streams.calls_in_flight(2, 3) + 1) + 3 + 1
        assert c.model().name == "tiny"  # the abandoned calls left the channels usable
    with client_for(scripted) as c, pytest.raises(ValueError, match="texts_per_call"):
        c.explain_many(["a"], texts_per_call=0)  # refused at once, before any iteration


def test_explain_many_packed_answers_a_trickle_as_it_comes(scripted: ScriptedServer) -> None:
    more = threading.Event()

    def trickle() -> Iterator[str]:
        yield "first"
        yield "second"
        # Before the client asks for more input, it must have answered what it has.
        assert more.wait(timeout=30), "the client held the first texts back for a full call"
        yield "third"

    with client_for(scripted, connections=2, spread=False) as c:
        it = c.explain_many(trickle(), texts_per_call=16)
        assert [next(it).text, next(it).text] == ["first", "second"]
        more.set()
        assert [r.text for r in it] == ["third"]
    sizes = batch_sizes(scripted)
    assert sum(sizes) == 3 and max(sizes) <= 2  # calls went with what had arrived


def test_explain_many_packed_timeout_bounds_the_wait_for_input(scripted: ScriptedServer) -> None:
    stalled = threading.Event()

    def stalls() -> Iterator[str]:
        yield "only"
        stalled.wait(timeout=30)
        yield "late"

    try:
        with client_for(scripted) as c:
            # The run's deadline: long enough for "only" to be answered on a busy machine,
            # then spent waiting for input that does not come.
            it = c.explain_many(stalls(), texts_per_call=4, timeout=2.0)
            assert next(it).text == "only"
            with pytest.raises(errors.DeadlineExceeded, match="waiting for input"):
                next(it)
            assert c.model().name == "tiny"
    finally:
        stalled.set()  # lets the reading thread finish


def test_explain_many_packed_raises_the_inputs_error_after_its_items(
    scripted: ScriptedServer,
) -> None:
    def breaks() -> Iterator[str]:
        yield "one"
        yield "two"
        raise OSError("the input broke")

    with client_for(scripted) as c:
        got: list[str | None] = []
        with pytest.raises(OSError, match="the input broke"):
            for r in c.explain_many(breaks(), texts_per_call=4):
                got.append(r.text)
        assert got == ["one", "two"]  # the items read before the error were answered


@pytest.mark.parametrize("connections", [1, 3])
def test_explain_many_streamed_raises_the_inputs_error_after_its_items(
    scripted: ScriptedServer, connections: int
) -> None:
    """As with texts_per_call above: the answers of the items read before the input failed
    come first (over every stream), then the input's own error; the client keeps serving."""

    def breaks() -> Iterator[str]:
        yield from (f"text {i}" for i in range(5))
        raise OSError("the input broke")

    def bad_item() -> Iterator[Any]:
        yield "one"
        yield 5  # not a text

    with client_for(scripted, connections=connections) as c:
        got: list[str | None] = []
        with pytest.raises(OSError, match="the input broke"):
            for r in c.explain_many(breaks()):
                got.append(r.text)
        assert got == [f"text {i}" for i in range(5)]
        got = []
        with pytest.raises(TypeError, match="items must be str"):
            for r in c.explain_many(bad_item()):
                got.append(r.text)
        assert got == ["one"]
        assert [r.text for r in c.explain_many(["again"])] == ["again"]


def test_explain_many_packed_timeout_bounds_the_whole_run(scripted: ScriptedServer) -> None:
    scripted.servicer.delays["ExplainBatch"] = 0.3
    texts = [f"text {i}" for i in range(8)]
    with client_for(scripted) as c:
        got: list[str | None] = []
        with pytest.raises(errors.DeadlineExceeded):
            for r in c.explain_many(texts, texts_per_call=2, timeout=0.2):
                got.append(r.text)
        assert got == []
        assert [r.text for r in c.explain_many(texts, texts_per_call=2, timeout=30)] == texts


@pytest.mark.parametrize("given", [list, iter], ids=["list", "iterator"])
def test_explain_many_packed_timeout_is_measured_from_the_last_answer(
    given: Callable[[list[str]], Iterable[str]],
) -> None:
    """The run's first call is answered last, 2 s after it was sent (beyond the client's
    1.5 s timeout), but the server answered one of the run's calls every 0.5 s (a whole second
    of slack for a busy machine): nothing fails.
    The server answers only once all four calls are in: they must be in flight together."""
    texts = [f"text {i}" for i in range(8)]
    servicer = AnswersOutOfOrder(order=["text 6", "text 4", "text 2", "text 0"], gap=0.5)
    server = start_server(servicer)
    try:
        with client_for(server, timeout=1.5) as c:
            assert [r.text for r in c.explain_many(given(texts), texts_per_call=2)] == texts
    finally:
        server.server.stop(grace=None)
    calls = servicer.calls_to("ExplainBatch")
    assert [call.request.requests[0].text for call in calls][-1] == "text 0"  # answered last


def test_explain_many_packed_sends_input_that_comes_while_it_waits_for_an_answer() -> None:
    """The server answers the first call only after the second: input that arrives while the
    client waits for the first answer must go out then, not after that answer."""
    servicer = AnswersOutOfOrder(order=["c", "a"], gap=0.0)
    server = start_server(servicer)

    def pauses() -> Iterator[str]:
        yield from ["a", "b"]
        time.sleep(0.2)  # a pause: the first call goes out alone
        yield from ["c", "d"]

    try:
        with client_for(server, timeout=10.0) as c:
            assert [r.text for r in c.explain_many(pauses(), texts_per_call=2)] == list("abcd")
    finally:
        server.server.stop(grace=None)


def test_explain_many_packed_fails_a_call_the_server_does_not_answer(
    scripted: ScriptedServer,
) -> None:
    """No whole-run deadline: the client's timeout still ends a wait for an answer that does
    not come, instead of leaving the run hanging; the call is not sent again. (The call must
    reach the server within the 1 s timeout to be counted, and the 2 s delay outlast it.)"""
    scripted.servicer.delays["ExplainBatch"] = 2.0
    with (
        client_for(scripted, timeout=1.0, retries=3) as c,
        pytest.raises(errors.DeadlineExceeded, match=r"none came within 1 s"),
    ):
        list(c.explain_many(["a", "b"], texts_per_call=2))
    assert len(scripted.servicer.calls_to("ExplainBatch")) == 1


@pytest.mark.timeout(60)  # the bug this guards against is a hang
def test_explain_many_stream_fails_when_the_server_stops_answering(
    scripted: ScriptedServer,
) -> None:
    """No whole-run deadline: a stream the server stops answering ends the run after the
    client's timeout of silence instead of hanging it; the stream is not opened again. (The
    1 s timeout is also how long "a" has to be answered: slack for a busy machine.)"""
    with client_for(scripted, timeout=1.0, retries=3) as c:
        got: list[str | None] = []
        with pytest.raises(errors.DeadlineExceeded, match=r"none came within 1 s"):
            for r in c.explain_many(["a", "stall", "c"]):
                got.append(r.text)
    assert got == ["a"]
    assert len(scripted.servicer.calls_to("ExplainStream")) == 1


def _slow_input(texts: list[str]) -> Iterator[str]:
    for i, text in enumerate(texts):
        if i:
            time.sleep(1.0)
        yield text


@pytest.mark.parametrize("slow", ["server", "input", "caller"])
def test_explain_many_stream_timeout_counts_only_the_servers_silence(
    scripted: ScriptedServer, slow: str
) -> None:
    """The client's 0.8 s timeout bounds each wait for an answer, not the run: a server that
    answers every 0.2 s, an input that gives an item every 1 s, or a caller that takes 1 s
    over each answer all run well past it without failing."""
    texts = [f"text {i}" for i in range(8)] if slow == "server" else ["a", "b", "c"]
    scripted.servicer.stream_gap = 0.2 if slow == "server" else 0.0
    given = _slow_input(texts) if slow == "input" else texts
    got: list[str | None] = []
    start = time.monotonic()
    with client_for(scripted, timeout=0.8) as c:
        for r in c.explain_many(given):
            got.append(r.text)
            if slow == "caller":
                time.sleep(1.0)
    assert got == texts
    assert time.monotonic() - start > 1.5  # so the timeout would have ended a bounded run


def test_explain_many_stream_ended_early_is_an_error(scripted: ScriptedServer) -> None:
    # A stream that ends with answers missing must not look like a finished one.
    with client_for(scripted) as c:
        it = c.explain_many(["fine", "hang up", "never answered"])
        assert next(it).text == "fine"
        with pytest.raises(errors.Unavailable, match=r"before \d request"):
            list(it)


# -- several connections -----------------------------------------------------------------------


def test_each_client_has_its_own_connections_taken_in_turn(scripted: ScriptedServer) -> None:
    with client_for(scripted, connections=3) as c, client_for(scripted) as other:
        assert c.connections == 3 and "connections=3" in repr(c)
        for _ in range(6):
            c.explain(TEXT)
        other.explain(TEXT)
    peers = [call.peer for call in scripted.servicer.calls_to("Explain")]
    assert len(set(peers[:6])) == 3 and peers[:3] == peers[3:6]
    assert peers[6] not in peers[:6]  # not shared with another client in the process
    with pytest.raises(ValueError, match="connections"):
        Client(scripted.target, connections=0)


def test_explain_many_deals_the_input_over_one_stream_per_connection(
    scripted: ScriptedServer,
) -> None:
    texts = [f"review number {i}" for i in range(50)]
    with client_for(scripted, connections=3) as c:
        assert [r.text for r in c.explain_many(iter(texts))] == texts
        assert list(c.explain_many([])) == []
        assert [r.text for r in c.explain_many(["only one"])] == ["only one"]
    # The first call's three streams (the later calls' empty streams may be cancelled before
    # they reach the server: nothing was sent on them).
    streams = scripted.servicer.calls_to("ExplainStream")[:3]
    assert len(streams) == 3 and len({s.peer for s in streams}) == 3
    # Item i went to stream i % 3, in order (the server saw the streams in any order).
    assert sorted(s.request for s in streams[:3]) == sorted(texts[k::3] for k in range(3))


def test_explain_many_sends_a_dealt_item_without_waiting_for_the_next(
    scripted: ScriptedServer,
) -> None:
    read_both = threading.Event()

    def producer() -> Iterator[str]:
        yield "first"
        yield "second"
        # The next item comes only once "second" was answered; were it held back until the
        # producer gives a third, this would wait forever.
        if not read_both.wait(10):
            raise AssertionError("the second item was held back")
        yield "third"

    with client_for(scripted, connections=2) as c:
        it = c.explain_many(producer())
        assert next(it).text == "first" and next(it).text == "second"
        read_both.set()
        assert [e.text for e in it] == ["third"]


def test_connections_are_spread_over_the_workers(scripted: ScriptedServer) -> None:
    """Four connections that all land on worker a of two: before its first explanation the
    client re-dials those beyond two per worker until two reach b, and closes the ones it
    replaced."""
    placement = Placement(["a", "a", "a", "a", "a", "b", "a", "b"])
    scripted.servicer.instance_of, scripted.servicer.workers = placement, 2
    with client_for(scripted, connections=4) as c:
        for _ in range(8):
            c.explain(TEXT)
        answers = list(c.explain_many([f"review {i}" for i in range(8)]))
        assert len(c._connections.every_channel()) == 4  # nothing replaced kept open
    # Four connections asked, then the two beyond a's share, then one, then one more.
    assert len(scripted.servicer.calls_to("GetModel")) == 8
    peers = {call.peer for call in scripted.servicer.calls_to("Explain")}
    assert sorted(placement.of[p] for p in peers) == ["a", "a", "b", "b"]
    streams = scripted.servicer.calls_to("ExplainStream")
    assert {s.peer for s in streams} == peers and [a.text for a in answers][:2] == [
        "review 0",
        "review 1",
    ]


def test_spreading_is_asked_once_and_can_be_turned_off(scripted: ScriptedServer) -> None:
    # A server that does not say which process answers: its first answer ends the spreading.
    with client_for(scripted, connections=3) as c:
        for _ in range(3):
            c.explain(TEXT)
    assert len(scripted.servicer.calls_to("GetModel")) == 1
    scripted.servicer.instance_of, scripted.servicer.workers = Placement(["a"] * 3), 2
    with client_for(scripted, connections=3, spread=False) as c:
        list(c.explain_many(["one", "two", "three"]))
    assert len(scripted.servicer.calls_to("GetModel")) == 1  # none more
    with client_for(scripted) as c:  # one connection: nothing to spread
        c.explain(TEXT)
    assert len(scripted.servicer.calls_to("GetModel")) == 1


def test_spreading_waits_for_a_sidecar_that_is_starting(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UNAVAILABLE (the model still loading) leaves the spreading to a later call, which
    replaces the connection beyond a's share and closes it (no call uses it)."""
    monkeypatch.setattr(_common, "SPREAD_RETRY_S", 0.0)
    placement = Placement(["a", "a", "b"])
    scripted.servicer.instance_of, scripted.servicer.workers = placement, 2
    scripted.servicer.fail("GetModel", grpc.StatusCode.UNAVAILABLE)
    with client_for(scripted, connections=2) as c:
        c.explain(TEXT)  # spreading failed: this call went out on a connection as placed
        c.explain(TEXT)  # spread now: the second connection re-dialled
        assert len(c._connections.every_channel()) == 2  # the replaced one closed
        c.explain(TEXT)
        c.explain(TEXT)
    explain_peers = [call.peer for call in scripted.servicer.calls_to("Explain")]
    assert sorted(placement.of[p] for p in set(explain_peers[2:])) == ["a", "b"]


def test_spreading_stays_within_the_calls_deadline(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow answer: the first call's deadline covers its spreading question too (the call
    fails on time, not five seconds later); the spreading is done by a later call. (The
    question must reach the server within the 1 s deadline, and the 2 s delay outlast it.)"""
    monkeypatch.setattr(_common, "SPREAD_RETRY_S", 0.0)
    scripted.servicer.instance_of, scripted.servicer.workers = Placement(["a", "b"]), 2
    scripted.servicer.delays["GetModel"] = 2.0
    with client_for(scripted, connections=2) as c:
        with pytest.raises(errors.DeadlineExceeded):
            c.explain(TEXT, timeout=1.0)
        asked = scripted.servicer.calls_to("GetModel")[0]
        # gRPC sends the remaining time rounded up to its header's units; a few ms over 1 s
        # is that rounding, the failure this guards against is the default five seconds.
        assert asked.time_remaining is not None and asked.time_remaining <= 1.05
        del scripted.servicer.delays["GetModel"]
        c.explain(TEXT)
    assert len(scripted.servicer.calls_to("GetModel")) == 3  # the slow one, then both


def test_a_worker_not_listening_yet_is_looked_for_again_later(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers, but every new connection lands on a (b is still starting): the attempt
    gives up after its dials and closes them; a later call, once the retry time has come,
    finds b."""
    monkeypatch.setattr(_common, "SPREAD_RETRY_S", 0.0)
    dials = _common.SPREAD_BASE_DIALS + _common.SPREAD_DIALS_PER_CONNECTION * 2
    placement = Placement(itertools.chain(["a"] * (2 + dials), itertools.repeat("b")))
    scripted.servicer.instance_of, scripted.servicer.workers = placement, 2
    with client_for(scripted, connections=2) as c:
        c.explain(TEXT)
        assert len(c._connections.every_channel()) == 2  # the dials that found a: closed
        c.explain(TEXT)  # the second attempt
        assert len(c._connections.every_channel()) == 2
        c.explain(TEXT)
        c.explain(TEXT)
    assert len(scripted.servicer.calls_to("GetModel")) == (2 + dials) + (2 + 1)
    last_two = [call.peer for call in scripted.servicer.calls_to("Explain")][2:]
    assert sorted(placement.of[p] for p in last_two) == ["a", "b"]


def test_a_connection_in_use_is_closed_only_when_its_calls_end(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spreading replaces a connection that a stream is using: the stream goes on to its last
    answer on it, and the connection is closed once the stream ends."""
    monkeypatch.setattr(_common, "SPREAD_RETRY_S", 0.0)
    scripted.servicer.instance_of, scripted.servicer.workers = Placement(["a", "a", "b"]), 2
    scripted.servicer.fail("GetModel", grpc.StatusCode.UNAVAILABLE)  # still starting
    texts = [f"review {i}" for i in range(8)]
    with client_for(scripted, connections=2) as c:
        it = c.explain_many(texts)
        first = next(it)  # both streams open, on a, as placed
        c.explain(TEXT)  # spreads: the second connection is replaced by one on b
        connections = c._connections
        assert len(connections.retired) == 1 and len(connections.every_channel()) == 3
        replaced = connections.retired[0].channel
        assert [first.text] + [e.text for e in it] == texts  # not cut off
        assert not connections.retired and len(connections.every_channel()) == 2
        with pytest.raises(ValueError, match="closed channel"):
            pb_grpc.ExplainerStub(replaced).GetModel(pb.GetModelRequest(), timeout=5)
        c.explain(TEXT)
        c.explain(TEXT)
    last_two = [call.peer for call in scripted.servicer.calls_to("Explain")][-2:]
    placed = scripted.servicer.instance_of
    assert isinstance(placed, Placement)
    assert sorted(placed.of[p] for p in last_two) == ["a", "b"]


def test_connections_are_spread_again_when_one_reaches_another_worker(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spread over a and b; then b restarts and its connection is re-established on a (as the
    kernel places a reconnection): the next look finds the move and dials until it reaches
    the new b. A look that finds nothing changed only asks."""
    monkeypatch.setattr(_common, "SPREAD_RECHECK_S", 0.0)  # look before every explanation
    placement = Placement(["a", "b", "b-restarted"])
    scripted.servicer.instance_of, scripted.servicer.workers = placement, 2
    with client_for(scripted, connections=2) as c:
        c.explain(TEXT)
        assert len(scripted.servicer.calls_to("GetModel")) == 2  # asked both: already even
        c.explain(TEXT)
        assert len(scripted.servicer.calls_to("GetModel")) == 4  # asked again, no dial
        on_b = next(peer for peer, worker in placement.of.items() if worker == "b")
        placement.of[on_b] = "a"  # b's connection re-established on a
        c.explain(TEXT)
        assert len(scripted.servicer.calls_to("GetModel")) == 4 + 2 + 1  # one dial reached b
        assert len(c._connections.every_channel()) == 2
        monkeypatch.setattr(_common, "SPREAD_RECHECK_S", 1000.0)
        c.explain(TEXT)  # the look after that one is not due yet
        c.explain(TEXT)
    assert len(scripted.servicer.calls_to("GetModel")) == 4 + 2 + 1 + 2
    last_two = [call.peer for call in scripted.servicer.calls_to("Explain")][-2:]
    assert sorted(placement.of[p] for p in last_two) == ["a", "b-restarted"]


def test_a_spreading_given_up_dials_again_only_when_a_connection_moved(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its last attempt the client still looks now and then, but only asks; it dials
    again once a connection reaches another process."""
    monkeypatch.setattr(_common, "SPREAD_RETRY_S", 0.0)
    monkeypatch.setattr(_common, "SPREAD_ATTEMPTS", 1)
    monkeypatch.setattr(_common, "SPREAD_RECHECK_S", 0.0)
    dials = _common.SPREAD_BASE_DIALS + _common.SPREAD_DIALS_PER_CONNECTION * 3
    placement = Placement(itertools.chain(["a"] * (3 + dials), ["c"]))
    scripted.servicer.instance_of, scripted.servicer.workers = placement, 3
    with client_for(scripted, connections=3) as c:
        c.explain(TEXT)  # the one attempt: every dial found a
        c.explain(TEXT)  # a later look: nothing moved, nothing dialled
        assert len(scripted.servicer.calls_to("GetModel")) == (3 + dials) + 3
        placement.of[next(iter(placement.of))] = "b"  # one connection now reaches b
        c.explain(TEXT)  # moved: a new attempt, whose first dial reaches c
        assert len(scripted.servicer.calls_to("GetModel")) == (3 + dials) + 3 + (3 + 1)
        for _ in range(3):
            c.explain(TEXT)
    last = [call.peer for call in scripted.servicer.calls_to("Explain")][-3:]
    assert sorted(placement.of[p] for p in last) == ["a", "b", "c"]


def test_an_unavailable_call_brings_the_next_look_forward(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_common, "SPREAD_RETRY_S", 0.0)
    # The connection dialled again for the retry reaches a (a worker going away would keep
    # answering on the connection it has).
    placement = Placement(["a", "b", "a"])
    scripted.servicer.instance_of, scripted.servicer.workers = placement, 2
    with client_for(scripted, connections=2) as c:
        c.explain(TEXT)
        c.explain(TEXT)  # the next look is SPREAD_RECHECK_S away
        assert len(scripted.servicer.calls_to("GetModel")) == 2
        scripted.servicer.fail("Explain", grpc.StatusCode.UNAVAILABLE)  # a worker going away
        c.explain(TEXT)  # retried on a new connection, and the next look is now
        c.explain(TEXT)
    assert len(scripted.servicer.calls_to("GetModel")) == 4
    failed, retried = [call.peer for call in scripted.servicer.calls_to("Explain")][2:4]
    assert failed != retried and placement.of[retried] == "a"


# -- jobs --------------------------------------------------------------------------------------


def test_submit_and_result(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        job = c.submit(TEXT, "ok", target="positive", n_samples=500, lr=0.005, seq_len=[1, 3])
        assert job.state is JobState.QUEUED
        exp = job.result(timeout=10)
    req = scripted.servicer.calls_to("SubmitJob")[0].request
    assert req.method == "ok" and req.target.label == "positive"
    assert dict(req.parameters) == {"n_samples": 500, "lr": 0.005, "seq_len": [1, 3]}
    assert req.idempotency_key  # generated
    assert job.state is JobState.SUCCEEDED and job.done
    assert exp.method == "ok" and exp.text == TEXT
    assert job.info.result == exp


def test_submit_retry_uses_one_idempotency_key(scripted: ScriptedServer) -> None:
    scripted.servicer.fail("SubmitJob", grpc.StatusCode.UNAVAILABLE, times=2)
    with client_for(scripted) as c:
        job = c.submit(TEXT, "ok")
        other = c.submit(TEXT, "ok")
    calls = scripted.servicer.calls_to("SubmitJob")
    assert len(calls) == 4
    keys = [call.request.idempotency_key for call in calls]
    assert keys[0] == keys[1] == keys[2] != keys[3]
    assert job.id != other.id
    assert len(scripted.servicer.jobs) == 2


def test_submit_explicit_idempotency_key(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        a = c.submit(TEXT, "ok", idempotency_key="order-17", timeout_seconds=30)
        b = c.submit(TEXT, "ok", idempotency_key="order-17")
    req = scripted.servicer.calls_to("SubmitJob")[0].request
    assert req.idempotency_key == "order-17" and req.timeout_seconds == 30
    assert a.id == b.id


def test_submit_rejects_non_json_params(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c, pytest.raises(TypeError):
        c.submit(TEXT, "ok", weird=object())


def test_watch_yields_progress(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        job = c.submit(TEXT, "ok")
        states = [(i.state, i.progress) for i in job.watch()]
    assert states == [
        (JobState.QUEUED, 0.0),
        (JobState.RUNNING, 0.5),
        (JobState.SUCCEEDED, 1.0),
    ]


def test_watch_reconnects_after_unavailable(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        job = c.submit(TEXT, "flaky")
        exp = job.result(timeout=10)
    assert exp.method == "flaky"
    assert scripted.servicer.watch_opens[job.id] == 2


def test_result_fetched_when_watch_omits_it(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        job = c.submit(TEXT, "lean")
        exp = job.result(timeout=10)
    assert exp.method == "lean" and exp.text == TEXT
    assert len(scripted.servicer.calls_to("GetJob")) == 1


def test_job_failed_raises_with_server_message(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        job = c.submit(TEXT, "boom")
        with pytest.raises(errors.JobFailed) as info:
            job.result(timeout=10)
    assert info.value.message == "out of memory on layer 3"
    assert info.value.job is not None and info.value.job.state is JobState.FAILED
    assert info.value.code is None


def test_cancel_and_result_raises_cancelled(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        job = c.submit(TEXT, "hang")
        seen: list[JobState] = []

        def watch() -> None:
            seen.extend(i.state for i in c.job(job.id).watch())

        watcher = threading.Thread(target=watch)
        watcher.start()
        info = job.cancel()
        watcher.join(10)
        assert info.state is JobState.CANCELLED
        with pytest.raises(errors.JobCancelled, match="cancelled by the client"):
            job.result()
    assert seen[-1] is JobState.CANCELLED


def test_result_timeout(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        job = c.submit(TEXT, "hang")
        with pytest.raises(TimeoutError) as raised:
            # Long enough for the watch to bring QUEUED and then RUNNING on a busy machine.
            job.result(timeout=1.0)
        assert job.state is JobState.RUNNING
        # Where the job stood when the time ran out.
        assert str(raised.value) == f"job {job.id} not finished after 1 s (running, 10%)"
        job.cancel()


def test_job_lookup_refresh_and_list(scripted: ScriptedServer) -> None:
    with client_for(scripted) as c:
        submitted = c.submit(TEXT, "hang")
        fetched = c.job(submitted.id)
        assert fetched.id == submitted.id
        assert fetched.refresh().state is JobState.QUEUED
        listed = c.jobs(states=["queued", JobState.RUNNING], limit=5)
        assert [j.id for j in listed] == [submitted.id]
        req = scripted.servicer.calls_to("ListJobs")[0].request
        assert list(req.states) == [pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING]
        assert req.limit == 5
        with pytest.raises(errors.NotFound, match="no job nope"):
            c.job("nope")


def test_message_size_limit_and_option_override(scripted: ScriptedServer) -> None:
    """Over a size limit, the error says which message went over whose limit, by how much,
    and the setting to change (gRPC's own text says "CLIENT: Received message larger than
    max")."""
    text = "w " * 300  # a ~600-byte request whose response (300 tokens) is several kB
    with client_for(scripted, max_message_bytes=2000, retries=0) as c:
        with pytest.raises(errors.ResourceExhausted) as answer:
            c.explain(text)
        assert re.fullmatch(
            r"the answer is [\d,]+ bytes, more than the 2,000 this client accepts \(its "
            r"max_message_bytes\): raise it, or send fewer texts per call",
            answer.value.message,
        )
        with pytest.raises(errors.ResourceExhausted) as request:
            c.explain("w" * 3000)
        assert re.fullmatch(
            r"the request is 3,0\d\d bytes, more than the 2,000 this client sends \(its "
            r"max_message_bytes\): send shorter texts or fewer per call",
            request.value.message,
        )
    with client_for(scripted, retries=0) as c:  # the test server keeps gRPC's 4 MiB
        with pytest.raises(errors.ResourceExhausted) as request:
            c.explain("w" * 5_000_000)
        assert request.value.message.startswith("the request is 5,000,0")
        assert "more than the 4,194,304 the sidecar accepts (its LIMELIGHT_MAX_MESSAGE_BYTES)" in (
            request.value.message
        )
    # Caller's channel options win over the defaults.
    opts = {"grpc.max_receive_message_length": 1 << 20}
    with client_for(scripted, max_message_bytes=2000, options=opts) as c:
        assert len(c.explain(text).tokens) == 302
