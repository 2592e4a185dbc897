"""Soak test: a real `limelight serve` process under mixed traffic for a long while.

    .venv/bin/python bench/bench_soak.py [--demo bert-tiny] [--runtime torch] [--minutes 10]
        [--clients 4] [--stream-clients 2] [--http-clients 1] [--truncation window]
        [--out docs/bench/soak.json]

Unary Explain calls of short and long texts (up to the token limit; with ``--truncation
window``, every tenth a document of about 16,000 characters explained whole) from
``--clients`` threads, ``--stream-clients`` threads each keeping one ``ExplainStream`` open
(tokens in columns, as the SDK asks), ``--http-clients`` threads posting KServe v1 ``:explain``
calls of three texts to the HTTP port, a job thread submitting a rotation of job methods
(gradient, grad_x_input, integrated_gradients, lrp, slalom, random; with ``--truncation
window`` every ninth on a whole document) and waiting for each, and
a thread asking ``GetDrift`` every 2 s while the drift monitor (on, as it ships) observes every
answer. Every ``--sample-s`` seconds it records the server's resident memory, open file
descriptors and threads (from /proc) and the inline latency percentiles of that interval; at
the end it reads the answers the drift monitor had to drop from ``/metrics``. Passes when there
were no unexpected errors and descriptors and threads stayed flat over the second half of the
run (memory is reported: its trend is read by a person, allocators do not return every page).
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
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


def proc_stats(pid: int) -> tuple[float, int, int]:
    """Resident memory (MiB), open file descriptors and threads of ``pid``."""
    rss_kib = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd")), threads


def metric(metrics_url: str, name: str) -> float | None:
    """One unlabelled sample of the server's ``/metrics``, or None when it is not there."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


class Traffic:
    def __init__(self, target: str, stop: threading.Event, long_words: int) -> None:
        self.target = target
        self.stop = stop
        self.long_words = long_words
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.codes: Counter[str] = Counter()
        self.jobs: Counter[str] = Counter()
        self.drift_reports: Counter[str] = Counter()

    def words(self, i: int, index: int) -> int:
        """Every tenth input long (the token limit's worth, or a whole document), the others
        5-44 words."""
        return self.long_words if i % 10 == 0 else 5 + (i * 7 + index) % 40

    def record(self, started: float, code: str) -> None:
        with self.lock:
            self.latencies.append(time.perf_counter() - started)
            self.codes[code] += 1

    def inline(self, index: int) -> None:
        stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(self.target))
        i = 0
        while not self.stop.is_set():
            i += 1
            text = text_of(self.words(i, index), i + 1000 * index)
            started = time.perf_counter()
            try:
                stub.Explain(pb.ExplainRequest(text=text), timeout=30)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            self.record(started, code)

    def streaming(self, index: int) -> None:
        """One ExplainStream per thread, reopened if it breaks; the next input is sent when
        the last answer came (as the SDK's pooled streams do)."""
        stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(self.target))
        counter = iter(range(1, 1 << 62))
        while not self.stop.is_set():
            asked = threading.Semaphore(1)
            sent: list[float] = []
            call = stub.ExplainStream(self._stream_inputs(index, counter, asked, sent))
            try:
                for answer in call:
                    code = "STREAM_ERROR" if answer.HasField("error") else "OK"
                    self.record(sent.pop(), code)
                    asked.release()
            except grpc.RpcError as exc:
                if not self.stop.is_set():
                    self.record(sent.pop() if sent else time.perf_counter(), exc.code().name)
            finally:
                asked.release()  # let the request iterator see the stop and end
                call.cancel()

    def _stream_inputs(
        self, index: int, counter: Iterator[int], asked: threading.Semaphore, sent: list[float]
    ) -> Iterator[pb.ExplainRequest]:
        while not self.stop.is_set():
            asked.acquire()
            if self.stop.is_set():
                return
            i = next(counter)
            text = text_of(self.words(i, index), i + 5000 + 1000 * index)
            sent.append(time.perf_counter())
            yield pb.ExplainRequest(
                text=text, token_layout=pb.TOKEN_LAYOUT_COLUMNS, timeout_seconds=30
            )

    def http(self, index: int, url: str) -> None:
        """KServe v1 ``:explain`` on the HTTP port, three instances a call (one ``explain_batch``
        of the service: its inputs tokenised together, long ones in windows)."""
        i = 0
        while not self.stop.is_set():
            texts = []
            for _ in range(3):
                i += 1
                texts.append(text_of(self.words(i, index), i + 9000 + 1000 * index))
            body = json.dumps({"instances": texts}).encode()
            request = urllib.request.Request(
                url, body, {"Content-Type": "application/json"}, method="POST"
            )
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    answers = json.loads(response.read())["explanations"]
                code = "OK" if len(answers) == len(texts) else "HTTP_SHORT_ANSWER"
            except urllib.error.HTTPError as exc:
                code = f"HTTP_{exc.code}"
            except OSError as exc:
                code = f"HTTP_{type(exc).__name__}"
            self.record(started, code)

    def drift_reader(self) -> None:
        stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(self.target))
        while not self.stop.wait(2.0):
            try:
                report = stub.GetDrift(pb.GetDriftRequest(), timeout=30)
                state = report.reference_state or "?"
            except grpc.RpcError as exc:
                state = exc.code().name
            with self.lock:
                self.drift_reports[state] += 1

    def jobs_loop(self) -> None:
        from google.protobuf import struct_pb2

        stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(self.target))
        i = 0
        while not self.stop.is_set():
            method, params = JOBS[i % len(JOBS)]
            i += 1
            struct = struct_pb2.Struct()
            struct.update(params)
            # Every fourth job on 200 words; with --truncation window every ninth on a whole
            # document, so that jobs cut windows while requests do.
            words = self.long_words if i % 9 == 0 and self.long_words > 400 else 20
            words = 200 if i % 4 == 0 else words
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


