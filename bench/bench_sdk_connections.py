"""Texts per second of one SDK client's ``explain_many`` against `limelight serve --workers N`,
by the number of connections the client opens (``Client(connections=...)``) and the texts it
sends per call (``explain_many(texts_per_call=...)``: 1 is a stream, more are ``ExplainBatch``
calls).

    .venv/bin/python bench/bench_sdk_connections.py [--demo bert-tiny] [--workers 2]
        [--runtime onnx] [--texts 3000] [--connections 1,2,4] [--spread on] [--rounds 3]
        [--texts-per-call 1,16] [--looks 200]

Starts the sidecar as its own process group with ``--workers N`` and drives it from this
process (a separate process, as a caller would) with one ``Client``; each round runs every
connection count once, in turn, over the same reviews. The baseline is one connection in the
same run (and the first ``--texts-per-call``): the ratio says what spreading one caller over
the workers, or packing its texts, buys. ``--spread on,off``
also runs each count with the client's spreading off (connections left where the kernel put
them); every run reports how its connections fell on the workers. ``--looks N`` times what
the client's regular look at its connections (every ``SPREAD_RECHECK_S``) adds to the one
call that makes it: N calls with a look due, each next to one without, for every count.
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
from collections import Counter
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
from limelight_client.errors import LimelightError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(server: subprocess.Popen[bytes], target: str, workers: int) -> None:
    """Until every worker serves (the supervisor starts the others once the first is up);
    fails at once if the sidecar exits."""
    while server.poll() is None:
        with Client(target, connections=4 * workers, spread=False) as client:
            try:
                client.wait_ready(timeout=2)
                seen = {client.model().instance for _ in range(client.connections)}
            except (TimeoutError, LimelightError):
                continue
        if len(seen) == workers:
            return
        time.sleep(0.5)
    raise SystemExit(f"the sidecar exited with status {server.returncode}")


def texts_per_s(
    target: str, connections: int, spread: bool, per_call: int, texts: list[str]
) -> tuple[float, str]:
    """The client's texts/s, and how its connections fell on the workers ("3+1": three on one
    worker, one on another)."""
    with Client(target, connections=connections, spread=spread, timeout=120) as client:
        # Warm every connection's worker before the clock starts.
        list(client.explain_many(texts[: 8 * connections * per_call], texts_per_call=per_call))
        start = time.perf_counter()
        n = sum(1 for _ in client.explain_many(texts, texts_per_call=per_call))
        rate = n / (time.perf_counter() - start)
        # GetModel takes the connections in turn: one call on each.
        on = Counter(client.model().instance for _ in range(connections))
        return rate, "+".join(str(n) for n in sorted(on.values(), reverse=True))


def look_ms(target: str, connections: int, text: str, n: int) -> tuple[float, float]:
    """Median milliseconds of an ``explain`` call that makes a look and of one that does not,
    interleaved, on one spread client."""
    with Client(target, connections=connections, timeout=120) as client:
        client.explain(text)  # the first look, and the spreading
        looking: list[float] = []
        plain: list[float] = []
        for _ in range(n):
            client._connections.spread_after = 0.0  # due now, as every SPREAD_RECHECK_S
            for times in (looking, plain):
                start = time.perf_counter()
                client.explain(text)
                times.append(1000 * (time.perf_counter() - start))
        return statistics.median(looking), statistics.median(plain)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--demo", default="bert-tiny", choices=["bert-tiny", "minilm"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runtime", default="onnx", choices=["torch", "onnx"])
    parser.add_argument("--texts", type=int, default=3000)
    parser.add_argument("--connections", default="1,2,4")
    parser.add_argument("--spread", default="on", help="on, off or both (on,off)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--texts-per-call", default="1", help="e.g. 1,16 (1: a stream)")
    parser.add_argument("--looks", type=int, default=0, help="calls timed with a look due")
    args = parser.parse_args()
    counts = [int(c) for c in args.connections.split(",")]
    spreads = [{"on": True, "off": False}[s] for s in args.spread.split(",")]
    packs = [int(p) for p in args.texts_per_call.split(",")]
    runs = [
        (c, spread, p)
        for c in counts
        for spread in spreads
        if c > 1 or spread == spreads[0]
        for p in packs
    ]
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
    results: dict[tuple[int, bool, int], list[float]] = {run: [] for run in runs}
    placed: dict[tuple[int, bool, int], list[str]] = {run: [] for run in runs}
    try:
        wait_serving(server, target, args.workers)
        for r in range(args.rounds):
            for run in runs:
                c, spread, p = run
                rate, split = texts_per_s(target, c, spread, p, texts)
                results[run].append(rate)
                placed[run].append(split)
                print(
                    f"round {r + 1}: {c} connection(s), spread {'on' if spread else 'off'}, "
                    f"{p} text(s) per call: {rate:,.0f} texts/s, connections per worker {split}",
                    flush=True,
                )
        looks = [
            (c, *look_ms(target, c, texts[0], args.looks)) for c in counts if c > 1 and args.looks
        ]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)

    title = (
        f"{args.demo}, {args.runtime}, --workers {args.workers}, one Client in a separate "
        f"process; {machine()}"
    )
    if looks:
        print(f"\n{title}; {args.looks} calls each")
        head = ["connections", "call with a look, ms (median)", "call without", "the look adds"]
        print(
            markdown_table(
                head, [[c, f"{a:.2f}", f"{b:.2f}", f"{a - b:+.2f}"] for c, a, b in looks]
            )
        )
    if not args.rounds:
        return 0
    base = statistics.median(results[runs[0]])
    rows = [
        [
            c,
            "on" if spread else "off",
            "stream" if p == 1 else f"{p} per call",
            " / ".join(f"{v:,.0f}" for v in results[c, spread, p]),
            " / ".join(placed[c, spread, p]),
            f"{statistics.median(results[c, spread, p]) / base:.2f}×",
        ]
        for c, spread, p in runs
    ]
    print(f"\n{title}; {args.texts} reviews per run")
    head = [
        "connections",
        "spread",
        "texts",
        "texts/s (each round)",
        "per worker",
        "median vs first",
    ]
    print(markdown_table(head, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
