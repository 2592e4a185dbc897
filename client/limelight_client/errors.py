"""Errors raised by the Limelight client.

Every failed RPC surfaces as a :class:`LimelightError` subclass chosen by its gRPC status code in
:func:`from_rpc_error`, the one place that maps codes to classes. Job outcomes that are not a
success surface as :class:`JobFailed` / :class:`JobCancelled` from ``Job.result()``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import grpc

if TYPE_CHECKING:
    from limelight_client.types import JobInfo

__all__ = [
    "Cancelled",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "JobCancelled",
    "JobFailed",
    "LimelightError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "from_rpc_error",
    "from_status",
]


def _rebuilt(cls: type[LimelightError], args: tuple[Any, ...]) -> LimelightError:
    """An error of class ``cls`` without running its ``__init__``; ``pickle`` and ``copy`` then
    restore its attributes (``LimelightError.__reduce__``)."""
    return cls.__new__(cls, *args)


class LimelightError(Exception):
    """Base class of every client error.

    ``code`` is the gRPC status code of the failed call (``None`` for job outcomes, which are
    not RPC failures); ``message`` is the server's message, safe to show to users.

    Errors survive ``pickle`` and ``copy`` with everything they carry (``code``, ``message``,
    ``reason``, ``answered``, ``job``, ...): one raised in a ``ProcessPoolExecutor`` worker
    reaches the parent as itself.
    """

    def __init__(self, code: grpc.StatusCode | None, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own reduction calls ``cls(*self.args)``, which is not how these are made
        # (``args`` holds the message only): rebuild without ``__init__``, then restore the
        # attributes from ``__dict__``.
        return (_rebuilt, (type(self), self.args), self.__dict__)

    def __str__(self) -> str:
        prefix = self.code.name if self.code is not None else type(self).__name__
        return f"{prefix}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class InvalidArgument(LimelightError):
    """The request was rejected: empty text, unknown label, bad parameter, ..."""


class NotFound(LimelightError):
    """The named resource (e.g. a job id) does not exist (or its result expired)."""


class FailedPrecondition(LimelightError):
    """The operation is impossible for this model (e.g. a method that needs an LM head)."""


class ResourceExhausted(LimelightError):
    """The server is at capacity (job queue or inline backlog full): try again later; or a
    request or its answer is over a size limit (the message says whose and which setting), which
    fails again the same way."""


class Unavailable(LimelightError):
    """The server cannot be reached, is not ready yet, or is draining.

    ``reason`` says why nothing could be reached at all ("connection refused", "the host name
    does not resolve", ...) when that was the failure, else ``None`` (the server answered
    UNAVAILABLE itself, or a stream broke). ``answered``: with a ``reason``, whether something
    did accept the connection but was no usable gRPC server for this client (an HTTP/1 port,
    a TLS mismatch, an untrusted certificate) — starting a sidecar there would not help."""

    def __init__(
        self,
        code: grpc.StatusCode | None,
        message: str,
        reason: str | None = None,
        *,
        answered: bool = False,
    ):
        super().__init__(code, message)
        self.reason = reason
        self.answered = answered

    @property
    def permanent(self) -> bool:
        """Whether waiting cannot help: what answered is no sidecar this client can use. Not
        so for a connection closed at once: a proxy (``kubectl port-forward``, a mesh) in front
        of a sidecar that is not listening yet closes connections that way too."""
        return self.answered and self.reason != CLOSED_AT_ONCE


class DeadlineExceeded(LimelightError):
    """The call did not finish before its deadline."""


class Unauthenticated(LimelightError):
    """Missing or wrong credentials (bearer token or client certificate)."""


class PermissionDenied(LimelightError):
    """The credentials are valid but not allowed to do this."""


class Unimplemented(LimelightError):
    """The server does not implement this RPC (older server version)."""


class Cancelled(LimelightError):
    """The call was cancelled (by the client or the server)."""


class Internal(LimelightError):
    """An unexpected server failure; the details are in the server's log, not here."""


class DataLoss(Internal):
    """Data the server stored can no longer be read (e.g. its job journal is damaged); retrying
    does not help. A subclass of :class:`Internal`, so handlers of ``Internal`` still see it."""


class JobFailed(LimelightError):
    """A job ended in state FAILED; ``message`` is the server's reason."""

    def __init__(self, message: str, job: JobInfo | None = None) -> None:
        super().__init__(None, message)
        self.job = job


class JobCancelled(LimelightError):
    """A job ended in state CANCELLED."""

    def __init__(self, message: str, job: JobInfo | None = None) -> None:
        super().__init__(None, message)
        self.job = job


