"""``limelight serve --workers N``: several sidecar processes on one gRPC port.

Real processes started by the real CLI, real gRPC clients on loopback. Connections spread over
the workers, /metrics adds up every worker's values, a killed worker is replaced while the
port keeps serving, and SIGTERM stops them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from limelight.api.ports import free_port
from limelight_client import AsyncClient, Client, _common, _streams, errors
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc as pb_grpc

WORKERS = 2
#: Texts explain_many sends before its input pauses for the signal (see the stream test).
HELD = 100


@dataclass
class Workers:
    process: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def children(self) -> set[int]:
        """The supervisor's child processes: its workers."""
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return {int(pid) for pid in path.read_text().split()}

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()

    def wait_for_log(
        self, pattern: str, count: int = 1, patience_s: float | None = None
    ) -> list[str]:
        """Wait until ``pattern`` has appeared ``count`` times in the log (or the process ended,
        or ``patience_s`` passed); its matches' first groups (or whole matches)."""
        end = None if patience_s is None else time.monotonic() + patience_s
        while len(found := re.findall(pattern, self.log.read_text())) < count:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert end is None or time.monotonic() < end, (pattern, self.log.read_text()[-3000:])
            time.sleep(0.1)
        return found

    def worker_pid(self, index: int, count: int = 1) -> int:
        """The pid of the ``count``-th worker ``index`` the supervisor started."""
        started = self.wait_for_log(rf"worker {index} started \(pid (\d+)\)", count, 300)
        return int(started[count - 1])


