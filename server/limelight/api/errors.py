"""The one place where Limelight errors become gRPC status codes."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from limelight.errors import ErrorKind, LimelightError

log = logging.getLogger(__name__)

STATUS_BY_KIND: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.DATA_LOSS: grpc.StatusCode.DATA_LOSS,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}

#: What clients see for unexpected failures; the details go to the server log only.
INTERNAL_MESSAGE = "internal error; the server log has the details"


def status_for(kind: ErrorKind) -> grpc.StatusCode:
    return STATUS_BY_KIND[kind]


#: The same kinds as HTTP status codes (Open Inference Protocol REST and KServe v1 routes).
HTTP_STATUS_BY_KIND: dict[ErrorKind, int] = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.FAILED_PRECONDITION: 400,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.DEADLINE_EXCEEDED: 504,
    ErrorKind.UNAUTHENTICATED: 401,
    ErrorKind.UNIMPLEMENTED: 501,
    ErrorKind.CANCELLED: 499,
    ErrorKind.DATA_LOSS: 500,
    ErrorKind.INTERNAL: 500,
}


def http_status_for(kind: ErrorKind) -> int:
    return HTTP_STATUS_BY_KIND[kind]


#: Longest status message sent to clients. Messages may quote client input (a job id, a label,
#: parameter names); gRPC carries the message in a trailer, and a trailer past the peer's
#: metadata limit (16 KiB by default) replaces the real status with RESOURCE_EXHAUSTED.
MAX_DETAILS_CHARS = 1024


def client_details(message: str) -> str:
    """``message`` cut to ``MAX_DETAILS_CHARS`` characters."""
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    return message[: MAX_DETAILS_CHARS - 22] + "… (message truncated)"


def client_status(
    exc: BaseException, redact: Callable[[str], str] | None = None
) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client is shown for ``exc``: a ``LimelightError``'s own,
    through ``redact`` (the service's: server paths named, not spelled out); anything else is
    a bug, logged here with its traceback and shown as a generic INTERNAL."""
    if isinstance(exc, LimelightError):
        message = redact(exc.message) if redact is not None else exc.message
        return status_for(exc.kind), client_details(message)
    log.exception("unexpected error in RPC", exc_info=exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE
