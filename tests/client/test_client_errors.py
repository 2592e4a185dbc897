"""One mapping from a status to the client's error classes, for failed calls and for inputs
answered in their place by an error (``ItemError``: the code as a number)."""

from __future__ import annotations

import grpc
import pytest

from limelight_client import errors

#: Each status code with the error class it becomes (shared with the network tests).
CLASSES = [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
    (grpc.StatusCode.OUT_OF_RANGE, errors.InvalidArgument),
    (grpc.StatusCode.NOT_FOUND, errors.NotFound),
    (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
    (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
    (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
    (grpc.StatusCode.UNIMPLEMENTED, errors.Unimplemented),
    (grpc.StatusCode.CANCELLED, errors.Cancelled),
    (grpc.StatusCode.INTERNAL, errors.Internal),
    (grpc.StatusCode.DATA_LOSS, errors.DataLoss),  # an Internal too
    (grpc.StatusCode.ABORTED, errors.LimelightError),  # no class of its own
]


@pytest.mark.parametrize(("code", "cls"), CLASSES, ids=[c.name for c, _ in CLASSES])
def test_a_code_and_its_number_give_the_same_error(
    code: grpc.StatusCode, cls: type[errors.LimelightError]
) -> None:
    by_code = errors.from_status(code, "why")
    by_number = errors.from_status(code.value[0], "why")
    for error in (by_code, by_number):
        assert type(error) is cls
        assert error.code == code and error.message == "why"
        assert str(error) == f"{code.name}: why"


def test_unknown_codes_and_empty_messages() -> None:
    unknown = errors.from_status(99, "")
    assert isinstance(unknown, errors.Internal) and unknown.code == grpc.StatusCode.UNKNOWN
    assert unknown.message == "unknown"
    assert errors.from_status(None, None).code == grpc.StatusCode.UNKNOWN
    assert errors.from_status(True, "x").code == grpc.StatusCode.UNKNOWN  # a bool is no code
    assert errors.from_status(grpc.StatusCode.OK, "").message == "ok"
