"""SDK errors survive pickle and copy with everything they carry, so that one raised in a
worker process reaches the parent as itself (against a real sidecar)."""

from __future__ import annotations

import concurrent.futures
import copy
import multiprocessing
import pickle
from typing import Any

import grpc
import pytest

from limelight_client import Client, errors
from limelight_client.errors import InvalidArgument, LimelightError
from limelight_client.types import JobInfo, JobState
from tests.conftest import RunningSidecar

JOB = JobInfo(id="j1", state=JobState.FAILED, method="slalom", progress=0.5, message="boom")

ERRORS: list[LimelightError] = [
    errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "text is empty"),
    errors.Unavailable(
        grpc.StatusCode.UNAVAILABLE,
        "cannot reach 127.0.0.1:1: connection refused",
        "connection refused",
        answered=True,
    ),
    errors.from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
    errors.DataLoss(grpc.StatusCode.DATA_LOSS, "journal damaged"),
    errors.JobFailed("it failed", job=JOB),
    errors.JobCancelled("cancelled"),
    errors.LimelightError(None, "plain"),
]


def _state(error: BaseException) -> tuple[Any, ...]:
    return (type(error), error.args, str(error), repr(error), vars(error))


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_pickle_and_copy_with_all_they_carry(error: LimelightError) -> None:
    for again in (
        pickle.loads(pickle.dumps(error)),
        copy.copy(error),
        copy.deepcopy(error),
    ):
        assert _state(again) == _state(error)
    unavailable = pickle.loads(pickle.dumps(ERRORS[1]))
    assert isinstance(unavailable, errors.Unavailable)
    assert (unavailable.reason, unavailable.answered) == ("connection refused", True)
    assert pickle.loads(pickle.dumps(ERRORS[4])).job == JOB  # type: ignore[attr-defined]


def _label_of(target: str, text: str) -> str:
    with Client(target, timeout=60) as client:
        return client.explain(text).label


def test_an_error_in_a_worker_process_reaches_the_parent(sidecar: RunningSidecar) -> None:
    """An empty text is refused by the sidecar in the worker: the parent gets the
    ``InvalidArgument`` itself (not ``BrokenProcessPool``), and the pool stays usable."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        with pytest.raises(InvalidArgument) as refused:
            pool.submit(_label_of, sidecar.target, "").result(timeout=300)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.message
        assert pool.submit(_label_of, sidecar.target, "a fine film").result(timeout=300)
