"""Pieces shared by the sync and asyncio clients: requests, retry policy, channel setup, and
their common base class."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import random
import re
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeAlias, TypeVar

import grpc
import grpc.aio

from limelight_client._tracing import trace_context
from limelight_client.errors import Cancelled, DeadlineExceeded, LimelightError, from_rpc_error
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc as pb_grpc
from limelight_client.types import JobInfo, JobState, dict_to_struct

log = logging.getLogger(__name__)

#: Default cap on message sizes in both directions (long texts with all-class matrices).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: How long a connection may be idle before the SDK pings it (a load balancer or NAT that drops
#: idle connections silently would otherwise hang the next call until its deadline).
DEFAULT_KEEPALIVE_S = 30.0

TargetArg = str | int | None
TextItem = str | tuple[str, str | None]
#: How ``explain`` reaches the sidecar: a unary ``Explain`` call each, or one message on a
#: pooled ``ExplainStream`` (limelight_client._lanes).
SingleCalls = Literal["unary", "stream"]


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for calls that failed with UNAVAILABLE.

    ``retries`` is the number of *extra* attempts after the first one. The n-th retry
    (n = 0, 1, ...) waits a uniformly random time in ``[d/2, d]`` with
    ``d = min(backoff * 2**n, max_backoff)`` ("equal jitter": spreads a crowd of clients
    that failed together without ever retrying immediately).
    """

    retries: int = 3
    backoff: float = 0.1
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError("retries must be >= 0")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("backoff must be >= 0")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        d = min(self.backoff * (2.0**attempt), self.max_backoff)
        r = (rng or random).random()
        return d / 2 + r * d / 2

    @staticmethod
    def retryable(code: grpc.StatusCode | None) -> bool:
        # Only UNAVAILABLE means "the request never reached a live server"; anything else may
        # have done work or will fail again the same way.
        return code == grpc.StatusCode.UNAVAILABLE


#: Name-resolver schemes gRPC dials as they are (https://grpc.github.io/grpc/core/md_doc_naming.html).
_GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")
_URL = re.compile(r"^(?P<scheme>[a-z][a-z0-9+.-]*)://", re.I)


def check_target(target: str) -> str:
    """``target`` when gRPC can dial it as meant, else a ``ValueError`` that says what to give.

    A URL (``http://host:port``) or a trailing path would reach gRPC's resolver as a host name
    and fail as "the host name does not resolve"; a port above 65535 would be dialled modulo
    65536, another port than the one given."""
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"target must be an address host:port, got {target!r}")
    if target.lower().startswith(_GRPC_SCHEMES):
        return target
    url = _URL.match(target)
    if url is not None:
        rest = target[url.end() :].rstrip("/")
        tls = " with tls=True" if url["scheme"].lower() in ("https", "grpcs") else ""
        raise ValueError(
            f"target {target!r} is a URL; the client dials a gRPC address: use {rest!r}{tls}"
        )
    host, port = target, ""
    if target.startswith("["):  # [IPv6]:port
        close = target.find("]")
        host, port = target[: close + 1], target[close + 1 :].removeprefix(":")
    elif target.count(":") == 1:
        host, port = target.split(":")
    if "/" in target or not host or (target.count(":") == 1 and not port):
        raise ValueError(f"target {target!r} is not an address host:port (e.g. localhost:50051)")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"target {target!r}: the port must be a number from 1 to 65535")
    return target


def target_proto(target: TargetArg) -> pb.Target | None:
    """``str`` -> target label, ``int`` -> target class index, ``None`` -> predicted class."""
    if target is None:
        return None
    if isinstance(target, bool):  # bool is an int; almost certainly a mistake
        raise TypeError("target must be a label (str) or a class index (int), not bool")
    if isinstance(target, str):
        return pb.Target(label=target)
    if isinstance(target, int):
        return pb.Target(index=target)
    raise TypeError(f"target must be a label (str) or a class index (int), not {type(target)}")


