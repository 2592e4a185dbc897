"""The one error hierarchy of Limelight.

Every error a client may see is a ``LimelightError`` with a ``kind``; the API layer maps kinds
to gRPC status codes in one place (``limelight.api.errors``). Anything else is a bug and is
reported to clients as a generic INTERNAL error while the details go to the log.
"""

from __future__ import annotations

import asyncio
import enum
import re


def ends_the_caller(exc: BaseException) -> bool:
    """Exceptions that must go on up (task cancellation, KeyboardInterrupt, SystemExit,
    GeneratorExit). Any other BaseException is one call's failure, to be answered as such: a
    Rust panic in a native library (tokenizers) reaches Python as pyo3's PanicException, which
    ``except Exception`` misses, so a call left unanswered and a batcher's loop ended."""
    return isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit | GeneratorExit)


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    FAILED_PRECONDITION = "failed_precondition"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAUTHENTICATED = "unauthenticated"
    UNIMPLEMENTED = "unimplemented"
    CANCELLED = "cancelled"
    DATA_LOSS = "data_loss"
    INTERNAL = "internal"


class LimelightError(Exception):
    """Base class; the message is safe to show to clients."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(LimelightError):
    kind = ErrorKind.INVALID_ARGUMENT


class NotFound(LimelightError):
    kind = ErrorKind.NOT_FOUND


class FailedPrecondition(LimelightError):
    kind = ErrorKind.FAILED_PRECONDITION


class ResourceExhausted(LimelightError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class Unavailable(LimelightError):
    kind = ErrorKind.UNAVAILABLE


class DeadlineExceeded(LimelightError):
    kind = ErrorKind.DEADLINE_EXCEEDED


class Unauthenticated(LimelightError):
    kind = ErrorKind.UNAUTHENTICATED


class Unimplemented(LimelightError):
    kind = ErrorKind.UNIMPLEMENTED


class Cancelled(LimelightError):
    kind = ErrorKind.CANCELLED


class DataLoss(LimelightError):
    """Stored data can no longer be read (a damaged job journal): retrying will not help."""

    kind = ErrorKind.DATA_LOSS


class ModelLoadError(LimelightError):
    """The model directory cannot be served (raised at start-up, not per request)."""

    kind = ErrorKind.FAILED_PRECONDITION


#: ``scheme://user:password@`` in a URL, and a ``password=`` query parameter (redis-py's
#: ``unix://`` form): what ``redact_credentials`` hides.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")
_PASSWORD_PARAM = re.compile(r"(?P<key>[?&]password=)[^&\s]*")


def redact_credentials(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``: a job queue
    address such as ``redis://limelight:secret@redis:6379/0`` may appear in an error message,
    and messages go to logs and clients."""
    return _PASSWORD_PARAM.sub(r"\g<key>***", _USERINFO.sub(r"\g<scheme>***@", text))
