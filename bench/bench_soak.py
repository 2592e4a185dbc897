"""Soak test: a real `limelight serve` process under mixed traffic for a long while.

    .venv/bin/python bench/bench_soak.py [--demo bert-tiny] [--runtime torch] [--minutes 10]
        [--clients 4] [--stream-clients 2] [--http-clients 1] [--rude-clients 2]
        [--truncation window] [--reload-every 10] [--workers 2 [--redis-restart-every 45]
        [--kill-worker-every 30]] [--out docs/bench/soak.json]

Unary Explain calls of short and long texts (up to the token limit; with ``--truncation
window``, every tenth a document of about 16,000 characters explained whole) from
``--clients`` threads, ``--stream-clients`` threads each keeping one ``ExplainStream`` open
(tokens in columns, as the SDK asks), ``--http-clients`` threads posting KServe v1 ``:explain``
calls of three texts to the HTTP port, a job thread submitting a rotation of job methods
(gradient, grad_x_input, integrated_gradients, lrp, slalom, random; with ``--truncation
window`` every ninth on a whole document) and waiting for each, and
a thread asking ``GetDrift`` every 2 s while the drift monitor (on, as it ships) observes every
answer, and ``--rude-clients`` threads that time out, cancel, close channels under calls, leave
streams and jobs, send bad input and kill a client process mid-stream. Every ``--sample-s``
seconds it records the server's resident memory, open file descriptors and threads (from
/proc) and the inline latency percentiles of that interval; at the end it reads the answers the
drift monitor had to drop, and what is still in flight or queued, from ``/metrics``, then stops
the server with SIGTERM. Passes when there were no unexpected answers, descriptors and threads
stayed flat over the second half of the run, nothing was left in flight, the server logged no
error and exited cleanly (memory is reported: its trend is read by a person, allocators do not
return every page). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
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
FINAL_JOB_STATES = {
    pb.JOB_STATE_SUCCEEDED,
    pb.JOB_STATE_FAILED,
    pb.JOB_STATE_CANCELLED,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def text_of(words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, size=words))


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the workers of ``--workers``)."""
    tree, i = [pid], 0
    while i < len(tree):
        # Each thread's children: a worker restarted by a supervisor thread is that thread's.
        for task in Path(f"/proc/{tree[i]}/task").glob("*"):
            with contextlib.suppress(OSError):
                tree += [int(c) for c in (task / "children").read_text().split()]
        i += 1
    return tree


def proc_stats(pid: int) -> tuple[float, int, int]:
    """Resident memory (MiB), open file descriptors and threads of ``pid`` and its children."""
    rss_kib = threads = fds = 0
    for member in process_tree(pid):
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kib += int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{member}/fd"))
        except OSError:  # a worker that has just ended
            continue
    return rss_kib / 1024, fds, threads


class RedisServer:
    """A redis-server with append-only persistence in ``directory`` (the job queue of
    ``--workers``), which the soak can kill and start again on the same port."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.port = directory, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--dir", str(self.directory), "--appendonly", "yes", "--save", ""]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    def restarts_every(self, every_s: float, down_s: float, stop: threading.Event) -> None:
        """SIGKILL (no chance to save anything beyond its append-only file), ``down_s`` of
        absence, start again."""
        while not stop.wait(every_s):
            self.kill()
            time.sleep(down_s)
            self.start()
            self.restarts += 1


def metric(metrics_url: str, name: str) -> float | None:
    """One unlabelled sample of the server's ``/metrics``, or None when it is not there."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def metric_sum(metrics_url: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label values) in the server's ``/metrics``."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.split()[-1]) for line in lines if line.startswith((name + "{", name + " "))
    )


