"""Inline explain vs a plain forward pass, and gRPC end-to-end latency/throughput.

    .venv/bin/python bench/bench_inline.py [--demo minilm|bert-tiny] [--model DIR] [--quick]

Part 1 (same model, same batch, same run): the plain classification forward
(`Runtime.forward_logits`) against the whole inline explanation (`run_inline` + NormXLogit for
every row), at batch 1 and 32. Part 2: a real sidecar on loopback, 1 and 32 concurrent clients,
against the in-process batch-32 throughput of part 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import best_of, machine, markdown_table, percentile

from limelight.demo.datasets import rotten_tomatoes
from limelight.methods.normxlogit import NormXLogit
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings


def inline_vs_forward(model_dir: Path, texts: list[str], repeats: int) -> list[list[object]]:
    model = load_model(model_dir)
    runtime = TorchRuntime(model)
    method = NormXLogit()
    rows: list[list[object]] = []
    for size in (1, 32):
        encoded = [model.encode(t) for t in texts[:size]]
        batch = InlineBatch.from_encoded(encoded, model.pad_id)

        def explain(batch: InlineBatch = batch, encoded: list = encoded) -> None:  # type: ignore[type-arg]
            out = runtime.run_inline(batch)
            for row, enc in enumerate(encoded):
                method.attribute(out, row, len(enc))

        def forward_only(batch: InlineBatch = batch) -> None:
            runtime.forward_logits(batch)

        forward = best_of(forward_only, repeats)
        inline = best_of(explain, repeats)
        rows.append([size, forward * 1e3, inline * 1e3, inline / forward, size / inline])
    return rows


def grpc_end_to_end(
    model_dir: Path, texts: list[str], clients: int, per_client: int
) -> tuple[float, float, float]:
    """p50 and p99 latency (ms) and throughput (req/s) of a real sidecar on loopback."""
    import grpc

    from limelight.api.server import SidecarServer
    from limelight_client.proto import explainer_pb2 as pb
    from limelight_client.proto import explainer_pb2_grpc

    settings = Settings(
        model_dir=model_dir, port=0, metrics_port=0, jobs="off", drift_enabled=False
    )
    server = SidecarServer(settings)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_until_complete(server.wait())
        loop.run_until_complete(server.stop())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait()
    target = f"127.0.0.1:{server.port}"
    latencies: list[float] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(target))
        stub.Explain(pb.ExplainRequest(text="warm up"), timeout=60)
        mine = []
        for i in range(per_client):
            text = texts[(index * per_client + i) % len(texts)]
            start = time.perf_counter()
            stub.Explain(pb.ExplainRequest(text=text), timeout=60)
            mine.append(time.perf_counter() - start)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    loop.call_soon_threadsafe(server.request_stop)
    thread.join()
    return (
        percentile(latencies, 50) * 1e3,
        percentile(latencies, 99) * 1e3,
        len(latencies) / elapsed,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="classifier directory")
    parser.add_argument("--demo", default="minilm", choices=["minilm", "bert-tiny"])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and requests")
    args = parser.parse_args()
    if args.model is None:
        from limelight.demo.build import ensure_demo_model

        args.model = ensure_demo_model(args.demo, Settings().cache_dir)
    texts = [e.text for e in rotten_tomatoes("test")][:256]
    repeats = 5 if args.quick else 20
    print(f"model: {args.model.name}\nmachine: {machine()}\n")
    rows = inline_vs_forward(args.model, texts, repeats)
    print("Inline explain vs plain forward (same batch, same run; median of repeats)\n")
    print(
        markdown_table(
            ["batch", "forward ms", "inline explain ms", "explain / forward", "explain req/s"],
            rows,
        )
    )
    in_process_32 = float(rows[1][4])  # type: ignore[arg-type]
    per_client = 8 if args.quick else 32
    grpc_rows: list[list[object]] = []
    for clients in (1, 32):
        p50, p99, rps = grpc_end_to_end(args.model, texts, clients, per_client)
        grpc_rows.append([clients, p50, p99, rps, rps / in_process_32])
    print("\ngRPC end to end on loopback (micro-batched) vs in-process batch-32 throughput\n")
    print(
        markdown_table(
            ["clients", "p50 ms", "p99 ms", "req/s", "vs in-process batch 32"], grpc_rows
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