def reloads(
    server: subprocess.Popen[bytes], model_dir: Path, every_s: float, stop: threading.Event
) -> None:
    """Write a new file into the distilled head's folder beside the model (new bytes: a new
    version of the head, as far as the server can tell) and send SIGHUP: the server builds the
    runtime again and swaps it in between two batches, under load."""
    from limelight.models.explainer_head import HEAD_DIRNAME

    n = 0
    while not stop.wait(every_s):
        n += 1
        (model_dir / HEAD_DIRNAME / "soak-reload.txt").write_text(f"reload {n}\n")
        server.send_signal(signal.SIGHUP)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--demo", default="bert-tiny", choices=["bert-tiny", "minilm", "bert-tiny-multilabel"]
    )
    parser.add_argument("--runtime", default="torch", choices=["torch", "onnx"])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4, help="unary Explain threads")
    parser.add_argument("--stream-clients", type=int, default=0, help="ExplainStream threads")
    parser.add_argument(
        "--http-clients", type=int, default=0, help="KServe v1 :explain threads (HTTP port)"
    )
    parser.add_argument(
        "--reload-every",
        type=float,
        default=0.0,
        help="seconds between hot reloads: the model is served from a copy whose head folder "
        "gets a file with new bytes, then the server gets SIGHUP (0: none)",
    )
    parser.add_argument(
        "--truncation",
        default="truncate",
        choices=["truncate", "window"],
        help="the server's policy for long texts; window: the long inputs are ~20,000-character "
        "documents explained whole",
    )
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "soak.json")
    args = parser.parse_args()

    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    port, metrics_port = free_port(), free_port()
    workdir = Path(tempfile.mkdtemp(prefix="limelight-soak-"))
    if args.reload_every > 0:  # a copy: the reloads touch the files beside the model
        model_dir = Path(shutil.copytree(model_dir, workdir / "model"))
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model_dir)]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port)]
    argv += ["--jobs-db", str(workdir / "jobs.db"), "--truncation", args.truncation]
    argv += ["--runtime", args.runtime]
    argv += ["--log-level", "INFO" if args.reload_every > 0 else "WARNING"]
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
    traffic = Traffic(target, stop, long_words=3000 if args.truncation == "window" else 400)
    threads = [threading.Thread(target=traffic.inline, args=(i,)) for i in range(args.clients)]
    threads += [
        threading.Thread(target=traffic.streaming, args=(args.clients + i,))
        for i in range(args.stream_clients)
    ]
    model_name = stub.GetModel(pb.GetModelRequest(), timeout=5).name
    explain_url = f"http://127.0.0.1:{metrics_port}/v1/models/{model_name}:explain"
    first = args.clients + args.stream_clients
    threads += [
        threading.Thread(target=traffic.http, args=(first + i, explain_url))
        for i in range(args.http_clients)
    ]
    threads.append(threading.Thread(target=traffic.jobs_loop))
    threads.append(threading.Thread(target=traffic.drift_reader))
    if args.reload_every > 0:
        threads.append(
            threading.Thread(target=reloads, args=(server, model_dir, args.reload_every, stop))
        )
    for t in threads:
        t.start()
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    end = started + args.minutes * 60
    try:
        while time.monotonic() < end and server.poll() is None:
            stop.wait(min(args.sample_s, max(0.0, end - time.monotonic())))
            rss, fds, server_threads = proc_stats(server.pid)
            lat = traffic.take_latencies()
            samples.append(
                {
                    "t_s": round(time.monotonic() - started, 1),
                    "rss_mib": round(rss, 1),
                    "open_fds": fds,
                    "threads": server_threads,
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
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        dropped = metric(metrics_url, "limelight_drift_dropped_total") if alive else None
        window = metric(metrics_url, "limelight_drift_window_explanations") if alive else None
        server.send_signal(signal.SIGTERM)
        server.wait(60)

    second_half = [s for s in samples if s["t_s"] >= args.minutes * 30]
    log = (workdir / "server.log").read_text(errors="replace")
    reloaded = log.count("reloaded the inline outputs")
    failed_reloads = log.count("still serving")
    rss_growth = second_half[-1]["rss_mib"] - second_half[0]["rss_mib"] if second_half else 0.0
    fd_growth = second_half[-1]["open_fds"] - second_half[0]["open_fds"] if second_half else 0
    thread_counts = [s["threads"] for s in second_half]
    thread_growth = max(thread_counts) - min(thread_counts) if thread_counts else 0
    unexpected = {c: n for c, n in traffic.codes.items() if c not in EXPECTED}
    failed_jobs = {k: n for k, n in traffic.jobs.items() if not k.endswith(":JOB_STATE_SUCCEEDED")}
    report = {
        "machine": machine(),
        "demo": args.demo,
        "runtime": args.runtime,
        "minutes": args.minutes,
        "clients": args.clients,
        "stream_clients": args.stream_clients,
        "http_clients": args.http_clients,
        "truncation": args.truncation,
        "server_survived": alive,
        "inline_codes": dict(traffic.codes),
        "jobs": dict(traffic.jobs),
        "rss_growth_second_half_mib": round(rss_growth, 1),
        "fd_growth_second_half": fd_growth,
        "thread_spread_second_half": thread_growth,
        "drift_reports": dict(traffic.drift_reports),
        "drift_window_explanations": window,
        "drift_dropped": dropped,
        "reloads": reloaded,
        "failed_reloads": failed_reloads,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    rows = [[s["t_s"], s["rss_mib"], s["open_fds"], s["threads"], s["requests"], s["p50_ms"],
             s["p99_ms"]] for s in samples]  # fmt: skip
    header = ["t (s)", "RSS (MiB)", "fds", "threads", "requests", "p50 (ms)", "p99 (ms)"]
    print(markdown_table(header, rows))
    print(f"inline: {dict(traffic.codes)}\njobs: {dict(traffic.jobs)}")
    print(f"drift: reports {dict(traffic.drift_reports)}, window {window}, dropped {dropped}")
    if args.reload_every > 0:
        print(f"hot reloads: {reloaded}, failed: {failed_reloads}")
    ok = alive and not unexpected and not failed_jobs and fd_growth <= 2 and thread_growth <= 2
    ok = ok and (args.reload_every <= 0 or (reloaded > 0 and not failed_reloads))
    print("PASS" if ok else f"FAIL: unexpected={unexpected} failed_jobs={failed_jobs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
