"""The gRPC servicer: converts messages and delegates to the core service.

Every RPC goes through ``_guard``/``_guard_stream``: they time the call for Prometheus and turn
``LimelightError`` into its status code; anything unexpected is logged and returned as a generic
INTERNAL error so that internals never reach clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from limelight.api import convert
from limelight.api.auth import principal
from limelight.api.errors import client_status
from limelight.core.service import ExplanationService
from limelight.core.types import ExplainInput, Explanation, Failed
from limelight.errors import (
    InvalidArgument,
    LimelightError,
    ResourceExhausted,
    Unavailable,
    ends_the_caller,
)
from limelight.metrics import Metrics
from limelight_client.proto import explainer_pb2 as pb

Req = TypeVar("Req")
Resp = TypeVar("Resp")
SERVICE_NAME = "limelight.v1.Explainer"
#: Calls that answer several texts at once: a too large answer should be split.
_BATCH_RPCS = frozenset({"ExplainBatch", "ModelInfer"})


class MalformedRequest:
    """Stands in for a request that failed to parse (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, reason: str, message_name: str = "", bad_utf8: bool = False) -> None:
        self.reason = reason
        #: The full name of the message expected (``limelight.v1.ExplainRequest``).
        self.message_name = message_name
        #: Whether the bytes are a well-formed message but for a string that is not UTF-8.
        self.bad_utf8 = bad_utf8


_STRING = descriptor_pb2.FieldDescriptorProto.TYPE_STRING
_BYTES = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES


@functools.cache
def _lenient_class(message_cls: Any) -> Any:
    """``message_cls`` with every string field read as bytes (no UTF-8 check), from a private
    pool: the same wire format, so whether a message parses with it tells a string that is not
    UTF-8 from corrupt bytes, whatever the protobuf runtime's error texts say."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def lenient(messages: Any) -> None:
        for message in messages:
            for field in message.field:
                if field.type == _STRING:
                    field.type = _BYTES
            # A map keyed by bytes is not allowed; the entries of a map are a repeated
            # message on the wire, which is all this class needs to read.
            if message.options.map_entry:
                message.options.ClearField("map_entry")
            lenient(message.nested_type)

    def add(file: Any) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        lenient(proto.message_type)
        for extension in proto.extension:
            if extension.type == _STRING:
                extension.type = _BYTES
        pool.Add(proto)
        added.add(file.name)

    add(message_cls.DESCRIPTOR.file)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName(message_cls.DESCRIPTOR.full_name)
    )


def _bad_utf8(message_cls: Any, data: bytes, reason: str) -> bool:
    """Whether ``data``, which ``message_cls`` refused, is refused only for a string that is
    not valid UTF-8."""
    try:
        _lenient_class(message_cls).FromString(data)
    except DecodeError:
        return False
    except Exception:  # the lenient class could not be built: the runtime's own words
        return "utf" in reason.lower()
    return True


def safe_parser(message_cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except DecodeError as exc:
            reason = str(exc) or "the request is not a valid protobuf message"
            name = message_cls.DESCRIPTOR.full_name
            return MalformedRequest(reason, name, _bad_utf8(message_cls, data, reason))

    return parse


def check_request(request: Any) -> None:
    if isinstance(request, MalformedRequest):
        if request.bad_utf8:
            raise InvalidArgument(
                f"malformed request: {request.reason} (string fields must be valid UTF-8)"
            )
        name = request.message_name or "protobuf message"
        raise InvalidArgument(f"malformed request: the message is not a valid {name}")


def request_deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    if remaining is None:
        return None
    return time.monotonic() + remaining


def _expired(context: grpc.aio.ServicerContext) -> bool:
    """Whether the client's deadline has passed (gRPC answers 0 remaining once it has, also
    to a handler it cancelled for it; None: the call has no deadline)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


#: A call gRPC ends this close to its deadline ended by it: the client's deadline passes a
#: transit time before ours, and the client then resets the call (as a cancel would).
_DEADLINE_SLACK_S = 0.1


