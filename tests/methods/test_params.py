"""Method parameters as clients send them: JSON numbers of any size (the viewer, KServe and OIP
bodies are parsed by Python's json, whose integers have no limit) and protobuf doubles."""

from __future__ import annotations

from typing import Any

import pytest

from limelight.errors import InvalidArgument
from limelight.methods.base import Param

SEED = Param(int, 0, minimum=0, maximum=2**31 - 1)
UNBOUNDED_INT = Param(int, 0)
RATE = Param(float, 0.1, 1e-6, 1.0)

HUGE = 10**400  # float(HUGE) raises OverflowError


@pytest.mark.parametrize(
    ("param", "value", "expected"),
    [
        (SEED, 7, 7),
        (SEED, 7.0, 7),  # protobuf Struct numbers are doubles
        (UNBOUNDED_INT, HUGE, HUGE),
        (RATE, 1, 1.0),
        (RATE, 0.5, 0.5),
    ],
)
def test_accepted_values_are_converted_to_the_parameter_kind(
    param: Param, value: Any, expected: Any
) -> None:
    checked = param.check("p", value)
    assert checked == expected
    assert type(checked) is param.kind


@pytest.mark.parametrize(
    ("param", "value", "message"),
    [
        (SEED, HUGE, "must be <= 2147483647"),
        (SEED, -HUGE, "must be >= 0"),
        (SEED, 2.5, "must be an integer"),
        (SEED, float("nan"), "must be a finite number"),
        (SEED, True, "must be a number"),
        (RATE, HUGE, "must be a finite number"),
        (RATE, -HUGE, "must be a finite number"),
        (RATE, float("inf"), "must be a finite number"),
    ],
)
def test_out_of_range_values_are_named_not_crashed_on(
    param: Param, value: Any, message: str
) -> None:
    """A 400-digit integer raised OverflowError (INTERNAL, counted as a server error)."""
    with pytest.raises(InvalidArgument, match=message):
        param.check("p", value)
