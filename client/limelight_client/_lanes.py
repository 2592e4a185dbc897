"""Single ``explain`` calls carried on pooled ``ExplainStream`` calls ("lanes").

A unary call costs the sidecar several times the server CPU of one message on a stream that
is already open (the HTTP/2 stream, its headers and status). With ``single_calls="stream"`` a
client keeps open streams on each connection and sends each ``explain`` as one message on an
idle one: one input in flight per lane, so a short text never waits behind a long one (a stream
answers in order). The input asks for its error in its place (``continue_on_error``), so a
refused input does not end the lane, and carries what is left of the call's deadline as its
own budget (``timeout_seconds``), which the server enforces; the client enforces the deadline
too, for a server that stops answering.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, Protocol

import grpc
import grpc.aio

from limelight_client._common import wrote_past_the_end
from limelight_client._streams import wait_for
from limelight_client._tracing import trace_context
from limelight_client.errors import DeadlineExceeded, Unavailable, from_status
from limelight_client.proto import explainer_pb2 as pb

#: Idle lanes kept per connection; more are closed when given back (each holds a stream open
#: on the server).
IDLE_LANES_MAX = 32

#: A lane this old is ended (gracefully: its input half-closed) rather than reused, and the
#: next call opens another. A stream keeps its connection open after the server asked the
#: client to move on (``max_connection_age_s``, GOAWAY), where unary calls would have moved; a
#: new stream goes on the channel's current connection. With the Kubernetes base (connections
#: age out after 10 s + 10 %, a 15 s ``preStop`` sleep) every lane has left a pod taken out of
#: the endpoints before it drains: 11 + 1 (the endpoints' update) + 3 <= 15.
LANE_MAX_AGE_S = 3.0

#: How long closing a client waits for the server to end its idle lanes (each half-closed):
#: a stream cut by the channel's close instead ends CANCELLED in the server's metrics.
CLOSE_WAIT_S = 0.5

#: How often a sync lane's request iterator looks whether its stream ended under it (closed
#: channel, server gone), so that gRPC's thread reading it does not wait forever.
REQUEST_POLL_S = 2.0

#: How late past a deadline the sync client's watchdog may cancel a lane: it wakes at most
#: this often, whatever the number of calls in flight.
WATCH_GRANULARITY_S = 0.02


def lane_request(request: pb.ExplainRequest, timeout: float | None) -> pb.ExplainRequest:
    """``request`` as a lane sends it: its error in its place, the call's time left as its
    budget on the server (0: none), its caller's trace context (the lane's stream was opened by
    another call). Built in the caller's thread or task, whose context is the caller's."""
    request.continue_on_error = True
    request.timeout_seconds = 0.0 if timeout is None else timeout
    context = trace_context()
    if context:
        request.trace_context.update(context)
    return request


def lane_answer(response: pb.ExplainResponse) -> pb.ExplainResponse:
    """The answer, or the error the input failed with (raised as a unary call would)."""
    if response.HasField("error"):
        raise from_status(response.error.code, response.error.message)
    return response


def lane_deadline_error() -> DeadlineExceeded:
    return DeadlineExceeded(
        grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded waiting for the answer"
    )


def stream_ended() -> Unavailable:
    """A lane's stream ended without answering (the server closed it): the input was not
    answered, so the call may be tried again."""
    return Unavailable(grpc.StatusCode.UNAVAILABLE, "the server ended the stream")


class Lane(Protocol):
    def usable(self) -> bool: ...

    def close(self, cancel: bool = True) -> None: ...


def take_lane(idle: list[Any]) -> Any | None:
    """An idle lane of a connection whose stream is open and young, or None; the others are
    ended on the way (gracefully: an idle lane owes no answer)."""
    while idle:
        try:
            lane = idle.pop()
        except IndexError:  # another thread took the last one
            return None
        if lane.usable():
            return lane
        lane.close(cancel=False)
    return None


def take_all_idle(idle_lists: Iterable[list[Any]]) -> list[Any]:
    """Every idle lane of the given connections (removed from them), usable or not."""
    taken = []
    for idle in idle_lists:
        while idle:
            try:
                taken.append(idle.pop())
            except IndexError:
                break
    return taken


def give_back_lane(idle: list[Any], lane: Lane) -> None:
    if len(idle) < IDLE_LANES_MAX:
        idle.append(lane)
    else:
        lane.close(cancel=False)


class Watchdog:
    """One thread that cancels the sync lanes whose call's deadline passed: reading a stream's
    next answer has no timeout of its own. Calls answered in time are forgotten lazily."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[list[Any]] = []  # [deadline, seq, fire or None]
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, deadline: float, fire: Callable[[], None]) -> list[Any]:
        """Call ``fire`` at ``deadline`` (``time.monotonic``) unless ``unwatch``-ed first."""
        entry = [deadline, next(self._seq), fire]
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="limelight-lane-watchdog", daemon=True
                )
                self._thread.start()
            elif self._heap[0] is entry:
                self._cond.notify()
        return entry

    @staticmethod
    def unwatch(entry: list[Any]) -> None:
        entry[2] = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            due: list[Callable[[], None]] = []
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    fire = heapq.heappop(self._heap)[2]
                    if fire is not None:
                        due.append(fire)
                if not due:
                    wait = None
                    if self._heap:
                        wait = max(self._heap[0][0] - now, WATCH_GRANULARITY_S)
                    self._cond.wait(wait)
            for fire in due:
                fire()


