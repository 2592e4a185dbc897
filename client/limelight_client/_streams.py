"""One lazy input dealt over several ``ExplainStream`` calls, one per connection.

With ``limelight serve --workers N`` every connection is served by one worker process, so a
client that keeps one stream reaches one worker. ``explain_many`` therefore opens a stream on
each of the client's connections and deals the input to them in turn: item ``i`` goes to stream
``i % streams``. Each stream answers in its own order, so reading the streams in the same turn
gives the answers back in input order. The input is pulled only when a stream has nothing left
to send, one item at a time and outside any lock, so a slow producer (a generator reading a
queue) never holds an item back from the stream it was dealt to.

``explain_many(texts_per_call=N)`` sends the input in ``ExplainBatch`` calls of up to N texts
instead: about ``TEXTS_IN_FLIGHT_PER_CONNECTION`` texts in flight per connection, the answers
read back in call order. The input is read ahead by ``Chunks`` (a thread, or a task for the
asyncio client), so a call goes out with what has arrived when the input pauses: a slow trickle
(lines piped in as they are written) is answered as it comes instead of waiting for N texts.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import threading
import time
from collections import deque
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from typing import Any, TypeVar

import grpc

from limelight_client._common import (
    Connection,
    TargetArg,
    TextItem,
    explain_request,
    new_request_id,
    split_item,
    time_left,
)
from limelight_client.errors import Internal, LimelightError, Unavailable, from_status
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.types import Explanation

T = TypeVar("T")

#: Texts ``explain_many(texts_per_call=N)`` keeps in flight per connection, in at least two
#: calls: enough for the worker's micro-batcher to gather its next batch while one is served.
#: Measured with bench/bench_sdk_connections.py (BERT-tiny, two workers): 64-128 texts served
#: alike and more did not help; 32 (two calls of 16) served a quarter fewer texts per second.
TEXTS_IN_FLIGHT_PER_CONNECTION = 128


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for`` raising the builtin ``TimeoutError`` on every supported Python
    (3.10's asyncio raises its own ``asyncio.TimeoutError``, which ``except TimeoutError``
    misses)."""
    try:
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:  # not the builtin on Python 3.10
        raise TimeoutError("timed out") from None