def _ended_by(context: grpc.aio.ServicerContext) -> str:
    """The status code to count for a call that gRPC ended before its answer was sent: its
    deadline passed, else the client cancelled it."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= _DEADLINE_SLACK_S:
        return "DEADLINE_EXCEEDED"
    return "CANCELLED"


def _final_code(context: grpc.aio.ServicerContext) -> str:
    """The code of a stream that ended without error, once gRPC is done with the call: OK only
    if its status went out before the deadline (``done()``: sent)."""
    if context.done() and not _expired(context):
        return "OK"
    return _ended_by(context)


def _input_or_failed(request: Any, deadline: float | None) -> ExplainInput | Failed:
    """The core's input for one ``ExplainRequest``; one that cannot be converted and asked for
    ``continue_on_error`` becomes its ``Failed`` (else the error ends the call)."""
    try:
        return convert.explain_input(request, deadline)
    except LimelightError as exc:
        if not request.continue_on_error:
            raise
        return Failed(exc, request.request_id)


class ExplainerServicer:
    def __init__(
        self,
        metrics: Metrics,
        service: ExplanationService | None = None,
        workers: int = 1,
        max_response_bytes: int | None = None,
    ) -> None:
        self.metrics = metrics
        #: The gRPC server's send limit: a larger answer is an error that says so.
        self.max_response_bytes = max_response_bytes
        #: Who answered, for ``GetModel``: this process (new at every start) and how many
        #: worker processes share its port.
        self.instance = uuid.uuid4().hex[:16]
        self.workers = workers
        #: Set once the model is loaded; until then every RPC answers UNAVAILABLE.
        self.service = service
        self._calls: set[asyncio.Task[Any]] = set()
        self._ended: set[asyncio.Task[Any]] = set()
        #: Stream calls whose handler is handing gRPC an answer to send (``end_calls``).
        self._sending: set[asyncio.Task[Any]] = set()
        self._ending = False
        #: When the last RPC started (monotonic): shutdown waits for a quiet moment.
        self._last_start = 0.0
        # Metric children by label values, made on first use: ``labels()`` builds and looks
        # up a key under a lock on every call, which the per-request path need not repeat.
        self._in_flight: dict[str, Any] = {}
        self._duration: dict[tuple[str, str], Any] = {}

    def _in_flight_gauge(self, rpc: str) -> Any:
        gauge = self._in_flight.get(rpc)
        if gauge is None:
            gauge = self._in_flight[rpc] = self.metrics.requests_in_flight.labels(rpc)
        return gauge

    def _observe_duration(self, rpc: str, code: str, seconds: float) -> None:
        histogram = self._duration.get((rpc, code))
        if histogram is None:
            histogram = self.metrics.request_duration.labels(rpc, code)
            self._duration[(rpc, code)] = histogram
        histogram.observe(seconds)

    def count_refused(self, rpc: str, code: str, seconds: float) -> None:
        """Count a call refused before its handler ran (the bearer-token check), as the guard
        counts the calls it answers."""
        self._observe_duration(rpc, code, seconds)

    def ready_service(self) -> ExplanationService:
        """The explanation service, or Unavailable while the model is still loading."""
        if self.service is None:
            raise Unavailable("the model is still loading")
        return self.service

    def _check_size(self, rpc: str, answer: Any) -> None:
        """An answer over the send limit fails with its size, not with gRPC's bare "Sent
        message larger than max" after the work is done (ByteSize: ~1 µs per 50 tokens)."""
        limit = self.max_response_bytes
        if limit is None or answer is None:
            return
        size = answer.ByteSize()
        if size > limit:
            if rpc in _BATCH_RPCS:
                hint = "send fewer texts per call, or stream them (ExplainStream)"
            elif rpc == "ListJobs":
                hint = "ask for fewer jobs per page (limit)"
            else:
                hint = "send a shorter text, or ask the operator for a larger limit"
            raise ResourceExhausted(
                f"the answer is {size / 2**20:.1f} MiB, above this server's limit of "
                f"{limit / 2**20:.1f} MiB for one message: {hint}"
            )

    # --- the guard: metrics and error mapping in one place ------------------------------------

    def _redact(self, message: str) -> str:
        return self.service.redact(message) if self.service is not None else message

    async def _fail(self, context: grpc.aio.ServicerContext, exc: BaseException) -> str:
        code, message = client_status(exc, self._redact)
        context.set_code(code)
        context.set_details(message)
        return code.name

    def _track(self) -> asyncio.Task[Any] | None:
        self._last_start = time.monotonic()
        task = asyncio.current_task()
        if task is not None:
            self._calls.add(task)
        return task

    def _shut_out(self, task: asyncio.Task[Any] | None, context: grpc.aio.ServicerContext) -> bool:
        """A call cut short by ``end_calls``: answer UNAVAILABLE (retryable) instead of
        CANCELLED."""
        if task is None or task not in self._ended:
            return False
        self._ended.discard(task)
        task.uncancel()
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details("the server is shutting down; retry on another replica")
        return True

    async def wait_quiet(self, quiet_s: float, until: float) -> None:
        """Shutdown, past the drain: wait until no RPC has started for ``quiet_s`` seconds (or
        the monotonic time ``until``). While the server runs, a call that arrives is refused
        UNAVAILABLE; one still in transit when the gRPC server stops is ended CANCELLED by gRPC
        itself, before any handler sees it."""
        while (now := time.monotonic()) < until:
            quiet_for = now - self._last_start
            if quiet_for >= quiet_s:
                return
            await asyncio.sleep(min(quiet_s - quiet_for, until - now))

    def end_calls(self) -> int:
        """Shutdown, past the drain: end every call still in flight with UNAVAILABLE (clients
        retry it) rather than letting the server's final stop cancel it. Returns how many.

        A stream whose handler waits for gRPC to send its last answer (a client that reads
        slower than the server answers) is not cancelled: cancelled there, inside gRPC's own
        send, the call ends with no status at all until the server's final stop. It ends
        itself with UNAVAILABLE as soon as that answer is sent (``_guard_stream``)."""
        self._ending = True
        calls = list(self._calls)
        for task in calls:
            if task in self._sending:
                continue
            self._ended.add(task)
            task.cancel()
        return len(calls)

    async def _guard(
        self,
        rpc: str,
        context: grpc.aio.ServicerContext,
        call: Callable[[], Awaitable[Resp]],
    ) -> Resp | None:
        start = time.monotonic()
        code = "OK"
        in_flight = self._in_flight_gauge(rpc)
        in_flight.inc()
        task = self._track()
        try:
            answer = await call()
            self._check_size(rpc, answer)
            return answer
        except asyncio.CancelledError:
            if not self._shut_out(task, context):
                # gRPC cancels the handler both when the client cancels and when its
                # deadline passes: only the deadline tells them apart.
                code = _ended_by(context)
                raise
            code = "UNAVAILABLE"
            return None
        except BaseException as exc:
            if ends_the_caller(exc):
                raise
            code = await self._fail(context, exc)
            if _expired(context):
                # The call is over: no status can be sent any more (gRPC would log each
                # attempt as an error). An expected condition: end as cancelled, count it.
                code = "DEADLINE_EXCEEDED"
                raise asyncio.CancelledError("the client's deadline passed") from None
            return None
        finally:
            self._calls.discard(task)
            in_flight.dec()
            self._observe_duration(rpc, code, time.monotonic() - start)

    async def _guard_stream(
        self,
        rpc: str,
        context: grpc.aio.ServicerContext,
        stream: Callable[[], AsyncIterator[Resp]],
        *,
        sized: bool = False,
    ) -> AsyncGenerator[Resp, None]:
        """``sized``: the stream checks its items' sizes itself (see ``_check_size``)."""
        start = time.monotonic()
        code = "OK"
        in_flight = self._in_flight_gauge(rpc)
        in_flight.inc()
        task = self._track()
        try:
            async for item in stream():
                if not sized:
                    self._check_size(rpc, item)
                if task is not None:
                    self._sending.add(task)
                try:
                    yield item
                finally:
                    if task is not None:
                        self._sending.discard(task)
                if self._ending:  # see ``end_calls``
                    raise Unavailable("the server is shutting down; retry on another replica")
        except asyncio.CancelledError:
            if not self._shut_out(task, context):
                code = _ended_by(context)  # see ``_guard``
                raise
            code = "UNAVAILABLE"
        except GeneratorExit:
            # gRPC closes a stream it stopped reading, at the yield where it waited to send:
            # the call ended (the client cancelled, or its deadline passed) while not working.
            code = _ended_by(context)
            raise
        except BaseException as exc:
            if ends_the_caller(exc):
                raise
            code = await self._fail(context, exc)
            if _expired(context):
                # The call is over: no status can be sent any more (gRPC would log each
                # attempt as an error). An expected condition: end as cancelled, count it.
                code = "DEADLINE_EXCEEDED"
                raise asyncio.CancelledError("the client's deadline passed") from None
        finally:
            self._calls.discard(task)
            in_flight.dec()
            elapsed = time.monotonic() - start
            done_callback = getattr(context, "add_done_callback", None)
            if code == "OK" and done_callback is not None:
                # A client that cancels (or whose deadline passes) ends a client stream's
                # reads as a half-close does: whether the OK reached it is known once the call
                # is over.
                done_callback(
                    lambda ended: self._observe_duration(rpc, _final_code(ended), elapsed)
                )
            else:
                self._observe_duration(rpc, code, elapsed)

    # --- RPCs -----------------------------------------------------------------------------------

    async def Explain(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.ExplainResponse:
            check_request(request)
            result = await self.ready_service().explain(
                convert.explain_input(request, request_deadline(context)), principal(context)
            )
            return convert.explanation_to_proto(result, request.token_layout)

        return await self._guard("Explain", context, call)

    async def ExplainStream(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ExplainResponse]:
        deadline = request_deadline(context)
        # Of the inputs read, not yet answered (answers keep order): layout, continue_on_error.
        asked: deque[tuple[int, bool]] = deque()

        async def inputs() -> AsyncIterator[ExplainInput | Failed]:
            async for request in requests:
                check_request(request)  # unreadable: not even its continue_on_error is known
                asked.append((request.token_layout, request.continue_on_error))
                yield _input_or_failed(request, deadline)

        async def stream() -> AsyncIterator[pb.ExplainResponse]:
            service = self.ready_service()
            async for result in service.explain_many(inputs(), caller=principal(context)):
                layout, continue_on_error = asked.popleft()
                answer = self._answer("ExplainStream", result, layout)
                try:
                    self._check_size("ExplainStream", answer)
                except ResourceExhausted as exc:
                    if not continue_on_error:
                        raise
                    answer = self._answer("ExplainStream", Failed(exc, answer.request_id), layout)
                yield answer

        guarded = self._guard_stream("ExplainStream", context, stream, sized=True)
        async with contextlib.aclosing(guarded):  # closed here when gRPC closes this one
            async for item in guarded:
                yield item

    async def ExplainBatch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.ExplainBatchResponse:
            check_request(request)
            deadline = request_deadline(context)
            service = self.ready_service()
            limit = service.settings.max_batch_request_items
            if len(request.requests) > limit:  # before any input is converted (2M: 10 s)
                raise InvalidArgument(
                    f"{len(request.requests)} inputs in one call; at most {limit} "
                    "(max_batch_request_items)"
                )
            results = await service.explain_each(
                [_input_or_failed(r, deadline) for r in request.requests], principal(context)
            )
            return pb.ExplainBatchResponse(
                responses=[
                    self._answer("ExplainBatch", result, r.token_layout)
                    for result, r in zip(results, request.requests, strict=True)
                ]
            )

        return await self._guard("ExplainBatch", context, call)

    def _answer(
        self, rpc: str, result: Explanation | Failed, token_layout: int
    ) -> pb.ExplainResponse:
        """One input's answer: its explanation, or the error it asked to be answered with."""
        if not isinstance(result, Failed):
            return convert.explanation_to_proto(result, token_layout)
        code, message = client_status(result.error, self._redact)
        self.metrics.item_errors.labels(rpc, code.name).inc()
        return pb.ExplainResponse(
            request_id=result.request_id,
            error=pb.ItemError(code=code.value[0], message=message),
        )

    async def GetModel(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.ModelInfo:
            check_request(request)
            info = convert.model_info_to_proto(self.ready_service().model_info())
            info.instance, info.workers = self.instance, self.workers
            return info

        return await self._guard("GetModel", context, call)

    async def SubmitJob(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.Job:
            check_request(request)
            job = await self.ready_service().submit_job(
                request.method,
                request.text,
                request.text_pair if request.HasField("text_pair") else None,
                convert.target_from_proto(request),
                convert.from_struct(request.parameters),
                idempotency_key=request.idempotency_key,
                timeout_s=request.timeout_seconds,
                owner=principal(context),
            )
            return convert.job_to_proto(job, request.token_layout)

        return await self._guard("SubmitJob", context, call)

    async def GetJob(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.Job:
            check_request(request)
            return convert.job_to_proto(
                await self.ready_service().get_job(request.id, principal(context)),
                request.token_layout,
            )

        return await self._guard("GetJob", context, call)

    async def WatchJob(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Job]:
        async def stream() -> AsyncIterator[pb.Job]:
            check_request(request)
            async for job in self.ready_service().watch_job(request.id, principal(context)):
                yield convert.job_to_proto(job, request.token_layout)

        guarded = self._guard_stream("WatchJob", context, stream)
        async with contextlib.aclosing(guarded):  # closed here when gRPC closes this one
            async for item in guarded:
                yield item

    async def CancelJob(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.Job:
            check_request(request)
            return convert.job_to_proto(
                await self.ready_service().cancel_job(request.id, principal(context)),
                request.token_layout,
            )

        return await self._guard("CancelJob", context, call)

    async def ListJobs(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.ListJobsResponse:
            check_request(request)
            states = []
            for value in request.states:
                state = convert.job_state_from_proto(value)
                if state is None:
                    known = "JOB_STATE_UNSPECIFIED is no state" if value == 0 else "unknown"
                    raise InvalidArgument(
                        f"states: {known} ({value}); name states to list, or none for all"
                    )
                states.append(state)
            if request.limit < 0:
                raise InvalidArgument(f"limit is {request.limit}; 0 (100 jobs) up to 1000")
            jobs, next_page = await self.ready_service().list_jobs(
                states, request.limit, principal(context), request.page_token
            )
            return pb.ListJobsResponse(
                jobs=[convert.job_to_proto(j) for j in jobs], next_page_token=next_page
            )

        return await self._guard("ListJobs", context, call)

    async def GetDrift(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.DriftReport:
            check_request(request)
            if request.top_k < 0:
                raise InvalidArgument(f"top_k is {request.top_k}; 0 (the default) or more")
            return convert.drift_to_proto(await self.ready_service().drift_report(request.top_k))

        return await self._guard("GetDrift", context, call)


def add_to_server(servicer: ExplainerServicer, server: grpc.aio.Server) -> None:
    """Register like the generated helper, but with parsers that never raise."""
    unary: dict[str, tuple[Any, Any]] = {
        "Explain": (pb.ExplainRequest, pb.ExplainResponse),
        "ExplainBatch": (pb.ExplainBatchRequest, pb.ExplainBatchResponse),
        "GetModel": (pb.GetModelRequest, pb.ModelInfo),
        "SubmitJob": (pb.SubmitJobRequest, pb.Job),
        "GetJob": (pb.GetJobRequest, pb.Job),
        "CancelJob": (pb.CancelJobRequest, pb.Job),
        "ListJobs": (pb.ListJobsRequest, pb.ListJobsResponse),
        "GetDrift": (pb.GetDriftRequest, pb.DriftReport),
    }
    handlers: dict[str, grpc.RpcMethodHandler] = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=safe_parser(req),
            response_serializer=resp.SerializeToString,
        )
        for name, (req, resp) in unary.items()
    }
    handlers["ExplainStream"] = grpc.stream_stream_rpc_method_handler(
        servicer.ExplainStream,
        request_deserializer=safe_parser(pb.ExplainRequest),
        response_serializer=pb.ExplainResponse.SerializeToString,
    )
    handlers["WatchJob"] = grpc.unary_stream_rpc_method_handler(
        servicer.WatchJob,
        request_deserializer=safe_parser(pb.GetJobRequest),
        response_serializer=pb.Job.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
