"""A plain forward pass after the thread has been idle, against the same pass back to back.

    .venv/bin/python bench/bench_idle_forward.py [--demo bert-tiny|minilm] [--gaps 0.5,2,5]
        [--runtimes torch,onnx] [--rounds 5] [--threads 1]

Issue 14's idle-latency target compares a one-client request with a plain forward timed back to
back (``limelight bench``'s "plain forward": the same pass in a tight loop). A closed-loop client
never gives the server that: between its requests the inference thread waits for the next
one (the client's round trip, gRPC, the event loop), and meanwhile other code runs on the core.
This times the same plain forward of short test reviews at batch 1, one thread, in four
conditions interleaved round by round in one process: back to back; after sleeping each gap;
and after the same gap spent in a busy Python loop (the core stays awake, only the caches and
predictors see other work). Prints the median ms per forward and its ratio to back to back.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.evaluation import benchmark as b
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch, Runtime
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def timed(forward: Callable[[], object], before: Callable[[], None], calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        before()
        start = time.perf_counter()
        forward()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--demo", default="bert-tiny", choices=["bert-tiny", "minilm"])
    p.add_argument("--gaps", default="0.5,2,5", help="idle gaps before each forward, ms")
    p.add_argument("--runtimes", default="torch,onnx")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=64, help="forwards per condition and round")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(ensure_demo_model(args.demo, Settings().cache_dir))
    reviews = [e.text for e in rotten_tomatoes("test")]
    short = sorted(reviews, key=len)[len(reviews) // 4 :][:16]  # `limelight bench`'s texts
    batches = [InlineBatch.from_encoded([model.encode(t)], model.pad_id) for t in short]
    gaps = [float(g) / 1e3 for g in args.gaps.split(",")]
    conditions: dict[str, Callable[[], None]] = {"back to back": lambda: None}
    for gap in gaps:
        conditions[f"after {gap * 1e3:g} ms asleep"] = functools.partial(time.sleep, gap)
        conditions[f"after {gap * 1e3:g} ms busy in Python"] = functools.partial(spin, gap)
    with tempfile.TemporaryDirectory(prefix="limelight-idle-") as work:
        runtimes: dict[str, Runtime] = {}
        for name in args.runtimes.split(","):
            if name == "torch":
                runtimes[name] = TorchRuntime(model)
            elif name == "onnx":
                runtimes[name] = b.plain_onnx_runtime(model, Path(work), {}, args.threads)
            else:
                raise SystemExit(f"unknown runtime {name}")
        times: dict[tuple[str, str], list[float]] = {}
        for runtime in runtimes.values():
            for batch in batches:  # warm-up
                runtime.forward_logits(batch)
        for _ in range(args.rounds):  # conditions interleaved: drift hits them alike
            for name, runtime in runtimes.items():
                for label, before in conditions.items():
                    cycle = iter(batches * (args.calls // len(batches) + 1))
                    forward = lambda r=runtime, c=cycle: r.forward_logits(next(c))  # noqa: E731
                    times.setdefault((name, label), []).extend(timed(forward, before, args.calls))
    print(f"{args.demo}, plain forward at batch 1, {args.threads} thread(s), {b.machine()}")
    print(f"{args.rounds} rounds x {args.calls} forwards per condition, 16 short test reviews\n")
    print("| runtime | before each forward | median ms | vs back to back |")
    print("|---|---|---|---|")
    for name in runtimes:
        base = statistics.median(times[(name, "back to back")])
        for label in conditions:
            ms = statistics.median(times[(name, label)])
            print(f"| {name} | {label} | {ms * 1e3:.3f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
