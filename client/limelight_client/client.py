"""The synchronous Limelight client."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, Literal, overload

import grpc

from limelight_client._common import (
    EXPLAINER_SERVICE,
    HEALTH_RPC,
    ClientBase,
    Connection,
    Connections,
    HealthCheckRequest,
    JobHandleBase,
    RetryPolicy,
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
)
from limelight_client._lanes import (
    CLOSE_WAIT_S,
    SyncLane,
    Watchdog,
    give_back_lane,
    lane_answer,
    take_all_idle,
    take_lane,
)
from limelight_client._streams import (
    Build,
    Chunks,
    Progress,
    Sent,
    Silence,
    StreamFeed,
    answer,
    batch_answers,
    batch_request,
    batch_request_upto_error,
    calls_in_flight,
    check_many,
    check_texts_per_call,
    request_builder,
    stream_cut_short,
)
from limelight_client.errors import (
    Cancelled,
    DeadlineExceeded,
    Internal,
    JobCancelled,
    JobFailed,
    LimelightError,
    NotFound,
    Unavailable,
    from_rpc_error,
)
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc as pb_grpc
from limelight_client.types import (
    DriftReport,
    Explanation,
    JobInfo,
    JobState,
    ModelInfo,
)

__all__ = ["Client", "Job"]

#: Guards the lazy start of a client's ``Watchdog`` (rare: once per client).
_WATCHDOG_LOCK = threading.Lock()


def no_answer(timeout: float | None) -> DeadlineExceeded:
    """``explain_many``'s error when the server answered nothing for the client's
    ``timeout`` while the run waited for an answer (it stopped answering)."""
    return deadline_error(f"waiting for an answer: none came within {timeout:g} s")


def watch_broke(err: grpc.RpcError) -> LimelightError:
    """Why a job's watch stream broke, to reopen it after; raised at once unless retryable
    (shared with the async client)."""
    error = from_rpc_error(err)
    if not RetryPolicy.retryable(error.code):
        raise error from err
    return error


def job_outcome(info: JobInfo) -> Explanation:
    """The explanation of a finished job, or the matching error (shared with the async job)."""
    if info.state == JobState.SUCCEEDED:
        if info.result is None:
            raise Internal(grpc.StatusCode.INTERNAL, f"job {info.id} succeeded without a result")
        return info.result
    if info.state == JobState.FAILED:
        raise JobFailed(info.error or info.message or f"job {info.id} failed", job=info)
    if info.state == JobState.CANCELLED:
        raise JobCancelled(info.error or info.message or f"job {info.id} was cancelled", job=info)
    raise ValueError(f"job {info.id} is not finished (state {info.state.name})")


def _end_then_close(lanes: list[SyncLane], channels: list[grpc.Channel]) -> None:
    """End the idle ``lanes`` gracefully, waiting up to ``CLOSE_WAIT_S`` for the sidecar to
    close them (cut by their channel's close, each would end CANCELLED in its metrics), then
    close ``channels``."""
    for lane in lanes:
        lane.close(cancel=False)
    end_by = time.monotonic() + CLOSE_WAIT_S
    for lane in lanes:
        lane.wait_ended(end_by - time.monotonic())
    for channel in channels:
        channel.close()


def take_unclosed(
    name: str, connections: Connections[Any], fix: str
) -> tuple[list[Any], list[Any]] | None:
    """For the finalizer of a client garbage collected unclosed (shared with the async
    client): a ``ResourceWarning`` naming the client and ``fix``, as an unclosed file gives,
    then the client marked closed and what its ``close`` would end, its idle streams and its
    channels; None (and no warning) if it was closed after all."""
    if connections.closed:
        return None
    warnings.warn(
        f"unclosed {name}: {fix} to release its connections", ResourceWarning, stacklevel=3
    )
    connections.closed = True
    return take_all_idle(connections.idle_lane_lists()), connections.every_channel()


def _release_unclosed(
    name: str, connections: Connections[grpc.Channel], watchdog: Watchdog
) -> None:
    """What ``close`` releases, for a client of ``single_calls="stream"`` that was garbage
    collected without it (``weakref.finalize``: this must not refer to the client): its idle
    streams (each holds a gRPC thread and a stream on the sidecar), its channels and its
    watchdog's thread, ended in the background (``take_unclosed``)."""
    watchdog.close()
    unclosed = take_unclosed(name, connections, "close it (or use it in a with block)")
    if unclosed is None:
        return
    lanes, channels = unclosed
    threading.Thread(
        target=_end_then_close,
        args=(lanes, channels),
        name="limelight-close",
        daemon=True,
    ).start()


class Client(ClientBase[grpc.Channel]):
    """A connection to a Limelight sidecar.

    Args:
        target: the sidecar's gRPC address: ``host:port``, ``unix:/path`` or another gRPC name
            scheme; a URL, a path or a port outside 1-65535 raises ``ValueError``.
        timeout: default deadline in seconds for each unary call, retries included
            (``None`` or ``math.inf``: no deadline; NaN or a negative number raises
            ``ValueError``). Every method takes ``timeout=`` (the same values) to override it.
        retries: extra attempts after a call failed with UNAVAILABLE (idempotent calls only),
            each on a newly dialled connection: a worker that is draining for a restart keeps
            answering UNAVAILABLE on the connections it has.
        backoff: base of the exponential backoff between retries, in seconds (with jitter).
        tls: use TLS with the system's root certificates (implied by any certificate argument).
        ca_cert: CA certificate(s) that signed the server's certificate (PEM bytes or path).
        client_cert, client_key: the client's certificate and key for mutual TLS. Given as
            paths, the certificate files are read again when they change (a renewal), and
            each connection dialled from then on presents the new ones: a connection the
            sidecar refuses with the old certificate is retried on a new one.
        token: bearer token, sent as ``authorization: Bearer <token>`` metadata on every call.
        options: extra gRPC channel options (mapping or ``(key, value)`` pairs); they override
            the defaults, e.g. ``{"grpc.max_receive_message_length": 128 << 20}``.
        max_message_bytes: send/receive message size limit (default 64 MiB).
        max_backoff: cap on one backoff wait, in seconds.
        connections: how many connections to open to the sidecar. A sidecar run with
            ``limelight serve --workers N`` serves each connection from one worker process,
            so open at least ``N`` to use them all: unary calls take the connections in turn
            and ``explain_many`` keeps a stream on each. Every client has its own
            connections (gRPC would otherwise share one between clients in a process).
        spread: with several connections, spread them evenly over the sidecar's workers:
            before the first explanation (or at the end of :meth:`wait_ready`) the client asks
            each connection which worker answers it and swaps those beyond an even share of
            one worker for new connections that reach another (the kernel places connections
            at random). A worker not reached yet, e.g. still starting, is looked for again
            later (after 5 s, doubling, six attempts); a sidecar not up yet, 5 s later. Then
            it asks again every 30 s (5 s after a call failed with ``UNAVAILABLE``): a
            connection whose worker restarted is re-established wherever the kernel puts it,
            and one found on another process starts the spreading over. A replaced connection
            is closed when the last call on it ends. The questions count against the deadline
            of the call that asks them. Off: connections stay as placed.
        single_calls: how :meth:`explain` reaches the sidecar. ``"unary"`` (the default): one
            ``Explain`` call each. ``"stream"``: each is one message on an ``ExplainStream`` the
            client keeps open and reuses (one input in flight per stream, up to 32 idle ones
            kept per connection, each renewed after 3 s so that a server's connection ageing
            still moves the client), which costs the sidecar far less CPU than a call of its
            own and answers sooner; deadlines, retries on ``UNAVAILABLE`` and the errors raised are
            the same. The sidecar then counts these inputs under ``rpc="ExplainStream"`` (its
            per-input latency: ``limelight_inline_stage_duration_seconds{stage="total"}``), and
            gRPC interceptors see one long call per stream rather than one per input. With
            OpenTelemetry installed, each input carries its caller's current trace context
            (``ExplainRequest.trace_context``), so the sidecar traces it in the caller's trace
            (other calls carry it in their metadata).
        keepalive: ping a connection idle for this many seconds, with or without calls in
            flight (default 30; ``None``: never). A ping unanswered within 10 s closes the
            connection, and the next call dials a new one: a load balancer or NAT that
            dropped an idle connection without a word would otherwise hang that call until
            its deadline. Limelight servers accept pings every 10 s or more
            (``LIMELIGHT_KEEPALIVE_MIN_CLIENT_INTERVAL_S``); other servers may answer pings
            that come more often than every 5 minutes by closing the connection.

    Tracing: with OpenTelemetry installed (the SDK does not require it), every call carries
    the caller's current trace context as W3C ``traceparent`` metadata, so that a sidecar
    with tracing on traces it in the caller's trace; an application's gRPC instrumentation
    (OpenTelemetry's ``GrpcInstrumentorClient``) also applies to the channels of clients
    created after it is installed, and its client span then takes that place.

    Use it as a context manager (or call :meth:`close`) to release the connections. A client of
    ``single_calls="stream"`` that is garbage collected unclosed releases them then, with a
    ``ResourceWarning`` (its pooled streams would otherwise keep threads and streams open on
    the sidecar for the life of the process).
    """

    _dialers = (late_bound(grpc, "secure_channel"), late_bound(grpc, "insecure_channel"))
    _sleep = staticmethod(time.sleep)
    #: Cancels single calls on streams at their deadline (started with the first of them).
    _watchdog: Watchdog | None = None
    #: Releases the streams, channels and watchdog of a client collected unclosed (made with
    #: the watchdog).
    _finalizer: weakref.finalize | None = None

    def _new_lock(self) -> threading.Lock:
        return threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connections; calls in flight are cancelled. The idle streams of
        ``single_calls="stream"`` are ended first (waiting up to half a second for the
        sidecar to close them). Later calls raise ``Cancelled``."""
        self._connections.closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        lanes = take_all_idle(self._connections.idle_lane_lists())
        _end_then_close(lanes, self._connections.every_channel())
        if self._watchdog is not None:
            self._watchdog.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _lease(self, k: int | None = None) -> Iterator[Connection[grpc.Channel]]:
        """Connection ``k`` or the next in turn, held for one call (``Connections.lease``)."""
        try:
            with self._connections.lease(k) as conn:
                yield conn
        finally:
            self._close_released()

    @contextlib.contextmanager
    def _lease_all(self) -> Iterator[list[Connection[grpc.Channel]]]:
        try:
            with self._connections.lease_all() as conns:
                yield conns
        finally:
            self._close_released()

    def _close_released(self) -> None:
        """Close what spreading replaced or dialled and no call uses any more; with idle
        streams on it, in the background, so that the call that released it does not wait
        for them to end."""
        channels, lanes = self._connections.take_closing()
        if lanes:
            threading.Thread(
                target=_end_then_close, args=(lanes, channels), name="limelight-close", daemon=True
            ).start()
            return
        for channel in channels:
            channel.close()

    def _spread(self, deadline: float | None) -> None:
        """Spread the connections over the sidecar's workers (``Connections.spreading``)."""
        if self._connections.spread_due():
            with self._closed_as_cancelled(), self._spread_lock:
                dialogue = self._connections.spreading()
                stub = next(dialogue, None)
                while stub is not None:
                    stub = resume(dialogue, self._ask_instance(stub, deadline))
                self._close_released()

    def _ask_instance(self, stub: pb_grpc.ExplainerStub, deadline: float | None) -> SpreadAnswer:
        timeout = spread_question_timeout(deadline)
        if timeout <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        try:
            return stub.GetModel(
                pb.GetModelRequest(), timeout=timeout, metadata=self._call_metadata()
            )
        except grpc.RpcError as err:
            return err.code()

    def _backoff(self, attempt: int, deadline: float | None) -> bool:
        """Sleep before retry ``attempt``; False when that would pass the deadline."""
        delay = self._backoff_delay(attempt, deadline)
        if delay is None:
            return False
        self._sleep(delay)
        return True

    def _retry_or_error(
        self,
        err: grpc.RpcError | LimelightError,
        attempt: int,
        deadline: float | None,
        *,
        idempotent: bool = True,
    ) -> LimelightError | None:
        """What a failed attempt raises, or None once backed off for attempt ``attempt + 1``."""
        error, again = self._failed(err, attempt, idempotent=idempotent)
        return None if again and self._backoff(attempt, deadline) else error

    def _unary(
        self,
        method: str,
        request: Any,
        timeout: float | None,
        *,
        idempotent: bool = True,
        connection: int | None = None,
        on_stream: bool = False,
    ) -> Any:
        """One unary call of ``method`` (``Connection.rpc``) under one deadline, on connection
        ``connection`` or the next in turn, retried on UNAVAILABLE when idempotent; with
        ``on_stream``, one message on a pooled ``ExplainStream`` instead (``_ask_on_stream``)."""
        deadline = self._deadline(timeout)
        attempt = 0
        redialled: list[Connection[grpc.Channel]] = []
        with self._closed_as_cancelled(), self._lease(connection) as conn:
            try:
                while True:
                    remaining = self._remaining(deadline, "before the call could be (re)tried")
                    try:
                        if on_stream:
                            return self._ask_on_stream(conn, request, remaining)
                        return conn.rpc(method)(
                            request, timeout=remaining, metadata=self._call_metadata()
                        )
                    except (grpc.RpcError, LimelightError) as err:
                        error = self._retry_or_error(err, attempt, deadline, idempotent=idempotent)
                        if error is not None:
                            raise error from (err if error is not err else None)
                        attempt += 1  # a draining worker would answer again on this connection
                        conn = self._connections.retry_on(conn, connection is not None, redialled)
            finally:
                self._connections.give_back(redialled)

    def _ask_on_stream(
        self, conn: Connection[grpc.Channel], request: pb.ExplainRequest, timeout: float | None
    ) -> pb.ExplainResponse:
        """``request`` as one message on an idle stream of ``conn`` (opened if none is)."""
        lane = take_lane(conn.lanes)
        if lane is None:
            with _WATCHDOG_LOCK:
                if self._watchdog is None:
                    self._watchdog = Watchdog()
                    self._finalizer = weakref.finalize(
                        self, _release_unclosed, repr(self), self._connections, self._watchdog
                    )
                    self._finalizer.atexit = False  # the process ends them at exit anyway
            lane = SyncLane(conn.stub, self._metadata, self._watchdog)
        try:
            response = lane.ask(request, timeout)
        except BaseException:
            lane.close()  # an answer may still be on its way: the stream is spent
            raise
        give_back_lane(conn.lanes, lane)
        return lane_answer(response)

    # -- inline explanations ---------------------------------------------------------------

    def explain(
        self,
        text: str,
        text_pair: str | None = None,
        target: TargetArg = None,
        all_classes: bool = False,
        method: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> Explanation:
        """Classify ``text`` (and ``text_pair``) and explain it with an inline method.

        ``target`` picks the class to explain: a label name, a class index, or ``None`` for
        the predicted class. ``all_classes`` also returns the token x class matrix.
        """
        req = explain_request(
            text, text_pair, target, all_classes, method, request_id or new_request_id()
        )
        deadline = self._deadline(timeout)  # spreading first (once) takes its share of it
        self._spread(deadline)
        on_stream = self.single_calls == "stream"
        resp = self._unary("Explain", req, timeout_left(deadline), on_stream=on_stream)
        return Explanation.from_proto(resp, text=text, text_pair=text_pair)

    @overload
    def explain_batch(
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
    def explain_batch(
        self,
        texts: Iterable[TextItem],
        *,
        target: TargetArg = ...,
        all_classes: bool = ...,
        method: str | None = ...,
        timeout: float | None = ...,
        return_exceptions: bool,
    ) -> list[Explanation | LimelightError]: ...

    def explain_batch(
        self,
        texts: Iterable[TextItem],
        *,
        target: TargetArg = None,
        all_classes: bool = False,
        method: str | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Explanation] | list[Explanation | LimelightError]:
        """Explain several inputs with one ``ExplainBatch`` call; results in input order.

        Items are texts or ``(text, text_pair)`` tuples, at most the server's
        ``max_batch_request_items`` (256 by default). One call costs the server far less per
        input than one ``explain`` each: for bulk work send chunks of 16-64. The call is
        retried on UNAVAILABLE like ``explain``; an input the server refuses fails the whole
        call (``InvalidArgument``, its position in the message) — unless
        ``return_exceptions``: then each input the server refuses or fails is answered in its
        place by its error (a ``LimelightError``, as ``explain`` would have raised it), and the
        others as usual.
        """
        build = request_builder(target, all_classes, method, return_exceptions)
        check_many(texts, "explain_batch")
        request, sent = batch_request(texts, build)
        deadline = self._deadline(timeout)
        self._spread(deadline)
        response = self._unary("ExplainBatch", request, timeout_left(deadline))
        return batch_answers(response, sent, return_exceptions)

    @overload
    def explain_many(
        self,
        texts: Iterable[TextItem],
        *,
        target: TargetArg = ...,
        all_classes: bool = ...,
        method: str | None = ...,
        timeout: float | None = ...,
        texts_per_call: int = ...,
        text_timeout: float | None = ...,
        return_exceptions: Literal[False] = ...,
    ) -> Iterator[Explanation]: ...

    @overload
    def explain_many(
        self,
        texts: Iterable[TextItem],
        *,
        target: TargetArg = ...,
        all_classes: bool = ...,
        method: str | None = ...,
        timeout: float | None = ...,
        texts_per_call: int = ...,
        text_timeout: float | None = ...,
        return_exceptions: bool,
    ) -> Iterator[Explanation | LimelightError]: ...

    def explain_many(
        self,
        texts: Iterable[TextItem],
        *,
        target: TargetArg = None,
        all_classes: bool = False,
        method: str | None = None,
        timeout: float | None = None,
        texts_per_call: int = 1,
        text_timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> Iterator[Explanation] | Iterator[Explanation | LimelightError]:
        """Explain many inputs; yields results in input order.

        Items are texts or ``(text, text_pair)`` tuples (one ``str`` instead of an iterable of them
        is refused with ``TypeError``); ``texts`` is consumed lazily, so it
        may be a generator. ``timeout`` bounds the whole run (default: no deadline, since the
        input's length is open-ended).

        By default every item is one message on an ``ExplainStream``, one stream per connection,
        items dealt to them in turn: each answer comes back as soon as it is ready. A stream
        that fails with UNAVAILABLE (its worker going away: drained for a restart, or gone) is
        opened again on the next connection, with the client's retries and backoff, and the
        failed connection is dialled again (a draining worker keeps answering on the connections
        it has); what the stream had been sent and had not answered goes out again first, so
        every item is answered once, in order. With ``texts_per_call=N`` the items go in
        ``ExplainBatch`` calls of up to N instead (16-64 cost the server far less per text; at
        most its ``max_batch_request_items``), about 128 texts in flight per connection (at
        least two calls). The input is then read that far ahead, in a thread of its own unless
        it is a list or tuple; when it pauses, a call goes out with the items that have arrived
        and the answers in flight are yielded, so a slow trickle is answered as it comes, and
        ``timeout`` also bounds the wait for input. Each call is retried on UNAVAILABLE like
        ``explain_batch``; a call that only queues behind the run's own earlier calls, or is
        answered out of order, is not cut short. An input the server refuses fails the run
        (``InvalidArgument``, with its position in its call).

        Either way, a server that stops answering does not hang the run: when nothing the run
        waits for is answered for the client's own ``timeout``, it fails with
        ``DeadlineExceeded``. The silence counts from the last answer, or from when the awaited
        item went out if later; pauses of the input and of the caller do not count.

        ``return_exceptions=True`` keeps the run going past inputs that fail: each is yielded
        in its place as its error (a ``LimelightError`` — ``InvalidArgument`` for a text the
        server refuses, ``ResourceExhausted`` when it is at capacity, ...), the way ``explain``
        would have raised it, and the others are answered as usual. Failures of the run itself
        (a server that cannot be reached or stops answering) are still raised.

        ``text_timeout`` gives each input its own budget on the server, counted from when the
        server reads it (the run's ``timeout`` bounds the whole run): an input not computed in
        time — behind a backlog, say — is skipped rather than computed late and fails with
        ``DeadlineExceeded``, which ends the run unless ``return_exceptions=True``.
        """
        check_many(texts, "explain_many")
        check_texts_per_call(texts_per_call)
        build = request_builder(target, all_classes, method, return_exceptions, text_timeout)
        deadline = self._deadline(timeout, default=False)
        if texts_per_call > 1:
            return self._explain_packed(texts, texts_per_call, build, deadline, return_exceptions)
        return self._explain_streamed(texts, build, deadline, return_exceptions)

    def _explain_streamed(
        self, texts: Iterable[TextItem], build: Build, deadline: float | None, in_place: bool
    ) -> Iterator[Explanation | LimelightError]:
        feed = StreamFeed(texts, self.connections, build)
        silence = Silence(feed, self.timeout)
        self._spread(deadline)
        with self._closed_as_cancelled(), self._lease_all() as conns:
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
                            resp = next(calls[k], None)
                            failure = None if resp is not None else feed.ended_early(k)
                        except grpc.RpcError as err:
                            failure = err
                        silence.done_waiting()
                        if failure is None:
                            break
                        self._stream_failed(failure, feed, silence, attempts[k], deadline)
                        # A new stream sends first what the failed one did not answer,
                        # on the next connection; this one is dialled again, as its worker
                        # may be going away (the run holds both until it ends).
                        attempts[k] += 1
                        conns.append(self._connections.redial(ring[on[k]]))
                        ring[on[k]] = conns[-1]
                        on[k] = (on[k] + 1) % len(ring)
                        calls[k] = feed.reopen(k, ring[on[k]], deadline, metadata)
                    if resp is None:  # item i went to stream i % streams: this was the last
                        break
                    attempts[k] = 0
                    yield answer(resp, feed.answered(k), in_place)
            finally:
                silence.stop()
                feed.close()
                for call in calls:
                    call.cancel()  # no-op when finished; stops the streams if the caller broke off
        if silence.fired:
            raise no_answer(self.timeout)
        if feed.error is not None:  # some grpc versions end the stream quietly instead
            raise feed.error
        if feed.unanswered():
            raise stream_cut_short(feed.unanswered())

    def _stream_failed(
        self,
        failure: grpc.RpcError | LimelightError,
        feed: StreamFeed,
        silence: Silence,
        attempt: int,
        deadline: float | None,
    ) -> None:
        """A stream of ``explain_many`` failed (or ended owing answers): raises what the run
        fails with, or returns once backed off to open it again."""
        if silence.fired:
            raise no_answer(self.timeout) from None
        if feed.error is not None:  # the input's own error broke the stream
            raise feed.error from None
        error = self._retry_or_error(failure, attempt, deadline)
        if error is not None:
            raise error from (failure if isinstance(failure, grpc.RpcError) else None)

    def _explain_packed(
        self,
        texts: Iterable[TextItem],
        texts_per_call: int,
        build: Build,
        deadline: float | None,
        in_place: bool,
    ) -> Iterator[Explanation | LimelightError]:
        progress = Progress()
        chunks = Chunks(texts, texts_per_call, on_put=progress.nudge)
        self._spread(deadline)
        # Each: the call, when it was sent, its connection in ``ring``, its request (sent
        # again on a retry), its texts.
        in_flight: deque[tuple[grpc.Future, float, int, pb.ExplainBatchRequest, list[Sent]]] = (
            deque()
        )

        def send(request: pb.ExplainBatchRequest) -> tuple[grpc.Future, float, int]:
            on = next(turn)
            call = ring[on].stub.ExplainBatch.future(
                request, timeout=time_left(deadline), metadata=self._call_metadata()
            )
            call.add_done_callback(progress.answered)
            return call, time.monotonic(), on

        def wait(call: grpc.Future, sent_at: float, more: Callable[[], bool]) -> bool:
            try:
                return progress.wait(call.done, more, sent_at, self.timeout)
            except TimeoutError:
                raise no_answer(self.timeout) from None

        # An item that cannot be sent (not a text): raised once the answers before it are out.
        refused: Exception | None = None
        with self._closed_as_cancelled(), self._lease_all() as conns:
            ring = list(conns)  # the connections the calls take in turn
            turn = itertools.cycle(range(len(ring)))
            window = calls_in_flight(len(conns), texts_per_call)

            def room_and_input() -> bool:
                return len(in_flight) < window and refused is None and chunks.ready()

            try:
                while True:
                    while len(in_flight) < window and refused is None:
                        # Wait for input only when nothing is in flight; else answer what is.
                        try:
                            chunk = chunks.take(wait=not in_flight, deadline=deadline)
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
                    if not wait(call, sent_at, room_and_input):
                        continue
                    attempt = 0
                    while True:
                        try:
                            response = call.result()
                            break
                        except grpc.RpcError as err:
                            error = self._retry_or_error(err, attempt, deadline)
                            if error is not None:
                                raise error from err
                            # Sent again on the next connection; this one is dialled again
                            # (its worker may be draining; the run holds both until it ends).
                            attempt += 1
                            conns.append(self._connections.redial(ring[on]))
                            ring[on] = conns[-1]
                            call, sent_at, on = send(request)
                            # Kept in flight until answered: cancelled if we stop.
                            in_flight[0] = (call, sent_at, on, request, sent)
                            wait(call, sent_at, lambda: False)
                    in_flight.popleft()
                    yield from batch_answers(response, sent, in_place)
            finally:
                chunks.close()
                for call, *_ in in_flight:
                    call.cancel()  # no-op when finished; stops the calls if the caller broke off

    # -- model and drift -------------------------------------------------------------------

    def model(self, timeout: float | None = None) -> ModelInfo:
        """Labels, methods, layers and limits of the served model."""
        return ModelInfo.from_proto(self._unary("GetModel", pb.GetModelRequest(), timeout))

    def drift(self, top_k: int = 10, timeout: float | None = None) -> DriftReport:
        """The attribution-drift report (``top_k`` rising and falling tokens per label)."""
        resp = self._unary("GetDrift", pb.GetDriftRequest(top_k=top_k), timeout)
        return DriftReport.from_proto(resp)

    # -- health ----------------------------------------------------------------------------

    def health(self, service: str = EXPLAINER_SERVICE, timeout: float | None = None) -> str:
        """The standard gRPC health status of ``service`` ("" for the whole server).

        Returns ``"SERVING"`` (model loaded and warmed), ``"NOT_SERVING"`` (starting or
        draining), ``"SERVICE_UNKNOWN"`` or ``"UNKNOWN"``.
        """
        try:
            resp = self._unary(HEALTH_RPC, HealthCheckRequest(service=service), timeout)
        except NotFound:
            return "SERVICE_UNKNOWN"
        return health_status_name(resp)

    def wait_ready(self, timeout: float = 60.0, poll: float = 0.2) -> None:
        """Block until the sidecar reports SERVING on every connection; ``TimeoutError``
        after ``timeout`` s, saying the last status or error seen.

        Useful right after start-up: the port opens before the model is loaded (and with
        ``--workers``, each connection's worker loads its own). Then, with several
        connections, spreads them over the workers (see ``spread``). A closed client raises
        ``Cancelled`` at once, as its other calls do. Where something answers that is no
        sidecar this client can use (an HTTP/1 port, a TLS mismatch), the ``Unavailable``
        saying so (``answered``) is raised at once: no start-up there would make it ready.
        """
        self._connections.check_open()
        check_timeout(timeout)  # NaN or negative: ValueError (math.inf: no time-out)
        deadline = time.monotonic() + timeout
        status = "UNREACHABLE"
        # Connection indices, not the connections: spreading (by another thread) may replace
        # one meanwhile.
        waiting = list(range(self.connections))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.target} not ready after {timeout} s (last: {status})")
            try:
                status = health_status_name(
                    self._unary(
                        HEALTH_RPC,
                        HealthCheckRequest(service=EXPLAINER_SERVICE),
                        min(left, 5.0),
                        idempotent=False,  # this loop is the retry
                        connection=waiting[0],
                    )
                )
            except (Unavailable, DeadlineExceeded, NotFound, Cancelled) as exc:
                # Closed meanwhile, or what answers there is no sidecar this client can use
                # (``Unavailable.permanent``): waiting will not make it ready.
                if self._connections.closed or getattr(exc, "permanent", False):
                    raise
                status = f"{type(exc).__name__}: {exc.message}"
            if status == "SERVING":
                waiting.pop(0)
            else:
                self._sleep(min(poll, max(deadline - time.monotonic(), 0.0)))
        self._spread(deadline)

    # -- jobs ------------------------------------------------------------------------------

    def submit(
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
    ) -> Job:
        """Queue an expensive attribution ``method`` as a job and return its handle.

        Keyword ``params`` are the method's parameters (JSON-like values). ``timeout_seconds``
        is the job's own run-time limit on the server; ``timeout`` the deadline of this call.
        Without an ``idempotency_key`` a fresh one is generated, so retrying the submit after
        UNAVAILABLE can never queue the job twice.
        """
        req = submit_request(
            text, method, text_pair, target, idempotency_key, timeout_seconds, params
        )
        resp = self._unary("SubmitJob", req, timeout, idempotent=True)
        return Job(self, JobInfo.from_proto(resp), text=text, text_pair=text_pair)

    def job(self, job_id: str, timeout: float | None = None) -> Job:
        """A handle on an existing job (``NotFound`` if unknown or expired)."""
        return Job(self, self._get_job(job_id, timeout))

    def jobs(
        self,
        states: Sequence[JobState | str | int] | JobState | str | None = None,
        limit: int = 50,
        timeout: float | None = None,
    ) -> list[JobInfo]:
        """Recent jobs, newest first, optionally only those in ``states`` (names like
        ``"running"`` work); at most ``limit`` (the server answers up to 1000; ``iter_jobs``
        reads them all)."""
        resp = self._unary("ListJobs", list_jobs_request(states, limit), timeout)
        return [JobInfo.from_proto(j) for j in resp.jobs]

    def iter_jobs(
        self,
        states: Sequence[JobState | str | int] | JobState | str | None = None,
        page_size: int = 100,
        timeout: float | None = None,
    ) -> Iterator[JobInfo]:
        """Every job the server lists (optionally only those in ``states``), newest first,
        read ``page_size`` at a time; ``timeout`` bounds each page's call. A job submitted
        meanwhile is not among them; none comes twice."""
        token = ""
        while True:
            request = list_jobs_request(states, page_size, token)
            resp = self._unary("ListJobs", request, timeout)
            for job in resp.jobs:
                yield JobInfo.from_proto(job)
            token = resp.next_page_token
            if not token:
                return

    def _get_job(
        self,
        job_id: str,
        timeout: float | None,
        text: str | None = None,
        text_pair: str | None = None,
    ) -> JobInfo:
        resp = self._unary("GetJob", get_job_request(job_id), timeout)
        return JobInfo.from_proto(resp, text=text, text_pair=text_pair)

    def _cancel_job(
        self, job_id: str, timeout: float | None, text: str | None, text_pair: str | None
    ) -> JobInfo:
        # Cancelling twice has the same effect as once, so retrying is safe.
        resp = self._unary("CancelJob", cancel_job_request(job_id), timeout)
        return JobInfo.from_proto(resp, text=text, text_pair=text_pair)

    def _watch_job(self, job_id: str, deadline: float | None) -> Iterator[pb.Job]:
        """WatchJob until a terminal state, reopening the stream after UNAVAILABLE."""
        failures = 0
        while True:
            remaining = self._remaining(deadline, f"while watching job {job_id}")
            error: LimelightError | None = None
            with self._closed_as_cancelled(), self._lease() as conn:
                call = conn.stub.WatchJob(
                    get_job_request(job_id), timeout=remaining, metadata=self._call_metadata()
                )
                try:
                    for msg in call:
                        failures = 0
                        yield msg
                        if terminal_state(msg.state):
                            return
                except grpc.RpcError as err:
                    error = watch_broke(err)
                finally:
                    call.cancel()
            # The stream broke (UNAVAILABLE) or ended early (server draining): reopen it.
            if failures >= self.retry_policy.retries or not self._backoff(failures, deadline):
                raise error or Unavailable(
                    grpc.StatusCode.UNAVAILABLE, f"watch of job {job_id} ended before it finished"
                )
            failures += 1


class Job(JobHandleBase["Client"]):
    """A handle on a server-side job. ``info`` is the latest snapshot seen by this handle."""

    def refresh(self, timeout: float | None = None) -> JobInfo:
        """Fetch the job's current state."""
        self._info = self._client._get_job(self.id, timeout, self._text, self._text_pair)
        return self._info

    def watch(self, timeout: float | None = None) -> Iterator[JobInfo]:
        """Yield a snapshot each time the job's state or progress changes, until it finishes.

        ``timeout`` bounds the whole watch (default: none); it raises ``DeadlineExceeded``.
        """
        if self._info.done:
            yield self._info
            return
        deadline = self._client._deadline(timeout, default=False)
        for msg in self._client._watch_job(self.id, deadline):
            self._info = JobInfo.from_proto(msg, text=self._text, text_pair=self._text_pair)
            yield self._info

    def result(self, timeout: float | None = None) -> Explanation:
        """Wait for the job to finish and return its explanation.

        Raises ``JobFailed`` / ``JobCancelled`` (with the server's message) when it did not
        succeed, and ``TimeoutError`` when it is not finished after ``timeout`` seconds.
        """
        try:
            for _ in self.watch(timeout):
                pass
        except DeadlineExceeded as exc:
            raise self._not_finished(timeout) from exc
        if self._info.state == JobState.SUCCEEDED and self._info.result is None:
            self.refresh()  # the watch stream may leave the (large) result out
        return job_outcome(self._info)

    def cancel(self, timeout: float | None = None) -> JobInfo:
        """Ask the server to cancel the job; returns the state right after the request."""
        self._info = self._client._cancel_job(self.id, timeout, self._text, self._text_pair)
        return self._info