def _check_unicode(text: str, what: str) -> None:
    """A str protobuf can send (``TypeError`` for anything else): bytes that were not UTF-8,
    decoded with "surrogateescape" (as Python reads file names, arguments and standard input),
    leave lone surrogates in it."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} is not valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}) at "
            f"character {exc.start}; bytes that are not UTF-8 read with errors='surrogateescape'? "
            "decode them with errors='replace'"
        ) from None


def explain_request(
    text: str,
    text_pair: str | None,
    target: TargetArg,
    all_classes: bool,
    method: str | None,
    request_id: str | None,
    continue_on_error: bool = False,
    timeout_seconds: float = 0.0,
) -> pb.ExplainRequest:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, not {type(text).__name__}")
    _check_unicode(text, "text")
    if text_pair is not None:
        _check_unicode(text_pair, "text_pair")
    req = pb.ExplainRequest(
        text=text,
        all_classes=all_classes,
        method=method or "",
        request_id=request_id or "",
        continue_on_error=continue_on_error,
        timeout_seconds=timeout_seconds,
        # Cheaper for the server to build and for us to read; a server that predates the
        # field answers with Token messages, which ``Explanation.from_proto`` reads as well.
        token_layout=pb.TOKEN_LAYOUT_COLUMNS,
    )
    if text_pair is not None:
        req.text_pair = text_pair
    t = target_proto(target)
    if t is not None:
        req.target.CopyFrom(t)
    return req


def split_item(item: TextItem) -> tuple[str, str | None]:
    """An ``explain_many`` item: a text, or a ``(text, text_pair)`` tuple."""
    if isinstance(item, str):
        return item, None
    if isinstance(item, tuple) and len(item) == 2:
        return item[0], item[1]
    raise TypeError("explain_many items must be str or (text, text_pair) tuples")


def submit_request(
    text: str,
    method: str,
    text_pair: str | None,
    target: TargetArg,
    idempotency_key: str | None,
    timeout_seconds: float | None,
    params: Mapping[str, Any],
) -> pb.SubmitJobRequest:
    if not method:
        raise ValueError("submit needs a method name (see Client.model().methods)")
    _check_unicode(text, "text")
    if text_pair is not None:
        _check_unicode(text_pair, "text_pair")
    req = pb.SubmitJobRequest(
        text=text,
        method=method,
        # A key makes the submit safe to retry: the server returns the same job for it.
        idempotency_key=idempotency_key or new_idempotency_key(),
        timeout_seconds=float(timeout_seconds or 0.0),
        token_layout=pb.TOKEN_LAYOUT_COLUMNS,  # read for a key that names a finished job
    )
    if text_pair is not None:
        req.text_pair = text_pair
    t = target_proto(target)
    if t is not None:
        req.target.CopyFrom(t)
    if params:
        req.parameters.CopyFrom(dict_to_struct(params))
    return req


def list_jobs_request(
    states: Sequence[JobState | str | int] | JobState | str | None,
    limit: int,
    page_token: str = "",
) -> pb.ListJobsRequest:
    if states is None:
        parsed: list[JobState] = []
    elif isinstance(states, (JobState, str, int)):
        parsed = [JobState.parse(states)]
    else:
        parsed = [JobState.parse(s) for s in states]
    # Enum names keep the request independent of the generated enum's Python type.
    return pb.ListJobsRequest(
        states=[f"JOB_STATE_{s.name}" for s in parsed], limit=limit, page_token=page_token
    )


def get_job_request(job_id: str) -> pb.GetJobRequest:
    """GetJob's and WatchJob's request: a result's tokens in columns, as ``explain_request``
    asks (a server that predates the field sends messages, which ``JobInfo`` reads as well)."""
    return pb.GetJobRequest(id=job_id, token_layout=pb.TOKEN_LAYOUT_COLUMNS)


def cancel_job_request(job_id: str) -> pb.CancelJobRequest:
    return pb.CancelJobRequest(id=job_id, token_layout=pb.TOKEN_LAYOUT_COLUMNS)


def terminal_state(value: int) -> bool:
    """Whether a protobuf JobState number is final (unknown, newer states are not)."""
    try:
        return JobState(value).terminal
    except ValueError:
        return False


def new_idempotency_key() -> str:
    return f"llc-{uuid.uuid4().hex}"


def new_request_id() -> str:
    return uuid.uuid4().hex


def _read_pem(value: str | bytes | Path | None, what: str) -> bytes | None:
    """PEM bytes given directly, or a path to a PEM file."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    path = Path(value)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} from {path}: {exc}") from exc


def _stamp(value: str | bytes | Path | None) -> tuple[int, int] | None:
    """When a PEM argument given as a path last changed (None: given as bytes, or unreadable)."""
    if value is None or isinstance(value, bytes):
        return None
    if isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        return None
    try:
        info = Path(value).stat()
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