#: Answers a rude client may get: its own deadline, its own cancellation, refused bad input.
RUDE_EXPECTED = EXPECTED | {"CANCELLED", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"}

#: A client process that opens a stream, keeps sending, and is killed with SIGKILL mid-call
#: (its connection is reset, not closed).
KILLED_CLIENT = """
import sys, grpc
from limelight_client.proto import explainer_pb2 as pb, explainer_pb2_grpc
stub = explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(sys.argv[1]))
def inputs():
    while True:
        yield pb.ExplainRequest(text=sys.argv[2])
for _ in stub.ExplainStream(inputs()):
    pass
"""


def repeat_until(stop: threading.Event, request: pb.ExplainRequest) -> Iterator[pb.ExplainRequest]:
    while not stop.is_set():
        yield request


class Traffic:
    def __init__(self, target: str, stop: threading.Event, long_words: int) -> None:
        self.target = target
        self.stop = stop
        self.long_words = long_words
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.codes: Counter[str] = Counter()
        self.rude_codes: Counter[str] = Counter()
        self.explain_url = ""  # KServe v1 :explain on the HTTP port, once known
        self.refused_jobs: Counter[str] = Counter()
        self.rewatched = 0
        self.retried_jobs = 0
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
            except grpc.RpcError as exc:
                # Refused (the job queue's Redis being restarted): an answer, not a lost job.
                with self.lock:
                    self.refused_jobs[exc.code().name] += 1
                time.sleep(0.5)
                continue
            state = self.follow(stub, job.id)
            with self.lock:
                self.jobs[f"{method}:{state}"] += 1

    def follow(self, stub: explainer_pb2_grpc.ExplainerStub, job_id: str) -> str:
        """The final state of an accepted job, watched to its end; a watch broken (the queue's
        Redis restarted under it) is taken up again, as a client would, for up to 10 minutes."""
        until = time.monotonic() + 600
        while True:
            try:
                for update in stub.WatchJob(pb.GetJobRequest(id=job_id), timeout=600):
                    if update.state in FINAL_JOB_STATES:
                        if update.attempts > 1:  # its worker died: reclaimed and run again
                            with self.lock:
                                self.retried_jobs += 1
                        return str(pb.JobState.Name(update.state))
                return "WATCH_ENDED_EARLY"
            except grpc.RpcError as exc:
                if time.monotonic() > until or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return exc.code().name
                with self.lock:
                    self.rewatched += 1
                time.sleep(0.5)

    def rude(self, index: int) -> None:
        """A client that behaves badly, in rotation: deadlines of a few milliseconds, calls
        cancelled while queued or running, streams cancelled with inputs still unanswered,
        channels closed under a call, jobs cancelled or abandoned while watched, bad input, and
        a client process killed mid-stream. Everything it gets must be an answer it asked for
        (its deadline, its cancellation, its bad input refused); the server must serve the other
        clients throughout and end with nothing in flight."""
        from google.protobuf import struct_pb2

        channel = grpc.insecure_channel(self.target)
        stub = explainer_pb2_grpc.ExplainerStub(channel)
        rng = np.random.default_rng(index)
        i = 0
        while not self.stop.is_set():
            i += 1
            kind = i % 9
            text = text_of(self.words(i, index), i + 20000 + 1000 * index)
            code = "OK"
            try:
                if kind == 0:  # a deadline shorter than a forward pass
                    stub.Explain(
                        pb.ExplainRequest(text=text), timeout=float(rng.uniform(0.001, 0.02))
                    )
                elif kind == 1:  # cancelled while queued or running
                    future = stub.Explain.future(pb.ExplainRequest(text=text), timeout=30)
                    time.sleep(float(rng.uniform(0, 0.01)))
                    future.cancel()
                    code = "CANCELLED" if future.cancelled() else future.code().name
                elif kind == 2:  # a stream cancelled after one answer, eight inputs sent
                    call = stub.ExplainStream(
                        iter([pb.ExplainRequest(text=text_of(10 + k, i + k)) for k in range(8)]),
                        timeout=30,
                    )
                    next(call)
                    call.cancel()
                    code = "CANCELLED"
                elif kind == 3:  # a stream whose deadline passes with inputs still coming
                    endless = repeat_until(self.stop, pb.ExplainRequest(text=text))
                    for _ in stub.ExplainStream(endless, timeout=0.2):
                        pass
                elif kind == 4:  # the channel closed under a call (a whole document)
                    own = grpc.insecure_channel(self.target)
                    long_text = text_of(self.long_words, i)
                    own_stub = explainer_pb2_grpc.ExplainerStub(own)
                    future = own_stub.Explain.future(pb.ExplainRequest(text=long_text), timeout=30)
                    time.sleep(float(rng.uniform(0, 0.02)))
                    own.close()
                    code = "CANCELLED" if future.cancelled() else future.code().name
                elif kind == 5:  # a job cancelled at once; another watched and abandoned
                    params = struct_pb2.Struct()
                    params.update({"num_samples": 200})
                    job = stub.SubmitJob(
                        pb.SubmitJobRequest(text=text, method="slalom", parameters=params),
                        timeout=30,
                    )
                    stub.CancelJob(pb.CancelJobRequest(id=job.id), timeout=30)
                    job = stub.SubmitJob(
                        pb.SubmitJobRequest(text=text, method="gradient"), timeout=30
                    )
                    watch = stub.WatchJob(pb.GetJobRequest(id=job.id), timeout=30)
                    next(watch)
                    watch.cancel()
                elif kind == 6:  # bad input: empty text, an unknown method, an unknown job
                    bad_calls = [
                        (stub.Explain, pb.ExplainRequest(text="")),
                        (stub.Explain, pb.ExplainRequest(text=text, method="nope")),
                        (stub.GetJob, pb.GetJobRequest(id="no-such-job")),
                    ]
                    for rpc, bad in bad_calls:
                        try:
                            rpc(bad, timeout=30)
                            self._rude_record("BAD_INPUT_ACCEPTED")
                        except grpc.RpcError as exc:
                            self._rude_record(exc.code().name)
                    if self.explain_url:
                        self._rude_record(self._bad_http(self.explain_url, text))
                    continue
                elif kind == 7 and i % 4 == 3:  # a client process killed mid-stream
                    child = subprocess.Popen(
                        [sys.executable, "-c", KILLED_CLIENT, self.target, text],
                        stderr=subprocess.DEVNULL,
                    )
                    time.sleep(float(rng.uniform(1.0, 2.0)))  # its import, then some answers
                    child.kill()
                    child.wait()
                    code = "KILLED"
                else:  # an ordinary call on the same channel: it must still be served
                    stub.Explain(pb.ExplainRequest(text=text), timeout=30)
            except grpc.RpcError as exc:
                code = exc.code().name
            except grpc.FutureCancelledError:
                code = "CANCELLED"
            self._rude_record(code)

    @staticmethod
    def _bad_http(url: str, text: str) -> str:
        """Malformed JSON to the KServe route (a 400 is its answer), then a body cut off half-way
        by a client that closes its connection."""
        request = urllib.request.Request(
            url, b'{"instances": [', {"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=30):
                return "BAD_JSON_ACCEPTED"
        except urllib.error.HTTPError as exc:
            if exc.code != 400:
                return f"HTTP_{exc.code}"
        parsed = urllib.parse.urlsplit(url)
        body = json.dumps({"instances": [text]}).encode()
        with socket.create_connection((parsed.hostname, parsed.port), timeout=30) as conn:
            conn.sendall(
                f"POST {parsed.path} HTTP/1.1\r\nHost: {parsed.netloc}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body[: len(body) // 2]
            )
        return "INVALID_ARGUMENT"  # both refused or dropped, as a client asking for it gets

    def _rude_record(self, code: str) -> None:
        with self.lock:
            self.rude_codes[code] += 1

    def take_latencies(self) -> list[float]:
        with self.lock:
            out, self.latencies = self.latencies, []
        return out


def _is_job_process(pid: int) -> bool:
    """A job process of ``limelight worker`` (started by multiprocessing's spawn), not the
    resource tracker that multiprocessing starts beside them."""
    with contextlib.suppress(OSError):
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return False


def worker_kills(
    parent: subprocess.Popen[bytes],
    every_s: float,
    stop: threading.Event,
    which: Callable[[int], bool] = lambda pid: True,
) -> list[int]:
    """SIGKILL the oldest of ``parent``'s worker processes (those ``which`` accepts) every
    ``every_s`` seconds, as a crash: the supervisor of ``--workers`` or ``limelight worker``
    starts another. Returns the list the killed pids go into."""
    killed: list[int] = []

    def run() -> None:
        while not stop.wait(every_s):
            workers = [pid for pid in process_tree(parent.pid)[1:] if which(pid)]
            if workers:
                # The oldest (pids grow): every worker in turn, the restarted ones too.
                victim = min(workers)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                    killed.append(victim)

    threading.Thread(target=run, name=f"kills-{parent.pid}", daemon=True).start()
    return killed


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
    parser.add_argument(
        "--rude-clients",
        type=int,
        default=0,
        help="threads that time out, cancel, close channels under calls, abandon streams and "
        "jobs, send bad input and kill a client process mid-stream",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="sidecar processes on the port; above 1 the job queue is a redis-server the soak "
        "starts (append-only persistence)",
    )
    parser.add_argument(
        "--redis-restart-every",
        type=float,
        default=0.0,
        help="seconds between kills (SIGKILL) and restarts of that redis-server (0: none); "
        "every job it had accepted must still end",
    )
    parser.add_argument(
        "--kill-worker-every",
        type=float,
        default=0.0,
        help="seconds between SIGKILLs of one of the --workers sidecars (0: none); calls on its "
        "connections fail UNAVAILABLE, the supervisor starts another",
    )
    parser.add_argument(
        "--kill-job-worker-every",
        type=float,
        default=0.0,
        help="seconds between SIGKILLs of the `limelight worker` job process (0: none; implies "
        "the Redis queue); its job is reclaimed once its heartbeat is older than "
        "--job-reclaim-idle-s, and must still succeed",
    )
    parser.add_argument(
        "--job-reclaim-idle-s",
        type=float,
        default=30.0,
        help="LIMELIGHT_JOB_RECLAIM_IDLE_S of the sidecars and the job worker (default as shipped)",
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
    redis_server = job_worker = None
    os.environ["LIMELIGHT_JOB_RECLAIM_IDLE_S"] = str(args.job_reclaim_idle_s)  # both read it
    if args.workers > 1 or args.redis_restart_every > 0 or args.kill_job_worker_every > 0:
        redis_server = RedisServer(workdir)
        redis_server.start()
        argv += ["--jobs", redis_server.url, "--workers", str(args.workers)]
        # With Redis the sidecars only queue jobs: a `limelight worker` process runs them.
        worker_argv = [sys.executable, "-m", "limelight.cli.main", "worker"]
        worker_argv += ["--model", str(model_dir), "--jobs", redis_server.url]
        worker_argv += ["--truncation", args.truncation, "--log-level", "WARNING"]
        job_worker = subprocess.Popen(
            worker_argv,
            cwd=ROOT,
            stderr=(workdir / "worker.log").open("wb"),
        )
    else:
        argv += ["--jobs-db", str(workdir / "jobs.db")]
    argv += ["--truncation", args.truncation]
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
    traffic.explain_url = explain_url
    first = args.clients + args.stream_clients
    threads += [
        threading.Thread(target=traffic.http, args=(first + i, explain_url))
        for i in range(args.http_clients)
    ]
    first += args.http_clients
    threads += [
        threading.Thread(target=traffic.rude, args=(first + i,)) for i in range(args.rude_clients)
    ]
    threads.append(threading.Thread(target=traffic.jobs_loop))
    threads.append(threading.Thread(target=traffic.drift_reader))
    if args.reload_every > 0:
        threads.append(
            threading.Thread(target=reloads, args=(server, model_dir, args.reload_every, stop))
        )
    if redis_server is not None and args.redis_restart_every > 0:
        threads.append(
            threading.Thread(
                target=redis_server.restarts_every, args=(args.redis_restart_every, 2.0, stop)
            )
        )
    for t in threads:
        t.start()
    killed = worker_kills(server, args.kill_worker_every, stop) if args.kill_worker_every else []
    jobs_killed: list[int] = []
    if job_worker is not None and args.kill_job_worker_every > 0:
        jobs_killed = worker_kills(job_worker, args.kill_job_worker_every, stop, _is_job_process)
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
        in_flight = pending = None
        if alive:  # every call has ended on the client side: nothing may be left on the server's
            time.sleep(1.0)
            in_flight = metric_sum(metrics_url, "limelight_requests_in_flight")
            pending = metric_sum(metrics_url, "limelight_inline_pending_requests")
        server.send_signal(signal.SIGTERM)
        term = time.monotonic()
        exit_code = server.wait(60)
        drain_s = time.monotonic() - term
        if job_worker is not None:
            job_worker.send_signal(signal.SIGTERM)
            job_worker.wait(120)
        if redis_server is not None:
            redis_server.kill()

    second_half = [s for s in samples if s["t_s"] >= args.minutes * 30]
    log = (workdir / "server.log").read_text(errors="replace")
    reloaded = log.count("reloaded the inline outputs")
    failed_reloads = log.count("still serving")
    rss_growth = second_half[-1]["rss_mib"] - second_half[0]["rss_mib"] if second_half else 0.0
    fd_growth = second_half[-1]["open_fds"] - second_half[0]["open_fds"] if second_half else 0
    thread_counts = [s["threads"] for s in second_half]
    thread_growth = max(thread_counts) - min(thread_counts) if thread_counts else 0
    # A killed worker's calls fail UNAVAILABLE (HTTP: a reset connection), as they must.
    crashed = {"UNAVAILABLE"} | {
        c for c in traffic.codes if c.startswith("HTTP_") and not c[5:].isdigit()
    }
    expected = EXPECTED | (crashed if killed else set())
    unexpected = {c: n for c, n in traffic.codes.items() if c not in expected}
    # The rude clients' job calls while the queue's Redis is down are refused, as they should be.
    rude_ok = RUDE_EXPECTED | {"KILLED"}
    rude_ok |= {"UNAVAILABLE"} if args.redis_restart_every or killed else set()
    rude_unexpected = {c: n for c, n in traffic.rude_codes.items() if c not in rude_ok}
    # Each supervisor's record of each kill: the sidecars' and `limelight worker`'s.
    restarted = len(re.findall(r"worker \d+ \(pid \d+\) exited with -9", log))
    job_restarted = 0
    if job_worker is not None:
        worker_log = (workdir / "worker.log").read_text(errors="replace")
        job_restarted = len(
            re.findall(r"worker process \d+ \(pid \d+\) exited with -9", worker_log)
        )
        log += worker_log
    errors_logged = sum(
        1
        for line in log.splitlines()
        if (" ERROR " in line and "exited with -9" not in line) or line.startswith("Traceback")
    )
    failed_jobs = {k: n for k, n in traffic.jobs.items() if not k.endswith(":JOB_STATE_SUCCEEDED")}
    report = {
        "machine": machine(),
        "demo": args.demo,
        "runtime": args.runtime,
        "minutes": args.minutes,
        "clients": args.clients,
        "stream_clients": args.stream_clients,
        "http_clients": args.http_clients,
        "rude_clients": args.rude_clients,
        "truncation": args.truncation,
        "server_survived": alive,
        "inline_codes": dict(traffic.codes),
        "jobs": dict(traffic.jobs),
        "rude_codes": dict(traffic.rude_codes),
        "workers": args.workers,
        "jobs_refused": dict(traffic.refused_jobs),
        "watches_taken_up_again": traffic.rewatched,
        "redis_restarts": redis_server.restarts if redis_server is not None else 0,
        "workers_killed": len(killed),
        "worker_deaths_logged": restarted,
        "job_workers_killed": len(jobs_killed),
        "jobs_run_again": traffic.retried_jobs,
        "job_worker_deaths_logged": job_restarted,
        "in_flight_after": in_flight,
        "pending_after": pending,
        "drain_s": round(drain_s, 2),
        "exit_code": exit_code,
        "errors_logged": errors_logged,
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
    if args.rude_clients:
        print(f"rude clients: {dict(traffic.rude_codes)}")
    if redis_server is not None:
        print(
            f"redis restarts: {redis_server.restarts}; jobs refused {dict(traffic.refused_jobs)},"
            f" watches taken up again {traffic.rewatched}"
        )
    print(
        f"after the traffic: in flight {in_flight}, pending {pending}; SIGTERM to exit "
        f"{drain_s:.2f} s (exit code {exit_code}); errors logged {errors_logged}"
    )
    if args.reload_every > 0:
        print(f"hot reloads: {reloaded}, failed: {failed_reloads}")
    if killed:
        print(f"workers killed: {len(killed)}, deaths the supervisor logged: {restarted}")
    if jobs_killed:
        print(
            f"job processes killed: {len(jobs_killed)}, deaths logged: {job_restarted}; jobs "
            f"reclaimed and run again: {traffic.retried_jobs}"
        )
    # With kills a sample may fall while a worker is being replaced: the counts are reported.
    flat = bool(killed) or (fd_growth <= 2 and thread_growth <= 2)
    ok = alive and not unexpected and not failed_jobs and flat
    ok = ok and not rude_unexpected and in_flight == 0 and pending == 0 and exit_code == 0
    ok = ok and not errors_logged
    # Jobs are refused only while the queue's Redis is down or a worker has just died.
    ok = ok and (args.redis_restart_every > 0 or bool(killed) or not traffic.refused_jobs)
    ok = ok and (args.reload_every <= 0 or (reloaded > 0 and not failed_reloads))
    ok = ok and restarted == len(killed) and job_restarted == len(jobs_killed)
    print(
        "PASS"
        if ok
        else f"FAIL: unexpected={unexpected} rude={rude_unexpected} failed_jobs={failed_jobs}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