def launch_workers(
    model_dir: Path, log: Path, jobs: str = "off", env: dict[str, str] | None = None
) -> Workers:
    """``serve --workers`` started, not yet waited for (``env``: added to the environment)."""
    port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model_dir)]
    argv += ["--workers", str(WORKERS), "--jobs", jobs, "--port", str(port)]
    argv += ["--metrics-port", str(metrics_port), "--grace-period-s", "5"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    return Workers(process, port, metrics_port, log)


def start_workers(
    model_dir: Path, log: Path, jobs: str = "off", env: dict[str, str] | None = None
) -> Workers:
    workers = launch_workers(model_dir, log, jobs, env)
    workers.wait_for_log(f"with {WORKERS} worker processes")
    return workers


def stop(workers: Workers) -> int:
    workers.process.send_signal(signal.SIGTERM)
    try:
        return workers.process.wait(60)
    finally:
        if workers.process.poll() is None:
            workers.process.kill()


@pytest.fixture(scope="module")
def served(
    bert_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> Iterator[Workers]:
    folder = tmp_path_factory.mktemp("workers")
    workers = start_workers(bert_tiny_dir, folder / "serve.log", jobs=redis_url)
    # Jobs queued in Redis run in `limelight worker` processes, whichever sidecar took them.
    argv = [sys.executable, "-m", "limelight.cli.main", "worker", "--model", str(bert_tiny_dir)]
    with (folder / "jobs.log").open("wb") as out:
        job_worker = subprocess.Popen([*argv, "--jobs", redis_url], stdout=out, stderr=out)
    yield workers
    stop(workers)
    job_worker.terminate()
    job_worker.wait(60)


def open_channels(target: str, count: int) -> list[grpc.Channel]:
    # A local subchannel pool: each channel its own connection, not one shared by all.
    options = [("grpc.use_local_subchannel_pool", 1)]
    return [grpc.insecure_channel(target, options=options) for _ in range(count)]


def explain_over_channels(target: str, channels: int, per_channel: int) -> list[str]:
    """``per_channel`` Explain calls on each of ``channels`` new connections; the labels.
    The calls wait for a connection rather than fail on a refused one (``wait_for_ready``), as
    a client that rides out a worker's restart would."""
    opened = open_channels(target, channels)
    try:
        return explain_on(opened, per_channel, wait_for_ready=True)
    finally:
        for channel in opened:
            channel.close()


def explain_on(
    channels: list[grpc.Channel], per_channel: int, wait_for_ready: bool = False
) -> list[str]:
    labels = []
    for i, channel in enumerate(channels):
        stub = pb_grpc.ExplainerStub(channel)
        for j in range(per_channel):
            request = pb.ExplainRequest(text=f"review {i}.{j}: a gorgeous, witty film")
            answer = stub.Explain(request, timeout=60, wait_for_ready=wait_for_ready)
            labels.append(answer.label)
    return labels


def ok_calls(body: str, rpc: str) -> float:
    """The count of ``rpc``'s successful calls in a /metrics page (one series, or none yet)."""
    series = rf'^limelight_request_duration_seconds_count\{{code="OK",rpc="{re.escape(rpc)}"\}} '
    found = re.findall(series + r"(\S+)$", body, flags=re.M)
    assert len(found) <= 1, found
    return float(found[0]) if found else 0.0


def per_worker(body: str, metric: str) -> dict[str, float]:
    """``metric``'s value by ``pid`` label (gauges that each worker reports for itself)."""
    found = re.findall(rf'^{metric}\{{pid="(\d+)"\}} (\S+)$', body, flags=re.M)
    return {pid: float(value) for pid, value in found}


def test_connections_spread_over_the_workers_and_metrics_add_up(served: Workers) -> None:
    before = served.metrics()
    channels, per_channel = open_channels(served.target, 16), 5
    try:
        labels = explain_on(channels, per_channel)
        assert len(labels) == 16 * per_channel and set(labels) <= {"rotten", "fresh"}
        # GetDrift makes the worker behind each connection refresh its drift gauges now.
        for channel in channels:
            pb_grpc.ExplainerStub(channel).GetDrift(pb.GetDriftRequest(), timeout=30)
    finally:
        for channel in channels:
            channel.close()

    body = served.metrics()
    # One series, the sum over both workers' processes: every call counted once.
    assert ok_calls(body, "Explain") - ok_calls(before, "Explain") == 16 * per_channel
    # Each worker's drift monitor saw its own share of the traffic (a pid label per worker);
    # with 16 connections both got some (all on one: probability 2 ** -15).
    seen = per_worker(body, "limelight_drift_reference_explanations")
    assert set(seen) == {str(pid) for pid in served.children()}
    assert len(seen) == WORKERS and all(n > 0 for n in seen.values()), seen
    assert sum(seen.values()) == 16 * per_channel
    assert "limelight_ready 1.0" in body  # the least ready worker is ready
    assert 'limelight_model_info{architecture="bert"' in body  # the answering worker's info
    assert "limelight_requests_in_flight" in body
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=body, capture_output=True, text=True, check=False
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_the_http_port_is_shared_too(served: Workers) -> None:
    """Every worker serves the HTTP port (``SO_REUSEPORT``, like the gRPC port): KServe v1
    ``:predict`` calls, each on its own connection, are answered by both workers, and
    ``/metrics`` from whichever worker answers it adds up every worker's counts."""
    metric = "limelight_drift_reference_explanations"
    before = served.metrics()
    (name,) = http_json(f"http://127.0.0.1:{served.metrics_port}/v1/models")["models"]
    url = f"http://127.0.0.1:{served.metrics_port}/v1/models/{name}:predict"
    calls = 16
    for i in range(calls):  # urllib opens a new connection for every request
        instances = {"instances": [f"review {i}: a gorgeous, witty film"]}
        assert http_json(url, instances)["predictions"][0]["label"] in {"rotten", "fresh"}
    channels = open_channels(served.target, 16)
    try:  # each worker refreshes its drift gauges now
        for channel in channels:
            pb_grpc.ExplainerStub(channel).GetDrift(pb.GetDriftRequest(), timeout=30)
    finally:
        for channel in channels:
            channel.close()
    for _ in range(4):  # whichever worker answers /metrics, the same sums
        body = served.metrics()
        gained = {
            pid: n - per_worker(before, metric).get(pid, 0.0)
            for pid, n in per_worker(body, metric).items()
        }
        # 16 connections over 2 workers: all on one has probability 2 ** -15.
        assert len(gained) == WORKERS and all(n > 0 for n in gained.values()), gained
        assert sum(gained.values()) == calls
        assert ok_calls(body, "v1.predict") - ok_calls(before, "v1.predict") == calls


def http_json(url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_one_sdk_client_reaches_every_worker(served: Workers) -> None:
    """``Client(connections=N)``: unary calls and ``explain_many``'s streams are spread over
    its connections, so one client uses every worker; answers come back in input order."""
    metric = "limelight_drift_reference_explanations"  # each worker's count of explanations
    before = per_worker(served.metrics(), metric)
    texts = [f"review {i}: a gorgeous, witty film" + " indeed" * (i % 7) for i in range(64)]
    with Client(served.target, connections=16) as client:
        client.wait_ready(timeout=60)
        answers = list(client.explain_many(texts))
        for _ in range(client.connections):
            client.drift()  # each connection's worker refreshes its drift gauges now
    assert [a.text for a in answers] == texts
    assert all(a.label in {"rotten", "fresh"} and a.tokens for a in answers)
    after = per_worker(served.metrics(), metric)
    gained = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    # 16 connections over 2 workers: all on one has probability 2 ** -15.
    assert len(gained) == WORKERS and all(n > 0 for n in gained.values()), gained
    assert sum(gained.values()) == len(texts)


def test_streamed_single_calls_reach_every_worker(served: Workers) -> None:
    """``single_calls="stream"`` over spread connections: single calls from several threads
    ride the connections' pooled streams to both workers, each answered with its own text."""
    metric = "limelight_drift_reference_explanations"
    before = per_worker(served.metrics(), metric)
    texts = [f"review {i}: a witty, gorgeous film" + " truly" * (i % 4) for i in range(40)]
    answers: dict[int, str | None] = {}
    with Client(served.target, connections=4, single_calls="stream") as client:
        client.wait_ready(timeout=60)

        def work(k: int) -> None:
            for i in range(k, len(texts), 4):
                answers[i] = client.explain(texts[i], timeout=60).text

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _ in range(client.connections):
            client.drift()
    assert [answers[i] for i in range(len(texts))] == texts
    after = per_worker(served.metrics(), metric)
    gained = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    assert len(gained) == WORKERS and all(n > 0 for n in gained.values()), gained
    assert sum(gained.values()) == len(texts)


def test_two_connections_are_spread_over_the_two_workers(served: Workers) -> None:
    """Each worker says who it is (``GetModel``); a client with as many connections as workers
    re-dials until every worker has one, so its stream work is split evenly between them."""
    metric = "limelight_drift_reference_explanations"
    before = per_worker(served.metrics(), metric)
    texts = [f"review {i}: an overwrought misfire" + " sadly" * (i % 5) for i in range(40)]
    with Client(served.target, connections=2) as client:
        client.wait_ready(timeout=60)
        infos = [client.model() for _ in range(2)]  # one on each connection, in turn
        assert {i.workers for i in infos} == {WORKERS}
        assert len({i.instance for i in infos}) == 2
        assert [a.text for a in client.explain_many(texts)] == texts
        for _ in range(client.connections):
            client.drift()
    after = per_worker(served.metrics(), metric)
    gained = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    # Item i went to connection i % 2; the two connections reached different workers.
    assert sorted(gained.values()) == [len(texts) / 2] * 2, gained


def test_a_job_submitted_to_one_worker_is_seen_by_all(served: Workers) -> None:
    """Jobs live in Redis: any worker runs them, every connection reads the same job."""
    channels = open_channels(served.target, 8)
    try:
        stubs = [pb_grpc.ExplainerStub(channel) for channel in channels]
        request = pb.SubmitJobRequest(text="a gorgeous, witty film", method="grad_x_input")
        job = stubs[0].SubmitJob(request, timeout=60)
        done = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)
        while job.state not in done:
            time.sleep(0.1)
            job = stubs[1].GetJob(pb.GetJobRequest(id=job.id), timeout=30)
        assert job.state == pb.JOB_STATE_SUCCEEDED, job.error
        seen = [s.GetJob(pb.GetJobRequest(id=job.id), timeout=30) for s in stubs]
        assert {j.state for j in seen} == {pb.JOB_STATE_SUCCEEDED}
        scores = list(job.result.explanation.scores)
        assert scores and all(list(j.result.explanation.scores) == scores for j in seen)
    finally:
        for channel in channels:
            channel.close()


def test_a_killed_worker_is_replaced_and_sigterm_stops_all(
    bert_tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_common, "SPREAD_RECHECK_S", 0.0)  # the SDK looks before every call
    monkeypatch.setattr(_common, "SPREAD_RETRY_S", 0.2)
    workers = start_workers(bert_tiny_dir, tmp_path / "serve.log")
    client = Client(workers.target, connections=2)
    try:
        first = workers.children()
        assert len(first) == WORKERS
        client.wait_ready(timeout=60)
        before = {client.model().instance for _ in range(2)}
        assert len(before) == 2  # spread: one connection on each worker
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        # The port keeps serving: connections go to the survivor while the supervisor restarts
        # (one that the kernel had queued for the victim as it died is reset, and retried).
        assert len(explain_over_channels(workers.target, 4, 2)) == 8
        # Meanwhile the SDK client's connection to the victim is re-established on the
        # survivor, the only worker listening until the new one is warm.
        during = {client.model(timeout=30).instance for _ in range(2)}
        assert len(during) == 1 and during <= before
        workers.wait_for_log(r"\[worker \d\] limelight\.api\.server: SERVING", WORKERS + 1)
        now = workers.children()
        assert victim not in now and len(now) == WORKERS and first - {victim} <= now
        assert len(explain_over_channels(workers.target, 8, 2)) == 16
        # The dead worker's live gauges are gone from /metrics, the new worker's are there.
        shown = per_worker(workers.metrics(), "limelight_drift_reference_explanations")
        assert set(shown) == {str(pid) for pid in now}
        # The SDK client's next looks find its two connections on one worker and re-dial until
        # the new worker has one again.
        after = reached_instances(client, until=lambda found: len(found) == 2)
        assert len(after) == 2 and len(after & before) == 1, (before, after)
    finally:
        client.close()
        code = stop(workers)
    assert code == 0, workers.log.read_text()[-3000:]
    for pid in now:  # every worker stopped and was reaped
        assert not Path(f"/proc/{pid}").exists()
    # A worker reads only the settings that were set: no warning about thresholds nobody set.
    assert "thresholds apply to multi-label models only" not in workers.log.read_text()


def kill_worker_0_while_worker_1_loads(workers: Workers) -> tuple[int, int]:
    """SIGKILL worker 0 once it serves (worker 1 starts only then), while worker 1 is held
    still (SIGSTOP) at the start of its loading: it stays not ready for as long as the test
    needs. The pids of the victim and of worker 1."""
    victim = workers.worker_pid(0)
    loading = workers.worker_pid(1)
    os.kill(loading, signal.SIGSTOP)
    os.kill(victim, signal.SIGKILL)
    return victim, loading


def test_a_worker_killed_while_another_loads_is_restarted_at_once(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """A worker that dies while another still loads its model (an OOM kill as N copies load
    side by side) is restarted at once, not once the others are ready: the port, served by
    nobody meanwhile, serves again from the replacement. The SERVING line names live pids."""
    workers = launch_workers(bert_tiny_dir, tmp_path / "serve.log")
    loading = 0
    try:
        victim, loading = kill_worker_0_while_worker_1_loads(workers)
        # Worker 1 cannot be ready: the replacement must not wait for it (it did, forever).
        replacement = workers.worker_pid(0, count=2)
        workers.wait_for_log(rf"worker 0 \(pid {replacement}\) is serving", patience_s=300)
        with grpc.insecure_channel(workers.target) as channel:  # a fresh connection
            info = pb_grpc.ExplainerStub(channel).GetModel(pb.GetModelRequest(), timeout=30)
        assert info.workers == WORKERS
        assert "SERVING on" not in workers.log.read_text()  # not while worker 1 loads
        os.kill(loading, signal.SIGCONT)
        (pids,) = workers.wait_for_log(rf"with {WORKERS} worker processes \(pids ([\d, ]+)\)")
        named = {int(pid) for pid in pids.split(", ")}
        assert named == {replacement, loading} == workers.children()
        assert victim not in named
    finally:
        if loading:
            with contextlib.suppress(ProcessLookupError):
                os.kill(loading, signal.SIGCONT)
        code = stop(workers)
    assert code == 0, workers.log.read_text()[-3000:]


def test_a_replacement_that_hangs_while_it_loads_is_killed_and_started_again(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """Once the port serves, a worker that replaces a dead one and then hangs while it loads
    (held here with SIGSTOP) is killed after ``worker_start_timeout_s`` and started again,
    rather than leaving the port one worker short for good."""
    timeout_s = 45  # long enough for a start on a busy 2-core machine, short for the test
    env = {"LIMELIGHT_WORKER_START_TIMEOUT_S": str(timeout_s)}
    workers = start_workers(bert_tiny_dir, tmp_path / "serve.log", env=env)
    try:
        os.kill(workers.worker_pid(0), signal.SIGKILL)
        hung = workers.worker_pid(0, count=2)
        os.kill(hung, signal.SIGSTOP)
        workers.wait_for_log(rf"worker 0 \(pid {hung}\) was not serving {timeout_s} s", 1, 300)
        third = workers.worker_pid(0, count=3)
        workers.wait_for_log(rf"worker 0 \(pid {third}\) is serving", patience_s=300)
        assert workers.children() == {third, workers.worker_pid(1)}
        assert not Path(f"/proc/{hung}").exists()  # killed and reaped
    finally:
        code = stop(workers)
    assert code == 0, workers.log.read_text()[-3000:]


def test_sigterm_while_workers_load_stops_them_all(bert_tiny_dir: Path, tmp_path: Path) -> None:
    """SIGTERM to the supervisor while its workers still load (one of them a replacement for
    a worker that died at start) stops every one of them, and the supervisor, at once."""
    workers = launch_workers(bert_tiny_dir, tmp_path / "serve.log")
    loading = 0
    try:
        victim, loading = kill_worker_0_while_worker_1_loads(workers)
        replacement = workers.worker_pid(0, count=2)
    finally:
        if loading:  # loading again, like the replacement
            os.kill(loading, signal.SIGCONT)
        code = stop(workers)
    assert code == 0, workers.log.read_text()[-3000:]
    for pid in (victim, loading, replacement):  # stopped and reaped
        assert not Path(f"/proc/{pid}").exists()
    assert "did not stop in time" not in workers.log.read_text(), workers.log.read_text()[-3000:]


def test_a_worker_that_keeps_failing_at_start_is_given_up_on(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """Restarts during start-up follow the same failed-start count as later: a worker that
    cannot load its model (weights that are not safetensors, which the supervisor's own
    checks do not read) is started ``MAX_FAILED_STARTS`` times, not once, nor forever."""
    from limelight.api.workers import MAX_FAILED_STARTS

    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((bert_tiny_dir / name).read_bytes())
    (model / "model.safetensors").write_text("not safetensors")
    argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(model)]
    argv += ["--workers", "2", "--jobs", "off", "--port", str(free_port()), "--metrics-port", "0"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(re.findall(r"worker 0 started", out.stderr)) == MAX_FAILED_STARTS, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"limelight serve: error: {MAX_FAILED_STARTS} worker starts failed in a row; stopping"
    )


def test_a_worker_that_stops_answering_is_killed_and_started_again(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """A serving worker whose event loop freezes (held here with SIGSTOP) keeps its share of the
    port and answers none of it; the probes, landing on either worker, would notice only by
    chance. Its heartbeat stops, and after ``worker_unresponsive_s`` the supervisor kills it
    and starts another; the other worker is left alone."""
    limit_s = 10  # beats every 1.7 s: a busy 2-core machine must not miss six in a row
    env = {"LIMELIGHT_WORKER_UNRESPONSIVE_S": str(limit_s)}
    workers = start_workers(bert_tiny_dir, tmp_path / "serve.log", env=env)
    try:
        frozen, other = workers.worker_pid(0), workers.worker_pid(1)
        os.kill(frozen, signal.SIGSTOP)
        workers.wait_for_log(rf"worker 0 \(pid {frozen}\) has not answered for {limit_s} s", 1, 300)
        replacement = workers.worker_pid(0, count=2)
        workers.wait_for_log(rf"worker 0 \(pid {replacement}\) is serving", patience_s=300)
        assert workers.children() == {replacement, other}
        assert not Path(f"/proc/{frozen}").exists()  # killed and reaped
        assert len(explain_over_channels(workers.target, 4, 2)) == 8
    finally:
        code = stop(workers)
    assert code == 0, workers.log.read_text()[-3000:]
    assert f"worker 1 (pid {other}) has not answered" not in workers.log.read_text()


def test_a_worker_that_refuses_its_settings_stops_the_server_at_once(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """Settings only a loaded model can judge (an unknown default method) are refused by the
    first worker: no second start (each one a model load), and the same exit status and last
    line as one process."""
    base = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(bert_tiny_dir)]
    base += ["--jobs", "off", "--metrics-port", "0", "--default-method", "no-such-method"]
    one = subprocess.run(
        [*base, "--port", str(free_port())], capture_output=True, text=True, timeout=600
    )
    several = subprocess.run(
        [*base, "--port", str(free_port()), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == several.returncode == 2, several.stderr[-3000:]
    assert len(re.findall(r"worker \d started", several.stderr)) == 1, several.stderr
    last = one.stderr.strip().splitlines()[-1]
    assert "unknown method 'no-such-method'" in last
    assert several.stderr.strip().splitlines()[-1] == last


@pytest.mark.parametrize(
    ("sig", "sdk"),
    [(signal.SIGTERM, "sync"), (signal.SIGKILL, "sync"), (signal.SIGTERM, "asyncio")],
    ids=["drained", "killed", "drained-asyncio"],
)
def test_explain_many_streams_ride_out_a_worker_that_goes_away(
    bert_tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sig: signal.Signals,
    sdk: str,
) -> None:
    """A worker drained (SIGTERM, as in a rolling restart) or killed while ``explain_many``
    has texts in flight on a stream to it: the stream is opened again on the other
    connection, what it had not answered goes out again, and the run ends with every answer
    once, in input order."""
    workers = start_workers(bert_tiny_dir, tmp_path / "serve.log")
    reopened: list[int] = []
    feed_class = _streams.StreamFeed if sdk == "sync" else _streams.AsyncStreamFeed
    reopen = feed_class.reopen

    def counted(feed: Any, k: int, *args: Any) -> Any:
        reopened.append(k)
        return reopen(feed, k, *args)

    monkeypatch.setattr(feed_class, "reopen", counted)
    texts = [f"review {i}: a gorgeous, witty film" + " indeed" * (i % 9) for i in range(600)]
    got: list[str | None] = []
    victim = min(workers.children())  # the client's two connections reach both workers
    # The input pauses after HELD texts until the signal is sent: otherwise a fast victim can
    # have read and answered its whole share before the signal lands, and a drained stream
    # that has nothing left to read ends OK, with nothing to open again.
    sent = threading.Event()

    def held() -> Iterator[str]:
        for i, text in enumerate(texts):
            if i == HELD:
                assert sent.wait(60)
            yield text

    async def held_async() -> AsyncIterator[str]:
        for i, text in enumerate(texts):
            while i == HELD and not sent.is_set():
                await asyncio.sleep(0.01)
            yield text

    def answered(text: str | None) -> None:
        got.append(text)
        if len(got) == 50:  # more in flight on both streams, hundreds still to send
            os.kill(victim, sig)
            sent.set()

    async def explain_async() -> None:
        async with AsyncClient(workers.target, connections=2) as client:
            await client.wait_ready(timeout=60)
            assert len({(await client.model()).instance for _ in range(2)}) == 2
            async for answer in client.explain_many(held_async()):
                answered(answer.text)

    try:
        if sdk == "asyncio":
            asyncio.run(explain_async())
        else:
            with Client(workers.target, connections=2) as client:
                client.wait_ready(timeout=60)
                assert len({client.model().instance for _ in range(2)}) == 2  # one on each
                for answer in client.explain_many(held()):
                    answered(answer.text)
    finally:
        stop(workers)
    assert got == texts
    assert reopened  # the victim's stream failed and was opened again


def reached_instances(
    client: Client, until: Callable[[set[str]], bool], patience_s: float = 60.0
) -> set[str]:
    """The processes ``client``'s connections reach after an explanation, asked again (each
    time after another explanation) until ``until`` holds or ``patience_s`` passed; a
    connection still reconnecting (UNAVAILABLE) counts as reaching none."""
    end = time.monotonic() + patience_s
    while True:
        found: set[str] = set()
        with contextlib.suppress(errors.Unavailable):
            client.explain("a gorgeous, witty film", timeout=30)
            found = {client.model(timeout=30).instance for _ in range(client.connections)}
        if until(found) or time.monotonic() > end:
            return found
        time.sleep(0.1)


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "so-reuseport"])
def test_a_taken_port_is_one_line_before_any_worker_starts(
    bert_tiny_dir: Path, tmp_path: Path, shared: bool
) -> None:
    """``shared``: the port is held with SO_REUSEPORT, as another supervisor's workers hold
    theirs. The workers bind with it too, so a second `serve --workers` joined the first on
    its port: the kernel split the traffic and the scrapes between two sidecars unnoticed."""
    with socket.socket() as taken:
        if shared:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(bert_tiny_dir)]
        argv += ["--workers", "2", "--jobs", "off", "--port", str(port), "--metrics-port", "0"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"limelight serve: error: cannot listen on 127.0.0.1:{port} (the port): another "
        "process listens there (another sidecar?); pick another port"
    ]


def test_the_run_folders_of_supervisors_that_are_gone_are_removed(tmp_path: Path) -> None:
    """A supervisor killed outright left its run folder (settings, ready files, every
    worker's metrics files) in the temp folder for good; the next one removes it."""
    import os

    from limelight.api.workers import RUN_DIR_PREFIX, remove_stale_run_dirs, run_dir_prefix

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{run_dir_prefix(gone.pid)}abc123"
    dead_before = tmp_path / f"{RUN_DIR_PREFIX}{gone.pid}-abc123"  # named by an older version
    alive = tmp_path / f"{run_dir_prefix(os.getpid())}def456"
    alive_before = tmp_path / f"{RUN_DIR_PREFIX}{os.getpid()}-def456"
    # The same pid, started at another time: a restarted container's supervisor (both PID 1)
    # found the one before it alive and kept its folder for good.
    pid, started = run_dir_prefix(os.getpid()).removeprefix(RUN_DIR_PREFIX).split("-")[:2]
    reused = tmp_path / f"{RUN_DIR_PREFIX}{pid}-{int(started) - 1}-ghi789"
    unnamed = tmp_path / f"{RUN_DIR_PREFIX}890ltx0b"  # no pid in the name: not ours to judge
    for folder in (dead, dead_before, alive, alive_before, reused, unnamed):
        (folder / "metrics").mkdir(parents=True)
    assert sorted(remove_stale_run_dirs(tmp_path)) == sorted([dead, dead_before, reused])
    assert alive.exists() and alive_before.exists() and unnamed.exists()


def test_a_sighup_that_finds_a_worker_starting_reaches_it_once_it_serves(tmp_path: Path) -> None:
    """A worker still loading when SIGHUP comes (a replacement that may already have read the
    files beside the model) gets the signal once it reports SERVING, not never."""
    from limelight.api.workers import Supervisor, _Worker
    from limelight.settings import Settings

    heard = tmp_path / "heard"
    code = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGHUP, lambda *_: pathlib.Path(sys.argv[1]).write_text('hup'))\n"
        "pathlib.Path(sys.argv[2]).write_text('up')\n"
        "time.sleep(60)\n"
    )
    up = tmp_path / "up"
    process = subprocess.Popen([sys.executable, "-c", code, str(heard), str(up)])
    try:
        deadline = time.monotonic() + 60
        while not up.exists():  # its handler is in place: a signal now cannot end it
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        supervisor = Supervisor(Settings(workers=2, jobs="off"))
        worker = _Worker(0, process, tmp_path / "ready-0")
        supervisor._workers[0] = worker
        supervisor.pass_reload_on()  # still starting: nothing sent yet
        time.sleep(0.5)
        assert not heard.exists()
        worker.ready_file.write_text("1234")
        supervisor._check(worker)  # now serving: the owed SIGHUP goes out
        while not heard.exists():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()