class ChannelCredentials:
    """TLS credentials for each new connection, or None for plaintext.

    Any certificate argument implies TLS. Without ``ca_cert`` the system roots verify the
    server. ``client_cert`` and ``client_key`` (mutual TLS) come together or not at all.
    Arguments given as paths are read again when their files change (a certificate renewed by
    cert-manager): the next connection dialled presents the new one; a pair caught half-written
    keeps the previous credentials until the files make a whole one.
    """

    def __init__(
        self,
        tls: bool,
        ca_cert: str | bytes | Path | None,
        client_cert: str | bytes | Path | None,
        client_key: str | bytes | Path | None,
    ) -> None:
        if (client_cert is None) != (client_key is None):
            raise ValueError("client_cert and client_key must be given together (mutual TLS)")
        self.secure = tls or ca_cert is not None or client_cert is not None
        self._pems = {"ca_cert": ca_cert, "client_cert": client_cert, "client_key": client_key}
        self._lock = threading.Lock()
        self._stamps = self._current_stamps()
        self._credentials = self._build() if self.secure else None

    def _current_stamps(self) -> tuple[tuple[int, int] | None, ...]:
        return tuple(_stamp(value) for value in self._pems.values())

    def _build(self) -> grpc.ChannelCredentials:
        pems = {what: _read_pem(value, what) for what, value in self._pems.items()}
        return grpc.ssl_channel_credentials(
            root_certificates=pems["ca_cert"],
            private_key=pems["client_key"],
            certificate_chain=pems["client_cert"],
        )

    def _check_pair(self) -> None:
        """Whether a client certificate and key given as files belong together."""
        cert, key = self._pems["client_cert"], self._pems["client_key"]
        if _stamp(cert) is not None and _stamp(key) is not None:
            assert isinstance(cert, (str, Path)) and isinstance(key, (str, Path))
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key)

    def current(self) -> grpc.ChannelCredentials | None:
        """The credentials for a connection dialled now."""
        if self._credentials is None:
            return None
        with self._lock:
            stamps = self._current_stamps()
            if stamps != self._stamps:
                try:
                    self._check_pair()
                    credentials = self._build()
                except (ValueError, ssl.SSLError) as exc:
                    # Caught mid-update (a file missing, a key of the other certificate): keep
                    # the previous credentials; the next dial looks again.
                    log.warning("TLS files not reloaded: %s", exc)
                else:
                    self._stamps, self._credentials = stamps, credentials
            return self._credentials


#: Longest a keepalive ping of the SDK waits for its answer before the connection is closed.
KEEPALIVE_TIMEOUT_S = 10.0


def keepalive_options(keepalive: float | None) -> dict[str, Any]:
    """Ping a connection idle for ``keepalive`` seconds, with or without calls in flight, and
    close it if the ping goes unanswered (None: no pings)."""
    if keepalive is None:
        return {}
    if keepalive <= 0:
        raise ValueError("keepalive must be positive seconds, or None")
    timeout_ms = round(min(keepalive, KEEPALIVE_TIMEOUT_S) * 1000)
    return {
        "grpc.keepalive_time_ms": round(keepalive * 1000),
        "grpc.keepalive_timeout_ms": timeout_ms,
        # Any ping in flight (gRPC's own bandwidth probes too) must time out as soon: a
        # keepalive ping waits for it, and its default timeout is a minute.
        "grpc.http2.ping_timeout_ms": timeout_ms,
        "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.max_pings_without_data": 0,
    }


def channel_options(
    options: Mapping[str, Any] | Sequence[tuple[str, Any]] | None,
    max_message_bytes: int,
    keepalive: float | None = None,
) -> list[tuple[str, Any]]:
    """Default channel options, overridden by the caller's."""
    merged: dict[str, Any] = {
        **keepalive_options(keepalive),
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.max_receive_message_length": max_message_bytes,
        # gRPC's own reconnect backoff starts at 1 s; a sidecar that restarts should be
        # reachable again within our (shorter) retry backoff. Not min_reconnect_backoff_ms:
        # gRPC takes it as the shortest time a connection attempt may take (20 s by default),
        # and at 100 ms no TLS handshake, nor any link with a round trip over about 100 ms,
        # ever completed one.
        "grpc.initial_reconnect_backoff_ms": 100,
        "grpc.max_reconnect_backoff_ms": 5000,
        # Each channel its own connection: gRPC shares one between equal channels in a
        # process, and a sidecar's worker processes (`--workers`) are reached per connection.
        "grpc.use_local_subchannel_pool": 1,
    }
    if options:
        items = options.items() if isinstance(options, Mapping) else options
        merged.update(dict(items))
    return list(merged.items())


def late_bound(module: Any, name: str) -> Callable[..., Any]:
    """``module.name``, looked up at each call rather than once: a process-wide gRPC
    instrumentation (OpenTelemetry's) replaces grpc's channel constructors when it is
    installed, which may be after this package was imported or a client was created."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(module, name)(*args, **kwargs)

    return call


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata sent with every call (the bearer token, when one is configured)."""
    if token is None:
        return ()
    if not token or any(c in token for c in "\r\n"):
        raise ValueError("token must be a non-empty single-line string")
    return (("authorization", f"Bearer {token}"),)