_BY_CODE: dict[grpc.StatusCode, type[LimelightError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNKNOWN: Internal,
    grpc.StatusCode.DATA_LOSS: DataLoss,
}


def from_rpc_error(error: grpc.RpcError) -> LimelightError:
    """Convert a failed gRPC call (sync or asyncio) into the matching :class:`LimelightError`."""
    code: Any = None
    details: Any = None
    # grpc.RpcError itself has no accessors; the raised objects are also grpc.Call instances.
    code_fn = getattr(error, "code", None)
    details_fn = getattr(error, "details", None)
    if callable(code_fn):
        code = code_fn()
    if callable(details_fn):
        details = details_fn()
    return from_status(code, details)


_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def from_status(code: object, message: object) -> LimelightError:
    """The :class:`LimelightError` for a status: ``code`` a ``grpc.StatusCode`` or its number
    (as in an ``ItemError``), anything else read as UNKNOWN; an empty ``message`` is replaced
    by the code's name."""
    if isinstance(code, int) and not isinstance(code, bool):
        code = _CODE_BY_NUMBER.get(code)
    status = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    text = message if isinstance(message, str) and message else status.name.lower()
    if status is grpc.StatusCode.RESOURCE_EXHAUSTED:
        text = _size_limit_message(text)
    if status is grpc.StatusCode.UNAVAILABLE:
        unreachable = _unreachable(text)
        if unreachable is not None:
            where, reason, answered = unreachable
            return Unavailable(status, f"cannot reach {where}: {reason}", reason, answered=answered)
    if status is grpc.StatusCode.UNIMPLEMENTED and text == _NO_SUCH_METHOD:
        # gRPC's own answer for an RPC the server does not have: a sidecar older than the call.
        text = "this sidecar does not have the call (it is older than this SDK): upgrade it"
    return _BY_CODE.get(status, LimelightError)(status, text)


#: What a gRPC server answers (UNIMPLEMENTED) for a method it does not have.
_NO_SUCH_METHOD = "Method not found!"


#: gRPC's text when no connection could be made, by the address family it tried.
_NO_CONNECTION = (
    re.compile(r"ipv[46]:(\S+): Failed to connect to remote host: ([^;\n]+)"),
    re.compile(r"(unix:\S+): connect failed: .*?error: ([^;\n]+)"),
)
#: Why a connection failed that something accepted and closed before gRPC's first frame.
CLOSED_AT_ONCE = (
    "the connection was closed at once (not a gRPC server, or one that expects TLS or "
    "another client certificate?)"
)
#: gRPC's text when a connection was made but what answered was no gRPC server, and why.
_NOT_GRPC = (
    (
        re.compile(r"(?:ipv[46]|unix):(\S+): (?:Failed parsing HTTP/2|Trying to connect an http1)"),
        "what answers there is not a gRPC server (an HTTP/1 port, such as the metrics one?)",
    ),
    (
        re.compile(
            r"(?:ipv[46]|unix):(\S+): (?:recvmsg:)?(?:Connection reset by peer|Socket closed)"
        ),
        CLOSED_AT_ONCE,
    ),
    (
        re.compile(r"(?:ipv[46]|unix):(\S+): Tls handshake failed .*WRONG_VERSION_NUMBER"),
        "what answers there does not speak TLS (a plaintext port?): connect without TLS, or "
        "serve with TLS",
    ),
    (
        re.compile(r"(?:ipv[46]|unix):(\S+): Custom verification check failed .*Hostname"),
        "its TLS certificate does not name the host in the target: connect by a name or "
        "address the certificate lists (its subjectAltName)",
    ),
)
#: A TLS handshake that failed on the server's certificate, with OpenSSL's reason.
_NOT_TRUSTED = re.compile(
    r"(?:ipv[46]|unix):(\S+): Tls handshake failed .*CERTIFICATE_VERIFY_FAILED: ([^:;\n]+)"
)
_NOT_RESOLVED = re.compile(
    r"(?:errors resolving|DNS resolution failed for) (\S+?):? .*(?:Domain name not found|"
    r"not known|lookup error|Could not contact DNS servers|Timeout)"
)


def _unreachable(text: str) -> tuple[str, str, bool] | None:
    """Where gRPC could not connect, why, and whether something answered there, from its own
    text ("failed to connect to all addresses; last error: UNKNOWN: ipv6:%5B::1%5D:50051:
    Failed to connect to remote host: Connection refused" reads as ``("[::1]:50051",
    "connection refused", False)``), or ``None`` when the text says something else."""
    for pattern in _NO_CONNECTION:
        found = pattern.search(text)
        if found is not None:
            where = unquote(found.group(1)).removesuffix(":")
            return where, found.group(2).strip().rstrip(".").lower(), False
    for pattern, reason in _NOT_GRPC:
        found = pattern.search(text)
        if found is not None:
            return unquote(found.group(1)).removesuffix(":"), reason, True
    untrusted = _NOT_TRUSTED.search(text)
    if untrusted is not None:
        reason = (
            f"its TLS certificate is not trusted ({untrusted.group(2).strip()}): give the CA "
            "that signed it (ca_cert; --ca-cert in the CLI)"
        )
        return unquote(untrusted.group(1)).removesuffix(":"), reason, True
    resolved = _NOT_RESOLVED.search(text)
    if resolved is not None:
        return resolved.group(1), "the host name does not resolve", False
    return None


#: gRPC's own refusal of a message over a size limit, on either side of the call.
_OVER_LIMIT = re.compile(
    r"(CLIENT|SERVER): (Sent|Received) message larger than max \((\d+) vs\. (\d+)\)"
)

#: Which message went over whose limit, and the setting that sets it.
_LIMITS = {
    ("SERVER", "Received"): (
        "the request",
        "the sidecar accepts (its LIMELIGHT_MAX_MESSAGE_BYTES): "
        "send shorter texts or fewer per call",
    ),
    ("SERVER", "Sent"): (
        "the answer",
        "the sidecar sends (its LIMELIGHT_MAX_RESPONSE_BYTES): send fewer texts per call",
    ),
    ("CLIENT", "Sent"): (
        "the request",
        "this client sends (its max_message_bytes): send shorter texts or fewer per call",
    ),
    ("CLIENT", "Received"): (
        "the answer",
        "this client accepts (its max_message_bytes): raise it, or send fewer texts per call",
    ),
}


def _size_limit_message(text: str) -> str:
    """gRPC's "CLIENT: Received message larger than max (4617 vs. 3000)" as what went over
    which side's limit, and what to change."""
    found = _OVER_LIMIT.search(text)
    if found is None:
        return text
    side, verb, size, limit = found.groups()
    what, whose = _LIMITS[side, verb]
    return f"{what} is {int(size):,} bytes, more than the {int(limit):,} {whose}"
