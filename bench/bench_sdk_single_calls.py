"""Single ``explain`` calls of the SDK: unary calls against pooled streams
(``Client(single_calls="stream")``), at one caller and at many.

    .venv/bin/python bench/bench_sdk_single_calls.py [--demo bert-tiny] [--runtime onnx]
        [--clients 1,32] [--threads 1,8] [--duration 8] [--rounds 3]

Starts the sidecar as its own process (one worker, jobs off) and drives it from this process,
as a caller would: ``--clients`` concurrent ``AsyncClient.explain`` calls on one client, and
``--threads`` threads sharing one sync ``Client``, each in a closed loop over test reviews. Each
condition runs once per round with unary calls and once with streams, in turn, so the
machine's drift spreads over both. Reported: requests per second, the callers' p50 and p99, and
the sidecar process's CPU (user + system, from /proc) per request; the ratio column compares
streams with unary calls of the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import threading
import time
from itertools import cycle

from limelight.api.ports import free_port
from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.evaluation.benchmark import machine, markdown_table, process_cpu_seconds
from limelight.settings import Settings
from limelight_client import AsyncClient, Client
from limelight_client._common import SingleCalls
from limelight_client.errors import LimelightError

MODES: tuple[SingleCalls, ...] = ("unary", "stream")


class Run:
    """One condition's measured window: latencies, requests and the sidecar's CPU."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.latencies: list[float] = []
        self.start = self.cpu = 0.0

    def begin(self) -> None:
        self.latencies.clear()
        self.start, self.cpu = time.perf_counter(), process_cpu_seconds(self.pid)

    def end(self) -> tuple[float, float, float, float]:
        """req/s, p50 ms, p99 ms, server CPU ms per request."""
        elapsed = time.perf_counter() - self.start
        cpu = process_cpu_seconds(self.pid) - self.cpu
        n = len(self.latencies)
        q = statistics.quantiles(self.latencies, n=100)
        return n / elapsed, 1000 * q[49], 1000 * q[98], 1000 * cpu / n


async def run_async(
    target: str, mode: SingleCalls, clients: int, texts: list[str], duration: float, run: Run
) -> tuple[float, float, float, float]:
    async with AsyncClient(target, single_calls=mode, timeout=60) as client:
        feed = cycle(texts)
        measuring = False
        stop = time.perf_counter() + 2 + duration  # 2 s of warm-up

        async def loop() -> None:
            while (now := time.perf_counter()) < stop:
                await client.explain(next(feed))
                if measuring:
                    run.latencies.append(time.perf_counter() - now)

        tasks = [asyncio.create_task(loop()) for _ in range(clients)]
        await asyncio.sleep(2)
        measuring = True
        run.begin()
        await asyncio.gather(*tasks)
        return run.end()


def run_threads(
    target: str, mode: SingleCalls, threads: int, texts: list[str], duration: float, run: Run
) -> tuple[float, float, float, float]:
    with Client(target, single_calls=mode, timeout=60) as client:
        measuring = threading.Event()
        stop = time.perf_counter() + 2 + duration
        lock = threading.Lock()

        def loop(k: int) -> None:
            feed = cycle(texts[k:] + texts[:k])
            while (now := time.perf_counter()) < stop:
                client.explain(next(feed))
                if measuring.is_set():
                    took = time.perf_counter() - now
                    with lock:
                        run.latencies.append(took)

        workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        time.sleep(2)
        run.begin()
        measuring.set()
        for w in workers:
            w.join()
        return run.end()


def wait_serving(server: subprocess.Popen[bytes], target: str) -> None:
    while server.poll() is None:
        with Client(target) as client:
            try:
                client.wait_ready(timeout=2)
                return
            except (TimeoutError, LimelightError):
                time.sleep(0.5)
    raise SystemExit(f"the sidecar exited with status {server.returncode}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--demo", default="bert-tiny", choices=["bert-tiny", "minilm"])
    parser.add_argument("--runtime", default="onnx", choices=["torch", "onnx"])
    parser.add_argument("--clients", default="1,32", help="concurrent AsyncClient calls")
    parser.add_argument("--threads", default="1,8", help="threads sharing one sync Client")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    conditions = [("asyncio", int(c)) for c in args.clients.split(",") if c]
    conditions += [("threads", int(t)) for t in args.threads.split(",") if t]

    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    texts = [e.text for e in rotten_tomatoes("test")][:500]
    port = free_port()
    # With --runtime onnx the sidecar exports its inline graph (the head in it) into the cache.
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model_dir),
            "--jobs", "off", "--port", str(port), "--metrics-port", "0",
            "--runtime", args.runtime, "--torch-threads", "1", "--no-viewer"]  # fmt: skip
    server = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    target = f"127.0.0.1:{port}"
    results: dict[tuple[str, int, str], list[tuple[float, float, float, float]]] = {}
    try:
        wait_serving(server, target)
        run = Run(server.pid)
        for r in range(args.rounds):
            for kind, n in conditions:
                for mode in MODES:
                    if kind == "asyncio":
                        got = asyncio.run(run_async(target, mode, n, texts, args.duration, run))
                    else:
                        got = run_threads(target, mode, n, texts, args.duration, run)
                    results.setdefault((kind, n, mode), []).append(got)
                    print(
                        f"round {r + 1}: {kind} x{n}, {mode}: {got[0]:,.0f} req/s, "
                        f"p50 {got[1]:.2f} ms, p99 {got[2]:.2f} ms, "
                        f"server CPU {got[3]:.3f} ms/req",
                        flush=True,
                    )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)

    def each(key: tuple[str, int, str], i: int, fmt: str) -> str:
        return " / ".join(format(v[i], fmt) for v in results[key])

    rows = []
    for kind, n in conditions:
        for mode in MODES:
            key = (kind, n, mode)
            ratio = ""
            if mode == "stream":
                unary = [v[0] for v in results[kind, n, "unary"]]
                pairs = zip(results[key], unary, strict=True)
                ratio = " / ".join(f"{s[0] / u:.2f}×" for s, u in pairs)
            rows.append([f"{kind}, {n}", mode, each(key, 0, ",.0f"), ratio, each(key, 1, ".2f"),
                         each(key, 2, ".2f"), each(key, 3, ".3f")])  # fmt: skip
    print(
        f"\n{args.demo}, {args.runtime}, one worker; callers in a separate process; "
        f"{args.duration:g} s per condition, {args.rounds} round(s); {machine()}"
    )
    head = ["callers", "single calls", "req/s (each round)", "vs unary", "p50 ms", "p99 ms",
            "server CPU ms/req"]  # fmt: skip
    print(markdown_table(head, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