# -- grpc.health.v1 ----------------------------------------------------------------------------
# The two health messages are built from a descriptor in a private pool: the SDK then needs no
# grpcio-health-checking, and cannot clash with it when both are imported in one process.

HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
EXPLAINER_SERVICE = "limelight.v1.Explainer"


def _health_messages() -> tuple[Any, Any]:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(
        name="limelight_client/grpc_health_v1.proto", package="grpc.health.v1", syntax="proto3"
    )
    field = descriptor_pb2.FieldDescriptorProto
    req = fdp.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    resp = fdp.message_type.add(name="HealthCheckResponse")
    status = resp.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        status.value.add(name=name, number=number)
    resp.field.add(
        name="status",
        number=1,
        type=field.TYPE_ENUM,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
        label=field.LABEL_OPTIONAL,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    request_cls = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")
    )
    response_cls = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")
    )
    return request_cls, response_cls


HealthCheckRequest, HealthCheckResponse = _health_messages()


def health_status_name(response: Any) -> str:
    """``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN`` or ``UNKNOWN``."""
    values = response.DESCRIPTOR.fields_by_name["status"].enum_type.values_by_number
    value = values.get(int(response.status))
    return str(value.name) if value is not None else "UNKNOWN"


ClientT = TypeVar("ClientT")


class JobHandleBase(Generic[ClientT]):
    """State shared by ``Job`` and ``AsyncJob``: the latest snapshot and the inputs it explains.
    The subclasses add the (sync or async) calls."""

    def __init__(
        self,
        client: ClientT,
        info: JobInfo,
        *,
        text: str | None = None,
        text_pair: str | None = None,
    ) -> None:
        self._client = client
        self._info = info
        self._text = text
        self._text_pair = text_pair

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def info(self) -> JobInfo:
        return self._info

    @property
    def state(self) -> JobState:
        return self._info.state

    @property
    def done(self) -> bool:
        return self._info.done

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(id={self.id!r}, state={self.state.name}, "
            f"progress={self._info.progress:.2f})"
        )

    def _not_finished(self, timeout: float | None) -> TimeoutError:
        """``result``'s time-out, saying where the job stood when it ran out (a job still
        queued because no worker consumes the queue says so in its message)."""
        info = self._info
        state = info.state.name.lower()
        message = info.message.strip()
        if not message or message.lower().startswith(state):
            where = message or state
        else:
            where = f"{state}: {message}"
        after = "in time" if timeout is None else f"after {timeout:g} s"
        return TimeoutError(f"job {self.id} not finished {after} ({where}, {info.progress:.0%})")


ChannelT = TypeVar("ChannelT", grpc.Channel, grpc.aio.Channel)

#: Spreading (see ``Connections``): new connections dialled per attempt, a base and so many
#: per connection. The kernel places each at random, so with two workers up a needed one lands
#: right half the time; a worker that is not listening yet (a sidecar starting) is never reached.
SPREAD_BASE_DIALS = 16
SPREAD_DIALS_PER_CONNECTION = 4
#: Deadline of each ``GetModel`` call that asks which worker a connection reached.
SPREAD_TIMEOUT_S = 5.0
#: An attempt that could not reach every worker is tried again this many seconds later,
#: doubling each time, ``SPREAD_ATTEMPTS`` attempts in all; one that found the sidecar
#: unreachable or slow (or ran out of the call's deadline), this many seconds later.
SPREAD_RETRY_S = 5.0
SPREAD_ATTEMPTS = 6
#: Once spread (or given up), the client asks again this often where its connections are: a
#: connection re-established after its worker restarted, or after it was idle, lands wherever
#: the kernel puts it. A call that fails with UNAVAILABLE brings the next look forward to
#: ``SPREAD_RETRY_S`` from then.
SPREAD_RECHECK_S = 30.0
#: Failures of a spreading question that say "not now" rather than "never".
SPREAD_LATER = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)
#: ``Connection.rpc``'s name for the standard health check.
HEALTH_RPC = "Health.Check"

#: What the spreading dialogue is told about one connection: the server's answer, or the
#: status code of the call that failed.
SpreadAnswer: TypeAlias = pb.ModelInfo | grpc.StatusCode


def spread_question_timeout(deadline: float | None) -> float:
    """The deadline of one spreading question within a call's own ``deadline``
    (``time.monotonic``): spreading never makes a call later than it allowed."""
    if deadline is None:
        return SPREAD_TIMEOUT_S
    return min(SPREAD_TIMEOUT_S, max(deadline - time.monotonic(), 0.0))