def calls_in_flight(connections: int, texts_per_call: int) -> int:
    """How many ``ExplainBatch`` calls of ``texts_per_call`` a packed ``explain_many`` keeps
    in flight over ``connections``."""
    return connections * max(2, -(-TEXTS_IN_FLIGHT_PER_CONNECTION // texts_per_call))


#: What the reader needs to pair an answer with its input: text, text pair, request id.
Sent = tuple[str, str | None, str]
Build = Callable[[TextItem], tuple[pb.ExplainRequest, Sent]]


def request_builder(
    target: TargetArg,
    all_classes: bool,
    method: str | None,
    in_place: bool = False,
    text_timeout: float | None = None,
) -> Build:
    """How ``explain_many`` turns one input item into its request (a fresh request id each);
    ``in_place``: the request asks for its error in its place (``continue_on_error``);
    ``text_timeout``: each input's own budget on the server (``timeout_seconds``)."""
    budget = check_text_timeout(text_timeout)

    def build(item: TextItem) -> tuple[pb.ExplainRequest, Sent]:
        text, pair = split_item(item)
        rid = new_request_id()
        request = explain_request(text, pair, target, all_classes, method, rid, in_place, budget)
        return request, (text, pair, rid)

    return build


def check_text_timeout(text_timeout: float | None) -> float:
    """``text_timeout`` as ``timeout_seconds`` (0.0: none); a ValueError unless None or a
    finite number above 0."""
    if text_timeout is None:
        return 0.0
    if not math.isfinite(text_timeout) or text_timeout <= 0:
        raise ValueError(f"text_timeout must be a finite number of seconds > 0, not {text_timeout}")
    return float(text_timeout)


def answer(
    response: pb.ExplainResponse, sent: Sent, in_place: bool = False
) -> Explanation | LimelightError:
    """The explanation of one streamed answer, with the text it was sent for (unless the
    server echoed another request id, which would mean the pairing is off). An input that
    failed and asked for its error in its place (``continue_on_error``) is answered by that
    error: returned with ``in_place``, else raised."""
    if response.HasField("error"):
        error = from_status(response.error.code, response.error.message)
        if not in_place:
            raise error
        return error
    text, pair, rid = sent
    known = not response.request_id or response.request_id == rid
    return Explanation.from_proto(
        response, text=text if known else None, text_pair=pair if known else None
    )


def batch_request(
    items: Iterable[TextItem], build: Build
) -> tuple[pb.ExplainBatchRequest, list[Sent]]:
    """One ``ExplainBatch`` request for all ``items``, and what pairs each answer with its
    input."""
    built = [build(item) for item in items]
    return pb.ExplainBatchRequest(requests=[r for r, _ in built]), [sent for _, sent in built]


def batch_request_upto_error(
    items: Iterable[TextItem], build: Build
) -> tuple[pb.ExplainBatchRequest, list[Sent], Exception | None]:
    """``batch_request`` for a chunk of ``explain_many``: the items before the first one that
    cannot be sent (a ``TypeError`` for an item that is not a text, say), and that item's
    error, which the run raises once it has yielded the answers before it."""
    built: list[tuple[pb.ExplainRequest, Sent]] = []
    error: Exception | None = None
    for item in items:
        try:
            built.append(build(item))
        except Exception as exc:
            error = exc
            break
    request = pb.ExplainBatchRequest(requests=[r for r, _ in built])
    return request, [sent for _, sent in built], error


def batch_answers(
    response: pb.ExplainBatchResponse, sent: Sequence[Sent], in_place: bool = False
) -> list[Explanation | LimelightError]:
    """The explanations of an ``ExplainBatch`` answer, in input order (see ``answer``)."""
    if len(response.responses) != len(sent):
        raise Internal(
            grpc.StatusCode.INTERNAL,
            f"the server answered {len(response.responses)} of {len(sent)} inputs",
        )
    return [answer(r, s, in_place) for r, s in zip(response.responses, sent, strict=True)]


def check_many(texts: object, call: str) -> None:
    """A str is an iterable of its characters: ``explain_many("a review")`` would explain
    each letter (and fail on the first space)."""
    if isinstance(texts, str | bytes):
        raise TypeError(
            f"{call} takes an iterable of texts, not one {type(texts).__name__}: use "
            f"explain(text) for one text, or {call}([text])"
        )


def check_texts_per_call(texts_per_call: int) -> None:
    if texts_per_call < 1:
        raise ValueError(f"texts_per_call must be >= 1, not {texts_per_call}")


class _End:
    """The input's end, as a pull's outcome (``None`` could be an item, if a wrong one)."""


END = _End()


#: How long a packed call waits for the input's next item once it holds some: items that come
#: this close together share a call; after a longer pause the call goes with what it has.
LINGER_S = 0.005


class _Failed:
    """The exception the input raised, as an entry of the read-ahead queue."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class _ChunkBase:
    """What the sync and asyncio chunk readers share: slicing a list or tuple already in hand,
    assembling a chunk from queue entries."""

    def __init__(self, items: object, size: int) -> None:
        self.size = size
        self._ended = False
        self._error: Exception | None = None
        self._in_hand: Sequence[TextItem] | None = None
        self._at = 0
        if isinstance(items, list | tuple):
            self._in_hand = items

    def _slice(self) -> list[TextItem] | None:
        """The next chunk of the items in hand, None once they are done."""
        assert self._in_hand is not None
        chunk = list(self._in_hand[self._at : self._at + self.size])
        self._at += len(chunk)
        self._ended = self._at >= len(self._in_hand)
        return chunk or None

    def _start(self, wait: bool) -> list[TextItem] | None:
        """An empty chunk to fill, or None if the input is done. The input's error is raised
        by the first waiting take after it, i.e. once the items before it were answered."""
        if self._error is not None and wait:
            error, self._error = self._error, None
            raise error
        return None if self._ended else []

    def _add(self, chunk: list[TextItem], entry: object) -> bool:
        """Add a queue entry to ``chunk``; True when the chunk is complete."""
        if isinstance(entry, _End):
            self._ended = True
            return True
        if isinstance(entry, _Failed):
            # The items before the error still go out; the error is raised at the next take.
            self._ended = True
            self._error = entry.exc
            return True
        chunk.append(entry)  # type: ignore[arg-type]
        return len(chunk) == self.size


class Chunks(_ChunkBase):
    """The sync client's input in chunks of up to ``size`` items, read ahead in a thread.

    A list or tuple is already in hand and is sliced. Any other iterable is read by a daemon
    thread into a queue of one chunk, so the caller can ask for a chunk without blocking
    (``take(wait=False)``) and answer what is in flight while the input is slow.
    """

    def __init__(
        self, items: Iterable[TextItem], size: int, on_put: Callable[[], None] = lambda: None
    ) -> None:
        super().__init__(items, size)
        self._iter = None if self._in_hand is not None else iter(items)
        self._on_put = on_put
        self._queue: queue.Queue[object] = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _put(self, entry: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
            except queue.Full:
                continue
            self._on_put()
            return True
        return False

    def ready(self) -> bool:
        """Whether a ``take(wait=False)`` now has something to take (or to end)."""
        return not self._ended and (self._in_hand is not None or not self._queue.empty())

    def _read(self, items: Iterator[TextItem]) -> None:
        try:
            for item in items:
                if not self._put(item):
                    return
        except Exception as exc:
            self._put(_Failed(exc))
            return
        self._put(END)

    def take(self, wait: bool, deadline: float | None = None) -> list[TextItem] | None:
        """The next chunk: at most ``size`` items, fewer when the input pauses for
        ``LINGER_S``. None when the input is done, or (``wait=False``) has nothing ready now.
        With ``wait``, blocks for the first item until ``deadline`` (``TimeoutError``)."""
        chunk = self._start(wait)
        if chunk is None:
            return None
        if self._in_hand is not None:
            return self._slice()
        if self._thread is None:
            assert self._iter is not None
            self._thread = threading.Thread(
                target=self._read, args=(self._iter,), name="limelight-input", daemon=True
            )
            self._thread.start()
        try:
            entry = (
                self._queue.get(timeout=time_left(deadline)) if wait else self._queue.get_nowait()
            )
        except queue.Empty:
            if wait:
                raise TimeoutError("no input before the deadline") from None
            return None
        while not self._add(chunk, entry):
            try:
                entry = self._queue.get(timeout=LINGER_S)
            except queue.Empty:
                break
        return chunk or self.take(wait, deadline)

    def close(self) -> None:
        """Stop the reading thread (at once if it waits for room; after the input's next item
        if it waits for the input)."""
        self._stop.set()


class AsyncChunks(_ChunkBase):
    """``Chunks`` for the asyncio client: a list or tuple is sliced; any other input (sync or
    async iterable) is read by a task on the event loop. Create it inside the running loop."""

    def __init__(
        self,
        items: Iterable[TextItem] | AsyncIterable[TextItem],
        size: int,
        on_put: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(items, size)
        self._on_put = on_put
        self._queue: asyncio.Queue[object] = asyncio.Queue(maxsize=size)
        self._task: asyncio.Task[None] | None = None
        if self._in_hand is None:
            self._task = asyncio.get_running_loop().create_task(self._read(items))

    async def _put(self, entry: object) -> None:
        await self._queue.put(entry)
        self._on_put()

    async def _read(self, items: Iterable[TextItem] | AsyncIterable[TextItem]) -> None:
        try:
            if isinstance(items, AsyncIterable):
                async for item in items:
                    await self._put(item)
            else:
                for item in items:
                    await self._put(item)
        except Exception as exc:
            await self._put(_Failed(exc))
            return
        await self._put(END)

    def ready(self) -> bool:
        """See ``Chunks.ready``."""
        return not self._ended and (self._in_hand is not None or not self._queue.empty())

    async def take(self, wait: bool, deadline: float | None = None) -> list[TextItem] | None:
        """See ``Chunks.take``."""
        chunk = self._start(wait)
        if chunk is None:
            return None
        if self._in_hand is not None:
            return self._slice()
        if wait:
            entry = await wait_for(self._queue.get(), time_left(deadline))
        else:
            try:
                entry = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return None
        while not self._add(chunk, entry):
            try:
                entry = self._queue.get_nowait()  # cheap while the input keeps up
            except asyncio.QueueEmpty:
                try:
                    entry = await wait_for(self._queue.get(), LINGER_S)
                except TimeoutError:
                    break
        return chunk or await self.take(wait, deadline)

    def close(self) -> None:
        """Stop reading the input."""
        if self._task is not None:
            self._task.cancel()


class _Progress:
    """What a packed run waits on between sending calls: the answer of its oldest call, or
    more input to send meanwhile. Woken by the calls' done-callbacks and the input's reader.

    The client's ``timeout`` bounds how long the run may go without any of its calls being
    answered (the server stopped answering): a call that only waits behind the run's own
    earlier calls, or is answered out of order, is not cut short."""

    def __init__(self, changed: threading.Event | asyncio.Event) -> None:
        self.last = time.monotonic()
        self._changed = changed

    def answered(self, *_: object) -> None:
        """A done-callback: any call of the run was answered (or failed) now."""
        self.last = time.monotonic()
        self.nudge()

    def nudge(self) -> None:
        """Wake the waiting loop to look again (input arrived, a call ended)."""
        self._changed.set()

    def _look(self, done: Callable[[], bool], more: Callable[[], bool]) -> bool | None:
        """True when ``done()``, False when ``more()``, None to wait for a nudge. The wake-up
        is cleared before looking, so a nudge that comes after the look is not lost."""
        self._changed.clear()
        return True if done() else False if more() else None

    def _time_left(self, sent_at: float, timeout: float | None) -> float | None:
        """How long to wait for a nudge; ``TimeoutError`` once nothing of the run was
        answered for ``timeout`` s since ``sent_at`` or the last answer."""
        if timeout is None:
            return None
        left = max(self.last, sent_at) + timeout - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left


class Progress(_Progress):
    """``_Progress`` for the sync client (nudged from gRPC's and the reader's threads)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        super().__init__(self._event)

    def wait(
        self,
        done: Callable[[], bool],
        more: Callable[[], bool],
        sent_at: float,
        timeout: float | None,
    ) -> bool:
        """Block until ``done()`` (True) or ``more()`` (False); ``TimeoutError`` once nothing
        of the run was answered for ``timeout`` s since ``sent_at`` or the last answer."""
        while (outcome := self._look(done, more)) is None:
            self._event.wait(self._time_left(sent_at, timeout))
        return outcome


class AsyncProgress(_Progress):
    """``_Progress`` for ``AsyncClient`` (everything on the event loop). Create it inside the
    running loop."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        super().__init__(self._event)

    async def wait(
        self,
        done: Callable[[], bool],
        more: Callable[[], bool],
        sent_at: float,
        timeout: float | None,
    ) -> bool:
        """See ``Progress.wait``."""
        while (outcome := self._look(done, more)) is None:
            left = self._time_left(sent_at, timeout)
            with contextlib.suppress(TimeoutError):  # then look again
                await wait_for(self._event.wait(), left)
        return outcome


class _Silence:
    """The watchdog of a streamed run: when the stream the reader waits on answers nothing
    for the client's ``timeout`` (counted from when the reader began waiting, or from when
    the awaited request went out if that was later), the server has stopped answering and
    every stream is cancelled, so the run fails instead of hanging. Time the input takes to
    give the next item, or the caller takes between items, does not count.

    The reader only swaps one attribute per answer; the watchdog wakes about once per
    ``timeout`` to look."""

    def __init__(self, feed: _Deal, timeout: float | None) -> None:
        #: None: no watchdog (the client has no timeout).
        self.timeout = timeout
        #: True once the watchdog cancelled the streams.
        self.fired = False
        self._feed = feed
        self._calls: Sequence[Any] = ()
        self._waiting: tuple[int, float] | None = None  # stream, since when; one attribute

    def waiting(self, k: int) -> None:
        """The reader begins to wait for stream ``k``'s next answer."""
        self._waiting = (k, time.monotonic())

    def done_waiting(self) -> None:
        """The reader got it (and hands it to the caller, whose time does not count)."""
        self._waiting = None

    def _due(self, timeout: float) -> float:
        """Seconds until the awaited answer is overdue; <= 0 once it is."""
        waiting = self._waiting
        if waiting is None:
            return timeout  # nothing awaited: any wait that starts now ends later
        k, since = waiting
        sent_at = self._feed.oldest_sent_at(k)
        if sent_at is None:  # the request is not out yet: the input is slow, not the server
            return timeout
        return max(since, sent_at) + timeout - time.monotonic()

    def _fire(self) -> None:
        self.fired = True
        for call in self._calls:
            call.cancel()


class Silence(_Silence):
    """``_Silence`` for the sync client: the watchdog is a daemon thread."""

    def __init__(self, feed: _Deal, timeout: float | None) -> None:
        super().__init__(feed, timeout)
        self._stop = threading.Event()

    def watch(self, calls: Sequence[Any]) -> None:
        """Start watching the run's stream calls."""
        self._calls = calls
        if self.timeout is not None:
            thread = threading.Thread(
                target=self._run, args=(self.timeout,), name="limelight-watchdog", daemon=True
            )
            thread.start()

    def _run(self, timeout: float) -> None:
        delay = timeout
        while not self._stop.wait(delay):
            delay = self._due(timeout)
            if delay <= 0:
                self._fire()
                return

    def stop(self) -> None:
        self._stop.set()


class AsyncSilence(_Silence):
    """``_Silence`` for ``AsyncClient``: the watchdog is a task on the running loop."""

    _task: asyncio.Task[None] | None = None

    def watch(self, calls: Sequence[Any]) -> None:
        """Start watching the run's stream calls (inside the running loop)."""
        self._calls = calls
        if self.timeout is not None:
            self._task = asyncio.get_running_loop().create_task(self._run(self.timeout))

    async def _run(self, timeout: float) -> None:
        delay = timeout
        while True:
            await asyncio.sleep(delay)
            delay = self._due(timeout)
            if delay <= 0:
                self._fire()
                return

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def stream_cut_short(unanswered: int) -> Unavailable:
    """The error for streams that ended without answering everything sent on them."""
    return Unavailable(
        grpc.StatusCode.UNAVAILABLE,
        f"the stream ended before {unanswered} request(s) sent on it were answered",
    )


class _Deal:
    """Round-robin bookkeeping shared by the sync and asyncio feeds (no locking of its own).

    A stream that failed can be opened again (the feeds' ``reopen``): what it was sent and
    not answered goes back to the front of what is dealt to it, in order, and the failed
    stream's request iterator stops at its next step (each stream has a generation; an
    iterator of an older one ends)."""

    def __init__(self, streams: int, build: Build) -> None:
        if streams < 1:
            raise ValueError("streams must be >= 1")
        self.streams = streams
        self._build = build
        self._dealt: list[deque[tuple[pb.ExplainRequest, Sent]]] = [deque() for _ in range(streams)]
        #: Per stream, what was handed to gRPC and awaits its answer (and when), oldest first.
        self.sent: list[deque[tuple[pb.ExplainRequest, Sent, float]]] = [
            deque() for _ in range(streams)
        ]
        #: The exception the input (or building a request from it) raised, if any.
        self.error: BaseException | None = None
        self._generation = [0] * streams
        self._turn = 0
        self._pulling = False
        self._exhausted = False

    def open(
        self,
        connections: Sequence[Connection[Any]],
        deadline: float | None,
        metadata: tuple[tuple[str, str], ...],
    ) -> list[Any]:
        """One ``ExplainStream`` call per connection, stream ``k`` fed by ``requests(k, 0)``."""
        return [self._call(k, conn, 0, deadline, metadata) for k, conn in enumerate(connections)]

    def _call(
        self,
        k: int,
        conn: Connection[Any],
        generation: int,
        deadline: float | None,
        metadata: tuple[tuple[str, str], ...],
    ) -> Any:
        return conn.stub.ExplainStream(
            self.requests(k, generation), timeout=time_left(deadline), metadata=metadata
        )

    def requests(self, k: int, generation: int) -> Any:
        """Stream ``k``'s requests (an iterator, or an async one for grpc.aio)."""
        raise NotImplementedError

    def ended_early(self, k: int) -> Unavailable | None:
        """Stream ``k`` ended without an error: None when it owed nothing (the input's end),
        else the error of a stream cut short."""
        owed = len(self.sent[k]) + len(self._dealt[k])
        return stream_cut_short(owed) if owed else None

    def _resend(self, k: int) -> int:
        """Stream ``k`` failed: deal it again what it was sent and not answered; returns the
        generation of its next request iterator."""
        self._generation[k] += 1
        while self.sent[k]:
            request, sent, _ = self.sent[k].pop()
            self._dealt[k].appendleft((request, sent))
        return self._generation[k]

    def _step(self, k: int, generation: int) -> pb.ExplainRequest | bool | None:
        """Stream ``k``'s next move: its next request, ``None`` when it is done (or this
        iterator is of a failed stream), ``True`` when it should pull the next item of the
        input, ``False`` when it should wait."""
        if generation != self._generation[k]:
            return None
        if self._dealt[k]:
            request, sent = self._dealt[k].popleft()
            self.sent[k].append((request, sent, time.monotonic()))
            return request
        if self._exhausted:
            return None
        if self._pulling:
            return False
        self._pulling = True
        return True

    def _settle(self, outcome: TextItem | BaseException | _End) -> bool:
        """Record what a pull of the input gave (an item, ``END`` at its end, or the error it
        raised); True when the pulling stream is done. An error (the input's, or an item that
        cannot be sent) ends the input as its end would: every stream sends what it was dealt
        and closes, the server answers it all, and the reader raises the error after the
        answers of the items read before it, as ``texts_per_call`` above 1 does."""
        if isinstance(outcome, _End):
            self._ended()
            return True
        if isinstance(outcome, BaseException):
            self._failed(outcome)
            return True
        return self._pulled(outcome)

    def _pulled(self, item: TextItem) -> bool:
        self._pulling = False
        try:
            built = self._build(item)
        except Exception as exc:
            self._failed(exc)
            return True
        self._dealt[self._turn].append(built)
        self._turn = (self._turn + 1) % self.streams
        return False

    def _ended(self) -> None:
        self._pulling = False
        self._exhausted = True

    def _failed(self, exc: BaseException) -> None:
        # Every stream ends; the reader raises this instead of gRPC's opaque CANCELLED.
        self._pulling = False
        self._exhausted = True
        self.error = exc

    def answered(self, k: int) -> Sent:
        """What stream ``k``'s answer just read was for (its oldest unanswered request)."""
        return self.sent[k].popleft()[1]

    def oldest_sent_at(self, k: int) -> float | None:
        """When stream ``k``'s oldest unanswered request went to gRPC; None if none did."""
        try:  # read from the watchdog's thread while the reader pops: a miss is "none"
            return self.sent[k][0][2]
        except IndexError:
            return None

    def unanswered(self) -> int:
        """Requests sent that got no answer (non-zero only if a stream ended early)."""
        return sum(len(s) for s in self.sent)


class StreamFeed(_Deal):
    """The sync client's feed: each stream's request iterator runs in a gRPC thread."""

    def __init__(self, items: Iterable[TextItem], streams: int, build: Build) -> None:
        super().__init__(streams, build)
        self._items = iter(items)
        self._cond = threading.Condition()

    def close(self) -> None:
        """Stop every stream's request iterator (the reader is done or gave up): one waiting
        for another stream's pull would otherwise hold its gRPC thread."""
        with self._cond:
            self._dealt = [deque() for _ in range(self.streams)]
            self._exhausted = True
            self._cond.notify_all()

    def reopen(
        self,
        k: int,
        conn: Connection[Any],
        deadline: float | None,
        metadata: tuple[tuple[str, str], ...],
    ) -> Any:
        """A new call for stream ``k``, which failed: it sends first what the failed one was
        sent and did not answer."""
        with self._cond:
            generation = self._resend(k)
            self._cond.notify_all()  # the failed stream's iterator, if it waits, ends
        return self._call(k, conn, generation, deadline, metadata)

    def requests(self, k: int, generation: int) -> Iterator[pb.ExplainRequest]:
        """The request iterator of stream ``k``."""
        while True:
            with self._cond:
                step = self._step(k, generation)
                while step is False:
                    self._cond.wait()
                    step = self._step(k, generation)
            if step is None:
                return
            if step is not True:
                yield step
                continue
            outcome: TextItem | BaseException | _End
            try:
                outcome = next(self._items)
            except StopIteration:
                outcome = END
            except Exception as exc:
                outcome = exc
            with self._cond:
                try:
                    if self._settle(outcome):
                        return
                finally:
                    self._cond.notify_all()


class AsyncStreamFeed(_Deal):
    """The asyncio client's feed: the request iterators run on the event loop."""

    def __init__(
        self, items: Iterable[TextItem] | AsyncIterable[TextItem], streams: int, build: Build
    ) -> None:
        super().__init__(streams, build)
        self._items = items
        self._aiter: AsyncIterator[TextItem] | None = None
        self._iter: Iterator[TextItem] | None = None
        self._cond_: asyncio.Condition | None = None  # made inside the running loop

    @property
    def _cond(self) -> asyncio.Condition:
        if self._cond_ is None:
            self._cond_ = asyncio.Condition()
        return self._cond_

    async def reopen(
        self,
        k: int,
        conn: Connection[Any],
        deadline: float | None,
        metadata: tuple[tuple[str, str], ...],
    ) -> Any:
        """See ``StreamFeed.reopen``."""
        async with self._cond:
            generation = self._resend(k)
            self._cond.notify_all()
        return self._call(k, conn, generation, deadline, metadata)

    async def _next_outcome(self) -> TextItem | BaseException | _End:
        """The input's next item, ``END`` at its end, or the error it raised."""
        try:
            if isinstance(self._items, AsyncIterable):
                if self._aiter is None:
                    self._aiter = aiter(self._items)
                return await anext(self._aiter)
            if self._iter is None:
                self._iter = iter(self._items)
            return next(self._iter)
        except (StopIteration, StopAsyncIteration):
            return END
        except Exception as exc:
            return exc

    async def requests(self, k: int, generation: int) -> AsyncIterator[pb.ExplainRequest]:
        """The request iterator of stream ``k``."""
        cond = self._cond
        while True:
            async with cond:
                step = self._step(k, generation)
                while step is False:
                    await cond.wait()
                    step = self._step(k, generation)
            if step is None:
                return
            if step is not True:
                yield step
                continue
            outcome = await self._next_outcome()
            async with cond:
                try:
                    if self._settle(outcome):
                        return
                finally:
                    cond.notify_all()
