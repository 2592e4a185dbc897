"""Python SDK for the Limelight explanation sidecar.

Needs only ``grpcio`` and ``protobuf``: no torch, transformers or numpy.

    from limelight_client import Client

    with Client("localhost:50051", token="...") as client:
        client.wait_ready(timeout=60)                    # model loaded and warmed
        exp = client.explain("A gripping, beautifully shot film.")
        print(exp.label, exp.probabilities, exp.top(3))
        print(exp.to_terminal())                         # heat-map (NO_COLOR respected)
        exp.to_html("explanation.html")                  # self-contained page

        job = client.submit("A gripping film.", "slalom", num_samples=500)
        for info in job.watch():
            print(info.state.name, f"{info.progress:.0%}", info.message)
        deep = job.result()                              # JobFailed / JobCancelled / TimeoutError
        deep.to_html("slalom.html", scores=["value", "importance"])

``AsyncClient`` offers the same methods for asyncio. Every error is a
``limelight_client.errors.LimelightError`` subclass chosen by the gRPC status code.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from limelight_client import errors
from limelight_client.aio import AsyncClient, AsyncJob
from limelight_client.client import Client, Job
from limelight_client.errors import JobCancelled, JobFailed, LimelightError
from limelight_client.types import (
    DriftReport,
    Explanation,
    JobInfo,
    JobState,
    LabelDrift,
    MethodInfo,
    ModelInfo,
    Timings,
    Token,
    TokenShift,
    Word,
)

try:
    __version__ = _metadata.version("limelight-client")
except _metadata.PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

__all__ = [
    "AsyncClient",
    "AsyncJob",
    "Client",
    "DriftReport",
    "Explanation",
    "Job",
    "JobCancelled",
    "JobFailed",
    "JobInfo",
    "JobState",
    "LabelDrift",
    "LimelightError",
    "MethodInfo",
    "ModelInfo",
    "Timings",
    "Token",
    "TokenShift",
    "Word",
    "__version__",
    "errors",
]