def time_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (``time.monotonic``; None: no deadline), at least 0."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def timeout_left(deadline: float | None) -> float:
    """``time_left`` as the ``timeout`` of a call that keeps ``deadline``: ``math.inf`` for no
    deadline (None would give the call the client's default timeout)."""
    left = time_left(deadline)
    return math.inf if left is None else left


def resume(
    dialogue: Generator[pb_grpc.ExplainerStub, SpreadAnswer, None], answer: SpreadAnswer
) -> pb_grpc.ExplainerStub | None:
    """Send ``answer`` to a spreading dialogue: its next question, or None once it ended."""
    try:
        return dialogue.send(answer)
    except StopIteration:
        return None


@dataclass(eq=False)
class Connection(Generic[ChannelT]):
    """One connection to the sidecar: its channel, stubs, and what the client knows of it."""

    channel: ChannelT
    stub: pb_grpc.ExplainerStub
    health: Callable[..., Any]
    instance: str = ""
    """The server process it reached when last asked ("" until asked)."""
    calls: int = 0
    """Calls using it now (``Connections.lease``)."""
    lanes: list[Any] = field(default_factory=list)
    """Its idle streams for single calls (``single_calls="stream"``; limelight_client._lanes)."""

    def rpc(self, name: str) -> Callable[..., Any]:
        """The Explainer method ``name``, or the health check (``HEALTH_RPC``)."""
        return self.health if name == HEALTH_RPC else getattr(self.stub, name)