class SyncLane:
    """An ``ExplainStream`` of the sync client carrying one input at a time."""

    def __init__(self, stub: Any, metadata: Any, watchdog: Watchdog) -> None:
        self._queue: queue.SimpleQueue[pb.ExplainRequest | None] = queue.SimpleQueue()
        self._watchdog = watchdog
        self._expired = False
        self._born = time.monotonic()
        self._call: Any = None
        self._call = stub.ExplainStream(self._requests(), metadata=metadata)
        self._ended = threading.Event()
        self._call.add_done_callback(lambda _: self._ended.set())

    def _requests(self) -> Iterator[pb.ExplainRequest]:
        # Read by a gRPC thread; ends on close, or once the stream ended under it.
        while True:
            try:
                request = self._queue.get(timeout=REQUEST_POLL_S)
            except queue.Empty:
                if self._call is not None and self._call.done():
                    return
                continue
            if request is None:
                return
            yield request

    def usable(self) -> bool:
        young = time.monotonic() - self._born < LANE_MAX_AGE_S
        return young and not self._expired and not self._call.done()

    def ask(self, request: pb.ExplainRequest, timeout: float | None) -> pb.ExplainResponse:
        """Send ``request`` and wait for its answer (``lane_answer`` reads it)."""
        self._queue.put(lane_request(request, timeout))
        entry = None
        if timeout is not None:
            entry = self._watchdog.watch(time.monotonic() + timeout, self._expire)
        try:
            return next(self._call)  # type: ignore[no-any-return]
        except StopIteration:
            raise stream_ended() from None
        except grpc.RpcError:
            if self._expired:
                raise lane_deadline_error() from None
            raise
        finally:
            if entry is not None:
                self._watchdog.unwatch(entry)

    def _expire(self) -> None:
        self._expired = True
        self._call.cancel()

    def close(self, cancel: bool = True) -> None:
        """End the stream: ``cancel`` it (it may owe an answer), or end its input and let the
        server close it (it owes none)."""
        self._queue.put(None)
        if cancel:
            self._call.cancel()

    def wait_ended(self, timeout: float) -> bool:
        """Whether the stream ended within ``timeout`` s (after ``close``)."""
        return self._ended.wait(max(0.0, timeout))


class AsyncLane:
    """An ``ExplainStream`` of the asyncio client carrying one input at a time."""

    #: Graceful ends under way (the event loop keeps only weak references to tasks).
    _ending: ClassVar[set[asyncio.Task[None]]] = set()

    def __init__(self, stub: Any, metadata: Any) -> None:
        self._call: Any = stub.ExplainStream(metadata=metadata)
        self._born = time.monotonic()

    def usable(self) -> bool:
        return time.monotonic() - self._born < LANE_MAX_AGE_S and not self._call.done()

    async def ask(self, request: pb.ExplainRequest, timeout: float | None) -> pb.ExplainResponse:
        """Send ``request`` and wait for its answer; on any failure the lane is spent (an
        answer may still be on its way) and the caller closes it."""
        try:
            await self._call.write(lane_request(request, timeout))
            response = await wait_for(self._call.read(), timeout)
        except TimeoutError:
            raise lane_deadline_error() from None
        except asyncio.InvalidStateError:  # the stream had ended (grpc.aio's way of saying)
            raise stream_ended() from None
        except grpc.RpcError as err:
            # Written after the server ended the stream: the input never reached it.
            if wrote_past_the_end(err):
                raise stream_ended() from None
            raise
        if response is grpc.aio.EOF:
            raise stream_ended()
        return response  # type: ignore[no-any-return]

    def close(self, cancel: bool = True) -> None:
        """See ``SyncLane.close``."""
        if cancel or self._call.done():
            self._call.cancel()
            return
        task = asyncio.get_running_loop().create_task(self._end())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _end(self) -> None:
        try:
            await self._call.done_writing()
        except Exception:  # ended meanwhile (its channel closed, say): nothing left to end
            self._call.cancel()

    async def end(self) -> None:
        """End the stream gracefully and wait for the server to close it (``close`` first
        when it may owe an answer)."""
        await self._end()
        await self._call.code()
