"""Latency and throughput measurements behind `limelight bench` and bench/ scripts.

Every figure is a ratio against a baseline measured in the same run on the same inputs:
inline explain vs the plain classification forward (torch and ONNX Runtime), the gRPC path vs
the in-process path, job methods vs one forward pass.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from limelight.core.types import Encoded
from limelight.methods.normxlogit import NormXLogit
from limelight.models.loaded import LoadedModel
from limelight.runtimes.base import InlineBatch, Runtime
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings


def machine() -> str:
    import torch

    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")),
                cpu,
            )
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def single_forward_seconds(model: LoadedModel, encoded: Encoded, repeats: int) -> float:
    """Median seconds of one plain classification forward pass of one input (after a warm-up)."""
    runtime = TorchRuntime(model)
    batch = InlineBatch.from_encoded([encoded], model.pad_id)
    return median_seconds(lambda: runtime.forward_logits(batch), repeats, warmup=1)


@dataclass
class InlineRow:
    runtime: str
    texts: str
    batch: int
    forward_ms: float
    explain_ms: float

    @property
    def ratio(self) -> float:
        return self.explain_ms / self.forward_ms

    @property
    def explain_per_s(self) -> float:
        return self.batch / (self.explain_ms / 1e3)


def inline_vs_forward(
    model: LoadedModel,
    runtimes: dict[str, Runtime],
    texts: dict[str, list[str]],
    batches: Sequence[int],
    repeats: int,
) -> list[InlineRow]:
    """Plain forward vs the whole inline explanation, per runtime, text length and batch."""
    method = NormXLogit()
    rows = []
    for kind, pool in texts.items():
        for size in batches:
            encoded = [model.encode(t) for t in pool[:size]]
            batch = InlineBatch.from_encoded(encoded, model.pad_id)
            for name, runtime in runtimes.items():

                def explain(
                    runtime: Runtime = runtime,
                    batch: InlineBatch = batch,
                    encoded: list[Encoded] = encoded,
                ) -> None:
                    out = runtime.run_inline(batch)
                    for row, enc in enumerate(encoded):
                        method.attribute(out, row, len(enc))

                def forward(runtime: Runtime = runtime, batch: InlineBatch = batch) -> None:
                    runtime.forward_logits(batch)

                # Interleave the two so machine noise hits both alike.
                f = median_seconds(forward, repeats)
                e = median_seconds(explain, repeats)
                rows.append(InlineRow(name, kind, size, f * 1e3, e * 1e3))
    return rows


def plain_onnx_runtime(model: LoadedModel, workdir: Path) -> Runtime:
    """ONNX Runtime with an inline graph and a plain (logits-only) graph for the baseline."""
    from limelight.runtimes.base import InlineOutputs
    from limelight.runtimes.onnx_export import export_onnx
    from limelight.runtimes.onnx_runtime import OnnxRuntime

    inline = OnnxRuntime(export_onnx(model, workdir / "inline.onnx"), model)
    plain_path = export_onnx(model, workdir / "plain.onnx", kind="plain")
    import onnxruntime as ort

    plain = ort.InferenceSession(str(plain_path), providers=["CPUExecutionProvider"])

    class _Both(Runtime):
        name = "onnx"

        def run_inline(self, batch: InlineBatch) -> InlineOutputs:
            return inline.run_inline(batch)

        def forward_logits(self, batch: InlineBatch):  # type: ignore[no-untyped-def]
            return plain.run(["logits"], inline._feed(batch))[0]

    return _Both()


@dataclass
class GrpcRow:
    runtime: str
    clients: int
    p50_ms: float
    p99_ms: float
    per_s: float


def grpc_end_to_end(
    model_dir: Path,
    texts: list[str],
    clients: int,
    per_client: int,
    runtime: str = "torch",
    onnx_path: Path | None = None,
) -> GrpcRow:
    """A real sidecar on loopback; ``clients`` threads each send ``per_client`` requests."""
    import grpc

    from limelight.api.server import SidecarServer
    from limelight_client.proto import explainer_pb2 as pb
    from limelight_client.proto import explainer_pb2_grpc

    settings = Settings(
        model_dir=model_dir,
        port=0,
        metrics_port=0,
        jobs="off",
        drift_enabled=False,
        runtime=runtime,  # type: ignore[arg-type]
        onnx_path=onnx_path,
    )
    server = SidecarServer(settings)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_until_complete(server.wait())
        loop.run_until_complete(server.stop())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait()
    target = f"127.0.0.1:{server.port}"
    latencies: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client(index: int) -> None:
        stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(target))
        stub.Explain(pb.ExplainRequest(text="warm up"), timeout=120)
        barrier.wait()
        mine = []
        for i in range(per_client):
            text = texts[(index * per_client + i) % len(texts)]
            start = time.perf_counter()
            stub.Explain(pb.ExplainRequest(text=text), timeout=120)
            mine.append(time.perf_counter() - start)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    loop.call_soon_threadsafe(server.request_stop)
    thread.join()
    return GrpcRow(
        runtime,
        clients,
        percentile(latencies, 50) * 1e3,
        percentile(latencies, 99) * 1e3,
        len(latencies) / elapsed,
    )


def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="limelight-bench-"))


def job_method_ratios(
    model: LoadedModel, settings: Settings, names: Sequence[str], texts: list[str], repeats: int
) -> list[list[object]]:
    """Each job method's time as a multiple of one plain forward pass of the same input."""
    from limelight.core.jobs import JobSpec
    from limelight.jobs.runner import JobRunner
    from limelight.methods.base import MethodRegistry

    methods = MethodRegistry.builtin()
    runner = JobRunner(model, methods, settings)
    runtime = TorchRuntime(model)
    rows: list[list[object]] = []
    for name in names:
        method = methods.get(name)
        if method.unavailable_reason(model):
            rows.append([name, "unavailable", "", method.unavailable_reason(model)[:60]])
            continue
        ratios, seconds = [], []
        for text in texts:
            batch = InlineBatch.from_encoded([model.encode(text)], model.pad_id)
            spec = JobSpec(method=name, text=text, params=method.validate_params({}))

            def forward(batch: InlineBatch = batch) -> None:
                runtime.forward_logits(batch)

            def job(spec: JobSpec = spec) -> None:
                runner.run(spec)

            took = median_seconds(job, max(1, repeats // 4), warmup=1)
            forward_s = median_seconds(forward, repeats)
            ratios.append(took / forward_s)
            seconds.append(took)
        rows.append([name, statistics.median(ratios), statistics.median(seconds) * 1e3, ""])
    return rows