class Connections(Generic[ChannelT]):
    """A client's own ``count`` connections to the sidecar, taken in turn by calls that hold
    them for their length (``lease``).

    With several connections and a sidecar of several worker processes (``--workers``), the
    kernel places each connection on a worker at random, so two of two connections share one
    worker half of the time. With ``spread``, before the first explanation the client asks each
    connection which process answers it (``GetModel``'s ``instance``), then dials new
    connections and keeps those that reach a worker below an even share in place of ones
    beyond it (``spreading``); every ``SPREAD_RECHECK_S`` it asks again and, if a connection
    now reaches another process (its worker restarted), spreads again. A replaced connection
    is closed as soon as no call uses it.
    """

    def __init__(
        self,
        secure: Callable[..., ChannelT],
        insecure: Callable[..., ChannelT],
        target: str,
        credentials: ChannelCredentials,
        options: list[tuple[str, Any]],
        count: int,
        spread: bool = True,
    ) -> None:
        """``secure`` / ``insecure``: grpc's (or grpc.aio's) channel constructors."""
        if count < 1:
            raise ValueError("connections must be >= 1")
        self._dial: Callable[[], ChannelT] = (
            (lambda: secure(target, credentials.current(), options=options))
            if credentials.secure
            else (lambda: insecure(target, options=options))
        )
        self.open = [self._connect(self._dial()) for _ in range(count)]
        self._turn = itertools.cycle(range(count))
        # Leases are taken and given back by the calling threads (the sync client is shared).
        self._lock = threading.Lock()
        #: Nothing (more) to spread: one connection, spreading off, or a server that does not
        #: say which process answers it (or refuses to).
        self.spread_done = count == 1 or not spread
        #: No spreading attempt before this time (``time.monotonic``).
        self.spread_after = 0.0
        self._attempts = 0
        #: Replaced connections that calls still use: closed when the last call ends.
        self.retired: list[Connection[ChannelT]] = []
        #: Channels no call uses any more, for the client to close (``take_closing``).
        self.closing: list[ChannelT] = []
        #: New channels ``spreading`` is asking where they reach: neither in use nor to close
        #: yet (another thread's ``take_closing`` must not close one while it is asked).
        self.asking: list[ChannelT] = []
        #: Set by the client's close: every later call fails at once (``lease``).
        self.closed = False
        #: The idle streams of single calls on those channels, for the client to end first.
        self.ending: list[Any] = []

    @staticmethod
    def _connect(channel: ChannelT) -> Connection[ChannelT]:
        health = channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString,
        )
        return Connection(channel, pb_grpc.ExplainerStub(channel), health)

    def __len__(self) -> int:
        return len(self.open)

    def check_open(self) -> None:
        """Raise ``closed_error`` once the client is closed."""
        if self.closed:
            raise self.closed_error()

    @staticmethod
    def closed_error() -> Cancelled:
        """What a call of a closed client raises (made after its ``close``, or cut by it)."""
        return Cancelled(
            grpc.StatusCode.CANCELLED, "this client is closed; make a new one to call again"
        )

    @contextlib.contextmanager
    def lease(self, k: int | None = None) -> Iterator[Connection[ChannelT]]:
        """Connection ``k``, or the next one in turn, held for one call (or one stream)."""
        self.check_open()
        with self._lock:
            conn = self.open[next(self._turn) if k is None else k]
            conn.calls += 1
        try:
            yield conn
        finally:
            self.give_back([conn])

    @contextlib.contextmanager
    def lease_all(self) -> Iterator[list[Connection[ChannelT]]]:
        """Every connection, in order, held together (a stream on each)."""
        self.check_open()
        with self._lock:
            held = list(self.open)
            for conn in held:
                conn.calls += 1
        try:
            yield held
        finally:
            self.give_back(held)

    def give_back(self, held: list[Connection[ChannelT]]) -> None:
        """The caller no longer uses ``held`` (replaced ones are closed once unused)."""
        with self._lock:
            for conn in held:
                conn.calls -= 1
                if not conn.calls and conn in self.retired:
                    self.retired.remove(conn)
                    self._close_later(conn)

    def redial(self, conn: Connection[ChannelT]) -> Connection[ChannelT]:
        """A new connection in place of ``conn``, whose worker answered as if going away (a
        worker draining keeps answering on the connections it has, so retrying on them would
        reach it again): a new connection reaches whichever process or pod now takes new
        ones. The caller holds ``conn`` and now also the new one, and gives both back."""
        new = self._connect(self._dial())
        new.calls = 1
        with self._lock:
            if conn in self.open:
                self.open[self.open.index(conn)] = new
                self.retired.append(conn)  # the caller still holds it: closed once given back
            else:  # ``conn`` was replaced meanwhile: the new one serves only the caller
                self.retired.append(new)
        return new

    def retry_on(
        self, conn: Connection[ChannelT], pinned: bool, held: list[Connection[ChannelT]]
    ) -> Connection[ChannelT]:
        """The connection for a unary call's next attempt after UNAVAILABLE: ``conn`` when
        the call is pinned to it, else a newly dialled one (``redial``), added to ``held``
        for the caller to give back."""
        if pinned:
            return conn
        held.append(self.redial(conn))
        return held[-1]

    def every_connection(self) -> list[Connection[ChannelT]]:
        """The connections and any replaced ones still in use."""
        return [*self.open, *self.retired]

    def idle_lane_lists(self) -> list[list[Any]]:
        """Where idle streams of single calls wait: on each connection, and those of
        connections left to close (``take_closing``)."""
        return [*(c.lanes for c in self.every_connection()), self.ending]

    def every_channel(self) -> list[ChannelT]:
        """What closing the client closes: the connections and any replaced ones."""
        with self._lock:
            return [c.channel for c in (*self.open, *self.retired)] + self.closing + self.asking

    def spread_due(self) -> bool:
        """Whether the client should run ``spreading`` before its next explanation."""
        return not self.spread_done and time.monotonic() >= self.spread_after

    def look_again_soon(self) -> None:
        """A call failed as if its worker went away: look where the connections are
        ``SPREAD_RETRY_S`` from now rather than at the next regular look."""
        self.spread_after = min(self.spread_after, time.monotonic() + SPREAD_RETRY_S)

    def _close_later(self, conn: Connection[ChannelT]) -> None:
        """Leave ``conn`` (no call uses it) for the client to close, its idle streams with it
        (the caller holds the lock)."""
        self.closing.append(conn.channel)
        self.ending.extend(conn.lanes)
        conn.lanes.clear()

    def take_closing(self) -> tuple[list[ChannelT], list[Any]]:
        """The channels left for the client to close now, and the idle streams on them to end
        gracefully first (cut by their channel's close, each would end CANCELLED in the
        sidecar's metrics)."""
        with self._lock:
            closing, self.closing = self.closing, []
            ending, self.ending = self.ending, []
        return closing, ending

    def spreading(self) -> Generator[pb_grpc.ExplainerStub, SpreadAnswer, None]:
        """One spreading attempt as a dialogue without I/O (drive it with ``resume``): yields
        the stub to ask (``GetModel``) and is sent its answer; nothing when no attempt is due
        (another caller made it meanwhile). A connection in use is never cut: it is replaced
        only by a new connection that has already answered, and closed once its calls end;
        new connections not kept are left in ``closing``."""
        if not self.spread_due():
            return
        workers, moved = 1, False
        for conn in list(self.open):
            answer = yield conn.stub
            if isinstance(answer, grpc.StatusCode):  # e.g. a sidecar not up yet: later
                self._later(answer, counted=False)
                return
            if not answer.instance:  # a server that does not say which process answers
                self.spread_done = True
                return
            # Re-established elsewhere (its worker restarted, or it was idle): start over.
            moved |= conn.instance not in ("", answer.instance)
            conn.instance = answer.instance
            workers = max(workers, answer.workers)
        if moved:
            self._attempts = 0
        elif self._attempts >= SPREAD_ATTEMPTS:  # given up, and nothing changed since
            self.spread_after = time.monotonic() + SPREAD_RECHECK_S
            return
        share = -(-len(self) // workers)  # an even share of the connections, rounded up
        for _ in range(SPREAD_BASE_DIALS + SPREAD_DIALS_PER_CONNECTION * len(self)):
            held = collections.Counter(c.instance for c in self.open)
            crowded = [k for k, c in enumerate(self.open) if held[c.instance] > share]
            if not crowded:
                self._attempts = 0
                self.spread_after = time.monotonic() + SPREAD_RECHECK_S
                return
            candidate = self._dial()
            with self._lock:
                self.asking.append(candidate)
            kept = False
            try:
                answer = yield pb_grpc.ExplainerStub(candidate)
                if answer == grpc.StatusCode.DEADLINE_EXCEEDED:  # the call's time is up
                    self._later(answer, counted=False)
                    return
                if isinstance(answer, grpc.StatusCode) or held[answer.instance] >= share:
                    continue
                self._replace(crowded[-1], candidate, answer.instance)
                kept = True
            finally:  # not kept: closed, also when the caller breaks off
                with self._lock:
                    self.asking.remove(candidate)
                    if not kept:
                        self.closing.append(candidate)
        # Some worker was never reached: it may not be listening yet (a sidecar starting).
        self._later(None, counted=True)

    def _replace(self, k: int, channel: ChannelT, instance: str) -> None:
        """Put ``channel`` (already asked: it reaches ``instance``) in connection ``k``'s
        place; the old one is closed now, or when the calls that use it end."""
        new = self._connect(channel)
        new.instance = instance
        with self._lock:
            old, self.open[k] = self.open[k], new
            if old.calls:
                self.retired.append(old)
            else:
                self._close_later(old)

    def _later(self, failure: grpc.StatusCode | None, counted: bool) -> None:
        """Leave the spreading to a later call, or give it up (a ``failure`` that will not
        pass; after the last of the ``counted`` attempts, until the placement changes)."""
        if failure is not None and failure not in SPREAD_LATER:
            self.spread_done = True
            return
        wait = SPREAD_RETRY_S
        if counted:
            self._attempts += 1
            wait *= 2 ** (self._attempts - 1)
            if self._attempts >= SPREAD_ATTEMPTS:
                wait = SPREAD_RECHECK_S
        self.spread_after = time.monotonic() + wait


PemArg = str | bytes | Path | None


def wrote_past_the_end(err: grpc.RpcError) -> bool:
    """Whether grpc.aio replaced a stream's status because a request was written after the
    server had ended the stream: it then reports ``INTERNAL: Internal error from Core`` and the
    server's own status (``UNAVAILABLE`` from a worker shutting down, say) is lost
    (grpc/grpc#36066). The sync client reports the server's status."""
    return err.code() == grpc.StatusCode.INTERNAL and err.details() == "Internal error from Core"


#: What grpc raises for a call made on a closed channel: ``ValueError`` ("Cannot invoke RPC on
#: closed channel!") from the sync API, ``UsageError`` ("Channel is closed.") from grpc.aio.
CLOSED_CHANNEL_ERRORS: tuple[type[Exception], ...] = (ValueError, grpc.aio.UsageError)


def deadline_error(what: str) -> DeadlineExceeded:
    return DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded {what}")


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` in seconds as the SDK counts it: None for no deadline, ``math.inf`` too
    (added to the clock it would be a deadline gRPC takes as already past); ``ValueError`` for
    NaN or a negative number, which no deadline can mean (0: the time is already up)."""
    if timeout is None or timeout == math.inf:
        return None
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(
            "timeout must be a number of seconds >= 0, or None (or math.inf) for no deadline; "
            f"not {timeout!r}"
        )
    return timeout


def task_cancelled() -> bool:
    """Whether the running asyncio task is being cancelled (``Task.cancel``, which must
    propagate as ``CancelledError``); also True where that cannot be told: outside a task, or
    on Python 3.10, whose tasks do not count their cancellations (``Task.cancelling``)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop
        return True
    cancelling = getattr(task, "cancelling", None)
    return cancelling is None or cancelling() > 0


class ClientBase(Generic[ChannelT]):
    """What ``Client`` and ``AsyncClient`` share: their settings, their connections, deadlines
    and the decision whether a failed call is retried. The subclasses add the calls, the
    waits and the closing of channels, each in its own (blocking or asyncio) way."""

    #: grpc's (or grpc.aio's) secure and insecure channel constructors.
    _dialers: ClassVar[tuple[Callable[..., Any], Callable[..., Any]]]

    def __init__(
        self,
        target: str = "localhost:50051",
        *,
        timeout: float | None = 10.0,
        retries: int = 3,
        backoff: float = 0.1,
        tls: bool = False,
        ca_cert: PemArg = None,
        client_cert: PemArg = None,
        client_key: PemArg = None,
        token: str | None = None,
        options: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_backoff: float = 5.0,
        connections: int = 1,
        spread: bool = True,
        single_calls: SingleCalls = "unary",
        keepalive: float | None = DEFAULT_KEEPALIVE_S,
    ) -> None:
        if single_calls not in ("unary", "stream"):
            raise ValueError(f"single_calls must be 'unary' or 'stream', not {single_calls!r}")
        self.single_calls: SingleCalls = single_calls
        self.target = target = check_target(target)
        self.timeout = check_timeout(timeout)
        self.retry_policy = RetryPolicy(retries=retries, backoff=backoff, max_backoff=max_backoff)
        self._metadata = call_metadata(token)
        secure, insecure = self._dialers
        self._connections: Connections[ChannelT] = Connections(
            secure,
            insecure,
            target,
            ChannelCredentials(tls, ca_cert, client_cert, client_key),
            channel_options(options, max_message_bytes, keepalive),
            connections,
            spread,
        )
        self._spread_lock = self._new_lock()
        self._opened()

    def _opened(self) -> None:
        """Called once the connections are made (the async client makes its finalizer)."""

    @contextlib.contextmanager
    def _closed_as_cancelled(self) -> Iterator[None]:
        """A call that ``close`` (in another thread or task) overtook raises ``Cancelled``, as
        calls after it do, rather than what grpc raises for a call on a closed channel
        (``ValueError`` from the sync API, ``UsageError`` from grpc.aio) or for one the close
        cut (``asyncio.CancelledError`` from grpc.aio, in a task nobody cancelled). A task
        that is being cancelled itself still gets its ``CancelledError``."""
        try:
            yield
        except CLOSED_CHANNEL_ERRORS as exc:
            if not self._connections.closed:
                raise
            raise self._connections.closed_error() from exc
        except asyncio.CancelledError as exc:
            if not self._connections.closed or task_cancelled():
                raise
            raise self._connections.closed_error() from exc

    def _call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata of a call made now: the configured one and, with OpenTelemetry
        installed and a span current, the caller's trace context (a gRPC instrumentation, if
        the application has one, replaces it with its own client span's). Not for the pooled
        streams of single calls, which other callers reuse: their inputs carry their own."""
        context = trace_context()
        return self._metadata + tuple(context.items()) if context else self._metadata

    def _new_lock(self) -> Any:
        """The lock that keeps two calls from spreading the connections at once."""
        raise NotImplementedError

    @property
    def connections(self) -> int:
        """How many connections this client keeps to the sidecar."""
        return len(self._connections)

    def __repr__(self) -> str:
        more = f", connections={self.connections}" if self.connections > 1 else ""
        return f"{type(self).__name__}({self.target!r}{more})"

    def _deadline(self, timeout: float | None, *, default: bool = True) -> float | None:
        """``time.monotonic`` deadline of a call with ``timeout`` (None: the client's default,
        or no deadline when ``default`` is off; ``math.inf``: no deadline)."""
        t = check_timeout(timeout) if timeout is not None else (self.timeout if default else None)
        return None if t is None else time.monotonic() + t

    @staticmethod
    def _remaining(deadline: float | None, what: str) -> float | None:
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise deadline_error(what)
        return left

    def _backoff_delay(self, attempt: int, deadline: float | None) -> float | None:
        """Seconds to wait before retry ``attempt``; None when that would pass the deadline."""
        delay = self.retry_policy.delay(attempt)
        if deadline is not None and time.monotonic() + delay >= deadline:
            return None
        return delay

    def _failed(
        self, err: grpc.RpcError | LimelightError, attempt: int, *, idempotent: bool
    ) -> tuple[LimelightError, bool]:
        """The error of a failed attempt and whether it may be tried again (UNAVAILABLE on an
        idempotent call, within the retries; the deadline is the backoff's to judge)."""
        error = err if isinstance(err, LimelightError) else from_rpc_error(err)
        if error.code == grpc.StatusCode.UNAVAILABLE:
            self._connections.look_again_soon()  # its worker may have gone
        again = (
            idempotent and attempt < self.retry_policy.retries and RetryPolicy.retryable(error.code)
        )
        return error, again
