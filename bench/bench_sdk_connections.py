"""Texts per second of one SDK client's ``explain_many`` against `limelight serve --workers N`,
by the number of connections the client opens (``Client(connections=...)``).

    .venv/bin/python bench/bench_sdk_connections.py [--demo bert-tiny] [--workers 2]
        [--runtime onnx] [--texts 3000] [--connections 1,2,4] [--rounds 3]

Starts the sidecar as its own process group with ``--workers N`` and drives it from this
process (a separate process, as a caller would) with one ``Client``; each round runs every
connection count once, in turn, over the same reviews. The baseline is one connection in the
same run: the ratio says what spreading one caller over the workers buys.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.evaluation.benchmark import machine, markdown_table
from limelight.models.explainer_head import inline_heads
from limelight.models.loaded import load_model
from limelight.runtimes.onnx_export import export_onnx
from limelight.settings import Settings
from limelight_client import Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(server: subprocess.Popen[bytes], target: str, connections: int) -> None:
    """Until every worker answers health checks; fails at once if the sidecar exits."""
    with Client(target, connections=connections) as client:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the sidecar exited with status {server.returncode}")
            try:
                client.wait_ready(timeout=2)
                return
            except TimeoutError:
                continue


def texts_per_s(target: str, connections: int, texts: list[str]) -> float:
    with Client(target, connections=connections, timeout=120) as client:
        # Warm every connection's worker before the clock starts.
        list(client.explain_many(texts[: 8 * connections]))
        start = time.perf_counter()
        n = sum(1 for _ in client.explain_many(texts))
        return n / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--demo", default="bert-tiny", choices=["bert-tiny", "minilm"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runtime", default="onnx", choices=["torch", "onnx"])
    parser.add_argument("--texts", type=int, default=3000)
    parser.add_argument("--connections", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    counts = [int(c) for c in args.connections.split(",")]
    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    reviews = [e.text for e in rotten_tomatoes("test")]
    texts = list(islice((reviews[i % len(reviews)] for i in range(args.texts)), args.texts))

    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="limelight-bench-"))
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model_dir),
            "--workers", str(args.workers), "--jobs", "off", "--port", str(port),
            "--runtime", args.runtime, "--torch-threads", "1", "--no-viewer"]  # fmt: skip
    if args.runtime == "onnx":  # the served graph, with the model's inline head in it
        model = load_model(model_dir)
        graph = export_onnx(model, workdir / "inline.onnx", heads=inline_heads(model))
        argv += ["--onnx-path", str(graph)]
    server = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    target = f"127.0.0.1:{port}"
    results: dict[int, list[float]] = {c: [] for c in counts}
    try:
        wait_serving(server, target, max(4 * args.workers, max(counts)))
        for r in range(args.rounds):
            for c in counts:
                results[c].append(texts_per_s(target, c, texts))
                print(f"round {r + 1}: {c} connection(s) {results[c][-1]:,.0f} texts/s", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)

    base = statistics.median(results[counts[0]])
    rows = [
        [
            c,
            " / ".join(f"{v:,.0f}" for v in results[c]),
            f"{statistics.median(results[c]) / base:.2f}×",
        ]
        for c in counts
    ]
    print()
    print(
        f"{args.demo}, {args.runtime}, --workers {args.workers}, {args.texts} reviews per run, "
        f"one Client in a separate process; {machine()}"
    )
    print(markdown_table(["connections", "texts/s (each round)", f"median vs {counts[0]}"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
