"""The asyncio Limelight client: the same surface as :class:`limelight_client.Client`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import weakref
from collections import deque
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Sequence,
)
from types import TracebackType
from typing import Any, Literal, overload

import grpc
import grpc.aio

from limelight_client._common import (
    EXPLAINER_SERVICE,
    HEALTH_RPC,
    ClientBase,
    Connection,
    Connections,
    HealthCheckRequest,
    JobHandleBase,
    SpreadAnswer,
    TargetArg,
    TextItem,
    cancel_job_request,
    check_timeout,
    deadline_error,
    explain_request,
    get_job_request,
    health_status_name,
    late_bound,
    list_jobs_request,
    new_request_id,
    resume,
    spread_question_timeout,
    submit_request,
    terminal_state,
    time_left,
    timeout_left,
    wrote_past_the_end,
)
from limelight_client._lanes import (
    CLOSE_WAIT_S,
    AsyncLane,
    give_back_lane,
    lane_answer,
    take_all_idle,
    take_lane,
)
from limelight_client._streams import (
    AsyncChunks,
    AsyncProgress,
    AsyncSilence,
    AsyncStreamFeed,
    Build,
    Sent,
    answer,
    batch_answers,
    batch_request,
    batch_request_upto_error,
    calls_in_flight,
    check_many,
    check_texts_per_call,
    request_builder,
    stream_cut_short,
    wait_for,
)
from limelight_client.client import job_outcome, no_answer, take_unclosed, watch_broke
from limelight_client.errors import (
    Cancelled,
    DeadlineExceeded,
    LimelightError,
    NotFound,
    Unavailable,
)
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc as pb_grpc
from limelight_client.types import DriftReport, Explanation, JobInfo, JobState, ModelInfo

__all__ = ["AsyncClient", "AsyncJob"]


#: Background closes of released connections under way (``AsyncClient._close_released``).
_CLOSING: set[asyncio.Task[None]] = set()


async def _end_then_close(lanes: list[AsyncLane], channels: list[grpc.aio.Channel]) -> None:
    """See ``limelight_client.client._end_then_close``."""
    if lanes:
        with contextlib.suppress(TimeoutError):
            ending = asyncio.gather(*(lane.end() for lane in lanes), return_exceptions=True)
            await wait_for(ending, CLOSE_WAIT_S)
    for channel in channels:
        await channel.close()


def _close_in_background(lanes: list[AsyncLane], channels: list[grpc.aio.Channel]) -> None:
    """``_end_then_close`` as a task of the running event loop, which nobody awaits."""
    task = asyncio.get_running_loop().create_task(_end_then_close(lanes, channels))
    _CLOSING.add(task)  # the event loop keeps only weak references to tasks
    task.add_done_callback(_CLOSING.discard)


def _release_unclosed(
    name: str,
    connections: Connections[grpc.aio.Channel],
    loop: asyncio.AbstractEventLoop | None,
) -> None:
    """What ``close`` releases, for a client garbage collected without it (``weakref.finalize``:
    this must not refer to the client): its idle streams (each an open stream on the sidecar
    and a task waiting for its end) and its channels, ended in the background
    (``take_unclosed``). They belong to ``loop``, and only its thread may end them: from
    whichever thread collected the client, the close is handed to it, to run when it next runs
    (at once if it is running). A loop already closed took its tasks with it, and grpc closes
    a channel it collects; nothing is left to do then, nor raised."""
    unclosed = take_unclosed(
        name, connections, "close it (`await client.close()`, or use it in `async with`)"
    )
    if unclosed is None or loop is None or loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile, in another thread
        loop.call_soon_threadsafe(_close_in_background, *unclosed)


def _loop_of(channel: grpc.aio.Channel) -> asyncio.AbstractEventLoop | None:
    """The event loop a grpc.aio channel belongs to (``get_working_loop`` when it was made:
    the running loop, or else the thread's default one), if it says."""
    loop = getattr(channel, "_loop", None)
    return loop if isinstance(loop, asyncio.AbstractEventLoop) else None


#: How to make an ``AsyncClient`` so that it works: said by ``wrong_loop`` and ``no_loop``.
ONE_PER_LOOP = (
    "a client works in one event loop only, the one running when it was made (made outside a "
    "running loop: the thread's default loop). Make one client per event loop, inside it: "
    "`async with AsyncClient(...) as client:` in the coroutine that asyncio.run() runs"
)


def no_loop() -> RuntimeError:
    """The error of an ``AsyncClient`` made with no event loop to bind it to: none running,
    and the thread has no default one (an ``asyncio.run`` that returned unset it)."""
    return RuntimeError(f"no event loop to make this AsyncClient in: {ONE_PER_LOOP}")


def _aio_dialer(name: str) -> Callable[..., Any]:
    """grpc.aio's channel constructor ``name`` (``late_bound``), raising ``no_loop`` rather
    than asyncio's "There is no current event loop" where it finds no loop to bind to."""
    dial = late_bound(grpc.aio, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return dial(*args, **kwargs)
        except RuntimeError as exc:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # none running: the thread's default loop was missing
                raise no_loop() from exc
            raise

    return call


def wrong_loop(made_in: asyncio.AbstractEventLoop) -> RuntimeError:
    """The error of an ``AsyncClient`` called from another event loop than its own."""
    closed = " (now closed)" if made_in.is_closed() else ""
    return RuntimeError(f"this AsyncClient belongs to another event loop{closed}: {ONE_PER_LOOP}")


class AsyncClient(ClientBase[grpc.aio.Channel]):
    """An asyncio connection to a Limelight sidecar; arguments as for ``Client``.

    One client per event loop: create it inside the event loop that uses it (``async with
    AsyncClient(...) as c:`` in the coroutine given to ``asyncio.run``). grpc.aio binds its
    connections to the loop running when they are made; a call from another loop (a second
    ``asyncio.run``, or a client made outside any running loop and used in one) raises
    ``RuntimeError`` saying so.

    Close it (``await client.close()``, or ``async with``) to release its connections. A client
    garbage collected unclosed releases them then in its event loop (unless that is closed),
    with a ``ResourceWarning``: its pooled streams (``single_calls="stream"``) would otherwise
    stay open on the sidecar, each with a task waiting for its end, for the life of the loop.
    """

    _dialers = (_aio_dialer("secure_channel"), _aio_dialer("insecure_channel"))
    _sleep = staticmethod(asyncio.sleep)
    #: The event loop this client's channels belong to, known from its first call.
    _loop: asyncio.AbstractEventLoop | None = None
    #: Releases the streams and channels of a client collected unclosed (made with the client).
    _finalizer: weakref.finalize | None = None

    def _new_lock(self) -> asyncio.Lock:
        return asyncio.Lock()

    def _opened(self) -> None:
        loop = _loop_of(self._connections.open[0].channel)
        if loop is None:  # a channel that does not say (a wrapper's): the running loop's, if any
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
        self._finalizer = weakref.finalize(
            self, _release_unclosed, repr(self), self._connections, loop
        )
        self._finalizer.atexit = False  # the process ends them at exit anyway

    def _check_loop(self) -> None:
        """Raise ``wrong_loop`` unless called in the event loop of this client's channels."""
        running = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = _loop_of(self._connections.open[0].channel) or running
        if self._loop is not running:
            raise wrong_loop(self._loop)

    @contextlib.asynccontextmanager
    async def _lease(self, k: int | None = None) -> AsyncIterator[Connection[grpc.aio.Channel]]:
        """See ``Client._lease``."""
        self._check_loop()
        try:
            with self._connections.lease(k) as conn:
                yield conn
        finally:
            await self._close_released()

    @contextlib.asynccontextmanager
    async def _lease_all(self) -> AsyncIterator[list[Connection[grpc.aio.Channel]]]:
        self._check_loop()
        try:
            with self._connections.lease_all() as conns:
                yield conns
        finally:
            await self._close_released()

    async def _close_released(self) -> None:
        """See ``Client._close_released``."""
        channels, lanes = self._connections.take_closing()
        if lanes:
            _close_in_background(lanes, channels)
            return
        for channel in channels:
            await channel.close()

    async def _spread(self, deadline: float | None) -> None:
        """See ``Client._spread``."""
        self._check_loop()
        if self._connections.spread_due():
            with self._closed_as_cancelled():
                await self._spread_locked(deadline)

    async def _spread_locked(self, deadline: float | None) -> None:
        async with self._spread_lock:
            dialogue = self._connections.spreading()
            stub = next(dialogue, None)
            while stub is not None:
                stub = resume(dialogue, await self._ask_instance(stub, deadline))
            await self._close_released()

    async def _ask_instance(
        self, stub: pb_grpc.ExplainerStub, deadline: float | None
    ) -> SpreadAnswer:
        timeout = spread_question_timeout(deadline)
        if timeout <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        try:
            return await stub.GetModel(
                pb.GetModelRequest(), timeout=timeout, metadata=self._call_metadata()
            )
        except grpc.RpcError as err:
            return err.code()

    async def close(self) -> None:
        """See ``Client.close`` (in the client's own event loop, as every call). A client whose
        event loop has ended (an ``asyncio.run`` that returned) is only marked closed, from any
        loop: its loop took the channels and streams with it."""
        made_in = self._loop or _loop_of(self._connections.open[0].channel)
        ended = made_in is not None and made_in.is_closed()
        if not ended:
            self._check_loop()
        self._connections.closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        if ended:
            return
        lanes = take_all_idle(self._connections.idle_lane_lists())
        await _end_then_close(lanes, self._connections.every_channel())

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- plumbing --------------------------------------------------------------------------

    async def _backoff(self, attempt: int, deadline: float | None) -> bool:
        delay = self._backoff_delay(attempt, deadline)
        if delay is None:
            return False
        await self._sleep(delay)
        return True

    async def _retry_or_error(
        self,
        err: grpc.RpcError | LimelightError,
        attempt: int,
        deadline: float | None,
        *,
        idempotent: bool = True,
    ) -> LimelightError | None:
        """See ``Client._retry_or_error``."""
        error, again = self._failed(err, attempt, idempotent=idempotent)
        return None if again and await self._backoff(attempt, deadline) else error

    async def _unary(
        self,
        method: str,
        request: Any,
        timeout: float | None,
        *,
        idempotent: bool = True,
        connection: int | None = None,
        on_stream: bool = False,
    ) -> Any:
        """See ``Client._unary``."""
        deadline = self._deadline(timeout)
        attempt = 0
        redialled: list[Connection[grpc.aio.Channel]] = []
        with self._closed_as_cancelled():
            async with self._lease(connection) as conn:
                try:
                    while True:
                        remaining = self._remaining(deadline, "before the call could be (re)tried")
                        try:
                            if on_stream:
                                return await self._ask_on_stream(conn, request, remaining)
                            rpc = conn.rpc(method)
                            return await rpc(
                                request, timeout=remaining, metadata=self._call_metadata()
                            )
                        except (grpc.RpcError, LimelightError) as err:
                            error = await self._retry_or_error(
                                err, attempt, deadline, idempotent=idempotent
                            )
                            if error is not None:
                                raise error from (err if error is not err else None)
                            attempt += 1  # a draining worker would answer again on it
                            conn = self._connections.retry_on(
                                conn, connection is not None, redialled
                            )
                finally:
                    self._connections.give_back(redialled)

    async def _ask_on_stream(
        self,
        conn: Connection[grpc.aio.Channel],
        request: pb.ExplainRequest,
        timeout: float | None,
    ) -> pb.ExplainResponse:
        """See ``Client._ask_on_stream``."""
        lane = take_lane(conn.lanes) or AsyncLane(conn.stub, self._metadata)
        try:
            response = await lane.ask(request, timeout)
        except BaseException:  # cancelled too: an answer may still be on its way
            lane.close()
            raise
        give_back_lane(conn.lanes, lane)
        return lane_answer(response)

    # -- inline explanations ---------------------------------------------------------------

    async def explain(
        self,
        text: str,
        text_pair: str | None = None,
        target: TargetArg = None,
        all_classes: bool = False,
        method: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> Explanation:
        """See ``Client.explain``."""
        req = explain_request(
            text, text_pair, target, all_classes, method, request_id or new_request_id()
        )
        deadline = self._deadline(timeout)  # spreading first (once) takes its share of it
        await self._spread(deadline)
        on_stream = self.single_calls == "stream"
        resp = await self._unary("Explain", req, timeout_left(deadline), on_stream=on_stream)
        return Explanation.from_proto(resp, text=text, text_pair=text_pair)

    @overload
    async def explain_batch(
        self,
        texts: Iterable[TextItem],
        *,
        target: TargetArg = ...,
        all_classes: bool = ...,
        method: str | None = ...,
        timeout: float | None = ...,
        return_exceptions: Literal[False] = ...,
    ) -> list[Explanation]: ...

    @overload
    async def explain_batch(
        self,
        texts: Iterable[TextItem],
        *,
        target: TargetArg = ...,
        all_classes: bool = ...,
        method: str | None = ...,
        timeout: float | None = ...,
        return_exceptions: bool,
    ) -> list[Explanation | LimelightError]: ...

    async def explain_batch(
        self,
        texts: Iterable[TextItem],
        *,
        target: TargetArg = None,
        all_classes: bool = False,
        method: str | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Explanation] | list[Explanation | LimelightError]:
        """See ``Client.explain_batch``."""
        build = request_builder(target, all_classes, method, return_exceptions)
        check_many(texts, "explain_batch")
        request, sent = batch_request(texts, build)
        deadline = self._deadline(timeout)
        await self._spread(deadline)
        response = await self._unary("ExplainBatch", request, timeout_left(deadline))
        return batch_answers(response, sent, return_exceptions)

    @overload
    def explain_many(
        self,
        texts: Iterable[TextItem] | AsyncIterable[TextItem],
        *,
        target: TargetArg = ...,
        all_classes: bool = ...,
        method: str | None = ...,
        timeout: float | None = ...,
        texts_per_call: int = ...,
        text_timeout: float | None = ...,
        return_exceptions: Literal[False] = ...,
    ) -> AsyncIterator[Explanation]: ...

    @overload
    def explain_many(
        self,
        texts: Iterable[TextItem] | AsyncIterable[TextItem],
        *,
        target: TargetArg = ...,
        all_classes: bool = ...,
        method: str | None = ...,
        timeout: float | None = ...,
        texts_per_call: int = ...,
        text_timeout: float | None = ...,
        return_exceptions: bool,
    ) -> AsyncIterator[Explanation | LimelightError]: ...

    def explain_many(
        self,
        texts: Iterable[TextItem] | AsyncIterable[TextItem],
        *,
        target: TargetArg = None,
        all_classes: bool = False,
        method: str | None = None,
        timeout: float | None = None,
        texts_per_call: int = 1,
        text_timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> AsyncIterator[Explanation] | AsyncIterator[Explanation | LimelightError]:
        """See ``Client.explain_many``; ``texts`` may also be an async iterable."""
        check_many(texts, "explain_many")
        check_texts_per_call(texts_per_call)
        build = request_builder(target, all_classes, method, return_exceptions, text_timeout)
        deadline = self._deadline(timeout, default=False)
        if texts_per_call > 1:
            return self._explain_packed(texts, texts_per_call, build, deadline, return_exceptions)
        return self._explain_streamed(texts, build, deadline, return_exceptions)

    async def _explain_streamed(
        self,
        texts: Iterable[TextItem] | AsyncIterable[TextItem],
        build: Build,
        deadline: float | None,
        in_place: bool,
    ) -> AsyncIterator[Explanation | LimelightError]:
        feed = AsyncStreamFeed(texts, self.connections, build)
        silence = AsyncSilence(feed, self.timeout)
        await self._spread(deadline)
        with self._closed_as_cancelled():
            async with self._lease_all() as conns:
                metadata = self._call_metadata()
                calls = feed.open(conns, deadline, metadata)
                silence.watch(calls)  # the list: a stream opened again is watched too
                attempts = [0] * len(calls)
                ring = list(conns)  # the connections the streams are on, in turn
                on = list(range(len(calls)))  # the connection of ``ring`` each stream is on
                try:
                    for k in itertools.cycle(range(len(calls))):
                        while True:
                            silence.waiting(k)
                            try:
                                resp = await calls[k].read()
                                failure = None if resp is not grpc.aio.EOF else feed.ended_early(k)
                            except grpc.RpcError as err:
                                failure = err
                            except asyncio.CancelledError:
                                # grpc.aio cancels the call when the request iterator raises, and
                                # so does the watchdog: report the cause. Otherwise a real
                                # cancellation of our task propagates unchanged, and a cut by
                                # ``close`` becomes ``Cancelled`` (``_closed_as_cancelled``).
                                if silence.fired:
                                    raise no_answer(self.timeout) from None
                                if feed.error is not None:
                                    raise feed.error from None
                                raise
                            silence.done_waiting()
                            if failure is None:
                                break
                            await self._stream_failed(failure, feed, silence, attempts[k], deadline)
                            # A new stream sends first what the failed one did not answer,
                            # on the next connection; this one is dialled again, as its worker
                            # may be going away (the run holds both until it ends).
                            attempts[k] += 1
                            conns.append(self._connections.redial(ring[on[k]]))
                            ring[on[k]] = conns[-1]
                            on[k] = (on[k] + 1) % len(ring)
                            calls[k] = await feed.reopen(k, ring[on[k]], deadline, metadata)
                        if resp is grpc.aio.EOF:  # item i went to stream i % streams: the last one
                            break
                        attempts[k] = 0
                        yield answer(resp, feed.answered(k), in_place)
                finally:
                    silence.stop()
                    for call in calls:
                        call.cancel()
        if silence.fired:
            raise no_answer(self.timeout)
        if feed.error is not None:  # some grpc versions end the stream quietly instead
            raise feed.error
        if feed.unanswered():
            raise stream_cut_short(feed.unanswered())

    async def _stream_failed(
        self,
        failure: grpc.RpcError | LimelightError,
        feed: AsyncStreamFeed,
        silence: AsyncSilence,
        attempt: int,
        deadline: float | None,
    ) -> None:
        """See ``Client._stream_failed``."""
        if silence.fired:
            raise no_answer(self.timeout) from None
        if feed.error is not None:  # the input's own error broke the stream
            raise feed.error from None
        if isinstance(failure, grpc.RpcError) and wrote_past_the_end(failure):
            failure = Unavailable(
                grpc.StatusCode.UNAVAILABLE,
                "the stream ended while a request was being written to it (grpc.aio lost "
                "the server's status)",
            )
        error = await self._retry_or_error(failure, attempt, deadline)
        if error is not None:
            raise error from (failure if isinstance(failure, grpc.RpcError) else None)

    async def _explain_packed(
        self,
        texts: Iterable[TextItem] | AsyncIterable[TextItem],
        texts_per_call: int,
        build: Build,
        deadline: float | None,
        in_place: bool,
    ) -> AsyncIterator[Explanation | LimelightError]:
        """See ``Client._explain_packed``: grpc.aio starts each call as it is made."""
        progress = AsyncProgress()
        chunks = AsyncChunks(texts, texts_per_call, on_put=progress.nudge)
        # Each: the call, when it was sent, its connection in ``ring``, its request, its texts.
        in_flight: deque[tuple[Any, float, int, pb.ExplainBatchRequest, list[Sent]]] = deque()

        def send(request: pb.ExplainBatchRequest) -> tuple[Any, float, int]:
            on = next(turn)
            call = ring[on].stub.ExplainBatch(
                request, timeout=time_left(deadline), metadata=self._call_metadata()
            )
            call.add_done_callback(progress.answered)
            return call, time.monotonic(), on

        async def wait(call: Any, sent_at: float, more: Callable[[], bool]) -> bool:
            try:
                return await progress.wait(call.done, more, sent_at, self.timeout)
            except TimeoutError:
                raise no_answer(self.timeout) from None

        def room_and_input() -> bool:
            return len(in_flight) < window and refused is None and chunks.ready()

        # An item that cannot be sent (not a text): raised once the answers before it are out.
        refused: Exception | None = None
        try:
            await self._spread(deadline)
            with self._closed_as_cancelled():
                async with self._lease_all() as conns:
                    ring = list(conns)  # the connections the calls take in turn
                    turn = itertools.cycle(range(len(ring)))
                    window = calls_in_flight(len(conns), texts_per_call)
                    while True:
                        while len(in_flight) < window and refused is None:
                            # Wait for input only when nothing is in flight; else answer what is.
                            try:
                                chunk = await chunks.take(wait=not in_flight, deadline=deadline)
                            except TimeoutError:
                                raise deadline_error("waiting for input") from None
                            if chunk is None:
                                break
                            request, sent, refused = batch_request_upto_error(chunk, build)
                            if sent:
                                in_flight.append((*send(request), request, sent))
                        if not in_flight:
                            if refused is not None:
                                raise refused
                            return
                        call, sent_at, on, request, sent = in_flight[0]
                        # The oldest call's answer, unless input comes first: then send that.
                        if not await wait(call, sent_at, room_and_input):
                            continue
                        attempt = 0
                        while True:
                            try:
                                response = await call
                                break
                            except grpc.RpcError as err:
                                error = await self._retry_or_error(err, attempt, deadline)
                                if error is not None:
                                    raise error from err
                                # See ``Client._explain_packed``.
                                attempt += 1
                                conns.append(self._connections.redial(ring[on]))
                                ring[on] = conns[-1]
                                call, sent_at, on = send(request)
                                in_flight[0] = (call, sent_at, on, request, sent)
                                await wait(call, sent_at, lambda: False)
                        in_flight.popleft()
                        for explanation in batch_answers(response, sent, in_place):
                            yield explanation
        finally:
            chunks.close()
            for call, *_ in in_flight:
                call.cancel()

    # -- model and drift -------------------------------------------------------------------

    async def model(self, timeout: float | None = None) -> ModelInfo:
        """See ``Client.model``."""
        resp = await self._unary("GetModel", pb.GetModelRequest(), timeout)
        return ModelInfo.from_proto(resp)

    async def drift(self, top_k: int = 10, timeout: float | None = None) -> DriftReport:
        """See ``Client.drift``."""
        resp = await self._unary("GetDrift", pb.GetDriftRequest(top_k=top_k), timeout)
        return DriftReport.from_proto(resp)

    # -- health ----------------------------------------------------------------------------

    async def health(self, service: str = EXPLAINER_SERVICE, timeout: float | None = None) -> str:
        """See ``Client.health``."""
        try:
            resp = await self._unary(HEALTH_RPC, HealthCheckRequest(service=service), timeout)
        except NotFound:
            return "SERVICE_UNKNOWN"
        return health_status_name(resp)

    async def wait_ready(self, timeout: float = 60.0, poll: float = 0.2) -> None:
        """See ``Client.wait_ready``."""
        self._check_loop()
        self._connections.check_open()
        check_timeout(timeout)  # NaN or negative: ValueError (math.inf: no time-out)
        deadline = time.monotonic() + timeout
        status = "UNREACHABLE"
        waiting = list(range(self.connections))  # indices: see Client.wait_ready
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.target} not ready after {timeout} s (last: {status})")
            try:
                resp = await self._unary(
                    HEALTH_RPC,
                    HealthCheckRequest(service=EXPLAINER_SERVICE),
                    min(left, 5.0),
                    idempotent=False,
                    connection=waiting[0],
                )
                status = health_status_name(resp)
            except (Unavailable, DeadlineExceeded, NotFound, Cancelled) as exc:
                # Closed meanwhile, or what answers there is no sidecar this client can use
                # (``Unavailable.permanent``): waiting will not make it ready.
                if self._connections.closed or getattr(exc, "permanent", False):
                    raise
                status = f"{type(exc).__name__}: {exc.message}"
            if status == "SERVING":
                waiting.pop(0)
            else:
                await self._sleep(min(poll, max(deadline - time.monotonic(), 0.0)))
        await self._spread(deadline)

    # -- jobs ------------------------------------------------------------------------------

    async def submit(
        self,
        text: str,
        method: str,
        *,
        text_pair: str | None = None,
        target: TargetArg = None,
        idempotency_key: str | None = None,
        timeout_seconds: float | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> AsyncJob:
        """See ``Client.submit``."""
        req = submit_request(
            text, method, text_pair, target, idempotency_key, timeout_seconds, params
        )
        resp = await self._unary("SubmitJob", req, timeout)
        return AsyncJob(self, JobInfo.from_proto(resp), text=text, text_pair=text_pair)

    async def job(self, job_id: str, timeout: float | None = None) -> AsyncJob:
        """See ``Client.job``."""
        return AsyncJob(self, await self._get_job(job_id, timeout))

    async def jobs(
        self,
        states: Sequence[JobState | str | int] | JobState | str | None = None,
        limit: int = 50,
        timeout: float | None = None,
    ) -> list[JobInfo]:
        """See ``Client.jobs``."""
        resp = await self._unary("ListJobs", list_jobs_request(states, limit), timeout)
        return [JobInfo.from_proto(j) for j in resp.jobs]

    async def iter_jobs(
        self,
        states: Sequence[JobState | str | int] | JobState | str | None = None,
        page_size: int = 100,
        timeout: float | None = None,
    ) -> AsyncIterator[JobInfo]:
        """See ``Client.iter_jobs``."""
        token = ""
        while True:
            request = list_jobs_request(states, page_size, token)
            resp = await self._unary("ListJobs", request, timeout)
            for job in resp.jobs:
                yield JobInfo.from_proto(job)
            token = resp.next_page_token
            if not token:
                return

    async def _get_job(
        self,
        job_id: str,
        timeout: float | None,
        text: str | None = None,
        text_pair: str | None = None,
    ) -> JobInfo:
        resp = await self._unary("GetJob", get_job_request(job_id), timeout)
        return JobInfo.from_proto(resp, text=text, text_pair=text_pair)

    async def _cancel_job(
        self, job_id: str, timeout: float | None, text: str | None, text_pair: str | None
    ) -> JobInfo:
        resp = await self._unary("CancelJob", cancel_job_request(job_id), timeout)
        return JobInfo.from_proto(resp, text=text, text_pair=text_pair)

    async def _watch_job(self, job_id: str, deadline: float | None) -> AsyncIterator[pb.Job]:
        failures = 0
        while True:
            remaining = self._remaining(deadline, f"while watching job {job_id}")
            error: LimelightError | None = None
            with self._closed_as_cancelled():
                async with self._lease() as conn:
                    call = conn.stub.WatchJob(
                        get_job_request(job_id), timeout=remaining, metadata=self._call_metadata()
                    )
                    try:
                        async for msg in call:
                            failures = 0
                            yield msg
                            if terminal_state(msg.state):
                                return
                    except grpc.RpcError as err:
                        error = watch_broke(err)
                    finally:
                        call.cancel()
            if failures >= self.retry_policy.retries or not await self._backoff(failures, deadline):
                raise error or Unavailable(
                    grpc.StatusCode.UNAVAILABLE, f"watch of job {job_id} ended before it finished"
                )
            failures += 1


class AsyncJob(JobHandleBase["AsyncClient"]):
    """The asyncio counterpart of ``Job``."""

    async def refresh(self, timeout: float | None = None) -> JobInfo:
        """See ``Job.refresh``."""
        self._info = await self._client._get_job(self.id, timeout, self._text, self._text_pair)
        return self._info

    async def watch(self, timeout: float | None = None) -> AsyncIterator[JobInfo]:
        """See ``Job.watch``."""
        if self._info.done:
            yield self._info
            return
        deadline = self._client._deadline(timeout, default=False)
        async for msg in self._client._watch_job(self.id, deadline):
            self._info = JobInfo.from_proto(msg, text=self._text, text_pair=self._text_pair)
            yield self._info

    async def result(self, timeout: float | None = None) -> Explanation:
        """See ``Job.result``."""
        try:
            async for _ in self.watch(timeout):
                pass
        except DeadlineExceeded as exc:
            raise self._not_finished(timeout) from exc
        if self._info.state == JobState.SUCCEEDED and self._info.result is None:
            await self.refresh()
        return job_outcome(self._info)

    async def cancel(self, timeout: float | None = None) -> JobInfo:
        """See ``Job.cancel``."""
        self._info = await self._client._cancel_job(self.id, timeout, self._text, self._text_pair)
        return self._info
