"""Soak test: a real `limelight serve` process under mixed traffic for a long while.

    .venv/bin/python bench/bench_soak.py [--demo bert-tiny] [--minutes 10] [--clients 4]
        [--out docs/bench/soak.json]

Inline Explain calls of short and long texts (up to the token limit) from ``--clients``
threads, plus a job thread submitting a rotation of job methods (gradient, grad_x_input,
integrated_gradients, lrp, slalom, random) and waiting for each. Every ``--sample-s`` seconds
it records the server's resident memory and open file descriptors (from /proc) and the inline
latency percentiles of that interval. Passes when there were no unexpected errors and memory
and descriptors stayed flat over the second half of the run. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from limelight.demo.build import ensure_demo_model
from limelight.evaluation.benchmark import machine, markdown_table
from limelight.settings import Settings
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["a", "gorgeous", "witty", "seductive", "movie", "but", "the", "plot", "is", "thin",
         "and", "the", "jokes", "fall", "flat"]  # fmt: skip
JOBS: list[tuple[str, dict[str, Any]]] = [
    ("gradient", {}),
    ("grad_x_input", {}),
    ("integrated_gradients", {"steps": 16}),
    ("lrp", {}),
    ("slalom", {"num_samples": 200}),
    ("random", {}),
]
#: Codes that are answers, not failures, under load (overload shedding, deadlines).
EXPECTED = {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def text_of(words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, size=words))


def proc_stats(pid: int) -> tuple[float, int]:
    """Resident memory (MiB) and open file descriptors of ``pid``."""
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


class Traffic:
    def __init__(self, target: str, stop: threading.Event) -> None:
        self.target = target
        self.stop = stop
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.codes: Counter[str] = Counter()
        self.jobs: Counter[str] = Counter()

    def inline(self, index: int) -> None:
        stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(self.target))
        i = 0
        while not self.stop.is_set():
            i += 1
            words = 400 if i % 10 == 0 else 5 + (i * 7 + index) % 40
            started = time.perf_counter()
            try:
                stub.Explain(pb.ExplainRequest(text=text_of(words, i + 1000 * index)), timeout=30)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            with self.lock:
                self.latencies.append(time.perf_counter() - started)
                self.codes[code] += 1

    def jobs_loop(self) -> None:
        from google.protobuf import struct_pb2

        stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(self.target))
        i = 0
        while not self.stop.is_set():
            method, params = JOBS[i % len(JOBS)]
            i += 1
            struct = struct_pb2.Struct()
            struct.update(params)
            words = 200 if i % 4 == 0 else 20
            try:
                job = stub.SubmitJob(
                    pb.SubmitJobRequest(text=text_of(words, i), method=method, parameters=struct),
                    timeout=30,
                )
                final = None
                for update in stub.WatchJob(pb.GetJobRequest(id=job.id), timeout=600):
                    final = update
                state = pb.JobState.Name(final.state) if final is not None else "NONE"
            except grpc.RpcError as exc:
                state = exc.code().name
            with self.lock:
                self.jobs[f"{method}:{state}"] += 1

    def take_latencies(self) -> list[float]:
        with self.lock:
            out, self.latencies = self.latencies, []
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", default="bert-tiny", choices=["bert-tiny", "minilm"])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "soak.json")
    args = parser.parse_args()

    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="limelight-soak-"))
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model_dir)]
    argv += ["--port", str(port), "--metrics-port", "0", "--jobs-db", str(workdir / "jobs.db")]
    argv += ["--log-level", "WARNING"]
    server = subprocess.Popen(argv, cwd=ROOT, stderr=(workdir / "server.log").open("wb"))
    target = f"127.0.0.1:{port}"
    stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(target))
    while True:
        if server.poll() is not None:
            print((workdir / "server.log").read_text()[-3000:])
            return 1
        try:
            stub.GetModel(pb.GetModelRequest(), timeout=5)
            break
        except grpc.RpcError:
            time.sleep(0.5)

    stop = threading.Event()
    traffic = Traffic(target, stop)
    threads = [threading.Thread(target=traffic.inline, args=(i,)) for i in range(args.clients)]
    threads.append(threading.Thread(target=traffic.jobs_loop))
    for t in threads:
        t.start()
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    end = started + args.minutes * 60
    try:
        while time.monotonic() < end and server.poll() is None:
            stop.wait(min(args.sample_s, max(0.0, end - time.monotonic())))
            rss, fds = proc_stats(server.pid)
            lat = traffic.take_latencies()
            samples.append(
                {
                    "t_s": round(time.monotonic() - started, 1),
                    "rss_mib": round(rss, 1),
                    "open_fds": fds,
                    "requests": len(lat),
                    "p50_ms": round(1000 * float(np.percentile(lat, 50)), 2) if lat else 0.0,
                    "p99_ms": round(1000 * float(np.percentile(lat, 99)), 2) if lat else 0.0,
                }
            )
            print(samples[-1], flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join()
        alive = server.poll() is None
        server.send_signal(signal.SIGTERM)
        server.wait(60)

    second_half = [s for s in samples if s["t_s"] >= args.minutes * 30]
    rss_growth = second_half[-1]["rss_mib"] - second_half[0]["rss_mib"] if second_half else 0.0
    fd_growth = second_half[-1]["open_fds"] - second_half[0]["open_fds"] if second_half else 0
    unexpected = {c: n for c, n in traffic.codes.items() if c not in EXPECTED}
    failed_jobs = {k: n for k, n in traffic.jobs.items() if not k.endswith(":JOB_STATE_SUCCEEDED")}
    report = {
        "machine": machine(),
        "demo": args.demo,
        "minutes": args.minutes,
        "clients": args.clients,
        "server_survived": alive,
        "inline_codes": dict(traffic.codes),
        "jobs": dict(traffic.jobs),
        "rss_growth_second_half_mib": round(rss_growth, 1),
        "fd_growth_second_half": fd_growth,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    rows = [[s["t_s"], s["rss_mib"], s["open_fds"], s["requests"], s["p50_ms"], s["p99_ms"]]
            for s in samples]  # fmt: skip
    print(markdown_table(["t (s)", "RSS (MiB)", "fds", "requests", "p50 (ms)", "p99 (ms)"], rows))
    print(f"inline: {dict(traffic.codes)}\njobs: {dict(traffic.jobs)}")
    ok = alive and not unexpected and not failed_jobs and fd_growth <= 2
    print("PASS" if ok else f"FAIL: unexpected={unexpected} failed_jobs={failed_jobs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
