"""Overload, sustained load, graceful SIGTERM and fuzzed requests against a real sidecar."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from limelight.api.ports import free_port
from limelight_client.proto import explainer_pb2 as pb
from limelight_client.proto import explainer_pb2_grpc
from tests.conftest import RunningSidecar


def _stub(target: str) -> explainer_pb2_grpc.ExplainerStub:
    return explainer_pb2_grpc.ExplainerStub(grpc.insecure_channel(target))


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_overload_is_refused_fast_and_the_server_recovers(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    side = start_sidecar(
        model_dir=bert_tiny_dir, jobs="off", max_pending=4, max_batch_size=2, max_batch_wait_ms=0
    )
    stub = _stub(side.target)
    long_review = "an ambitious, sprawling and often tedious film " * 12
    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        codes = list(
            pool.map(
                lambda _: _code(
                    lambda: stub.Explain(pb.ExplainRequest(text=long_review), timeout=60)
                ),
                range(192),
            )
        )
    counts = Counter(codes)
    assert set(counts) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, counts
    assert counts[grpc.StatusCode.RESOURCE_EXHAUSTED] > 0 and counts[grpc.StatusCode.OK] > 0
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(side.target))
    status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert stub.Explain(pb.ExplainRequest(text="calm again"), timeout=30).explanation.scores


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.fixture
def served_process(bert_tiny_dir: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    """`limelight serve` as a real child process (for signals and memory readings)."""
    port = free_port()
    env = {**os.environ, "LIMELIGHT_GRACE_PERIOD_S": "20"}
    # Its log goes to a file: a pipe nobody reads while the test runs would fill (64 KiB) and
    # then block the server on its next log line.
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "limelight.cli.main", "serve", "--model", str(bert_tiny_dir),
             "--port", str(port), "--metrics-port", "0", "--jobs", "sqlite",
             "--jobs-db", str(tmp_path / "jobs.db"), "--max-batch-size", "4"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    target = f"127.0.0.1:{port}"
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    deadline = time.monotonic() + 300
    while True:
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                break
        except grpc.RpcError:
            pass
        assert proc.poll() is None, log.read_text()[-3000:]
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the sidecar did not become SERVING")
        time.sleep(0.2)
    yield proc, target
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def test_sustained_load_has_no_errors_and_bounded_memory(served_process) -> None:  # type: ignore[no-untyped-def]
    proc, target = served_process
    stub = _stub(target)
    stub.Explain(pb.ExplainRequest(text="warm"), timeout=60)
    rss_before = _rss_kib(proc.pid)
    latencies: list[float] = []
    codes: Counter[grpc.StatusCode] = Counter()

    def client(index: int) -> None:
        end = time.monotonic() + 6.0  # bounded in time ...
        for i in range(400):  # ... and in count
            if time.monotonic() > end:
                break
            request = pb.ExplainRequest(text=f"film {index}-{i} was good")
            start = time.perf_counter()
            codes[_code(functools.partial(stub.Explain, request, timeout=60))] += 1
            latencies.append(time.perf_counter() - start)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(client, range(8)))
    rss_after = _rss_kib(proc.pid)
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(
        f"\nload: {len(latencies)} requests, 8 clients, p99 {p99 * 1e3:.1f} ms, "
        f"RSS {rss_before / 1024:.0f} -> {rss_after / 1024:.0f} MiB"
    )
    assert codes == Counter({grpc.StatusCode.OK: len(latencies)})
    # Memory stays bounded: a leak per request would show as growth proportional to traffic.
    assert rss_after - rss_before < 200 * 1024


def _outcome(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_sigterm_drains_accepted_requests(served_process) -> None:  # type: ignore[no-untyped-def]
    proc, target = served_process
    stub = _stub(target)
    long_review = "a slow, moody, beautifully shot film about grief and memory " * 8
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = [
            pool.submit(
                _outcome, lambda: stub.Explain(pb.ExplainRequest(text=long_review), timeout=60)
            )
            for _ in range(96)
        ]
        # SIGTERM while the server is busiest: as soon as the first answer is back.
        concurrent.futures.wait(
            futures, timeout=120, return_when=concurrent.futures.FIRST_COMPLETED
        )
        proc.send_signal(signal.SIGTERM)
        outcomes = [f.result() for f in futures]
    assert proc.wait(60) == 0
    codes = Counter(code for code, _ in outcomes)
    # Nothing was dropped half-way (CANCELLED/INTERNAL/UNKNOWN): every request either got its
    # answer or was refused as UNAVAILABLE.
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
    assert codes[grpc.StatusCode.OK] > 0, codes
    # Every UNAVAILABLE was a refusal of a new request (the server was draining, or already
    # gone), never an accepted one cut off half-way: those all answered OK.
    cut_off = [d for code, d in outcomes if code == grpc.StatusCode.UNAVAILABLE and _cut_off(d)]
    assert not cut_off, Counter(cut_off)


def _cut_off(details: str) -> bool:
    """An UNAVAILABLE that ended an accepted call: ended at the final stop, or refused
    between the tokenizer and the batcher."""
    return "shutting down" in details or "not accepting" in details


ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def fuzz_target(bert_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from limelight.settings import Settings
    from tests.conftest import SidecarThread

    handle = SidecarThread(
        Settings(
            model_dir=bert_tiny_dir,
            port=0,
            metrics_port=0,
            jobs="sqlite",
            jobs_db=tmp_path_factory.mktemp("fuzz") / "jobs.db",
            job_queue_max=5000,
        )
    )
    running = handle.start()
    yield running.target
    handle.stop()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.one_of(
        st.text(max_size=200),
        # Huge strings around the 20,000-character limit (Hypothesis caps generated sizes).
        st.builds(lambda s, k: s * k, st.text(min_size=1, max_size=10), st.integers(1_000, 4_000)),
    ),
    pair=st.none() | st.text(max_size=50),
    label=st.none() | st.text(max_size=10) | st.sampled_from(["rotten", "fresh"]),
    index=st.none() | st.integers(-(2**31), 2**31 - 1),
    method=st.sampled_from(["", "normxlogit", "lrp", "nope", "slalom", "\x00"]),
)
def test_fuzzed_explain_always_answers_with_a_status(
    fuzz_target: str,
    text: str,
    pair: str | None,
    label: str | None,
    index: int | None,
    method: str,
) -> None:
    request = pb.ExplainRequest(text=text, method=method)
    if pair is not None:
        request.text_pair = pair
    if label is not None:
        request.target.label = label
    elif index is not None:
        request.target.index = index
    code = _code(lambda: _stub(fuzz_target).Explain(request, timeout=60))
    assert code in ALLOWED


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    method=st.sampled_from(["gradient", "integrated_gradients", "slalom", "lrp", "bogus", ""]),
    params=st.dictionaries(
        st.sampled_from(["steps", "seed", "num_samples", "baseline", "use_mask", "x"]),
        json_values,
        max_size=3,
    ),
)
def test_fuzzed_job_parameters_are_validated_before_queueing(fuzz_target, method, params) -> None:  # type: ignore[no-untyped-def]
    from google.protobuf import struct_pb2

    struct = struct_pb2.Struct()
    struct.update(params)
    stub = _stub(fuzz_target)
    try:
        job = stub.SubmitJob(
            pb.SubmitJobRequest(text="a fine film", method=method, parameters=struct), timeout=60
        )
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED
        return
    stub.CancelJob(pb.CancelJobRequest(id=job.id), timeout=30)


def test_error_messages_do_not_echo_unbounded_input(sidecar: RunningSidecar) -> None:
    stub = _stub(sidecar.target)
    huge = "x" * 100_000
    with pytest.raises(grpc.RpcError) as err:
        stub.GetJob(pb.GetJobRequest(id=huge), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(err.value.details() or "") <= 1024
    request = pb.ExplainRequest(text="a fine film")
    request.target.label = huge
    with pytest.raises(grpc.RpcError) as err:
        stub.Explain(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(err.value.details() or "") <= 1024


def test_client_deadlines_are_counted_not_logged_as_errors(
    sidecar: RunningSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    stub = _stub(sidecar.target)
    requests = [pb.ExplainRequest(text="a gorgeous , witty , seductive movie " * 20)] * 4
    expired = 0
    with caplog.at_level("WARNING"):
        for _ in range(3000):
            if expired >= 300:
                break
            try:
                list(stub.ExplainStream(iter(requests), timeout=0.002))
            except grpc.RpcError as exc:
                expired += exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The server is still healthy, and handled every expiry without an error log.
        assert stub.Explain(pb.ExplainRequest(text="fine"), timeout=30).label
    assert expired >= 300
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not errors, [r.getMessage() for r in errors[:3]]
    counted = sidecar.server.metrics.registry.get_sample_value(
        "limelight_request_duration_seconds_count",
        {"rpc": "ExplainStream", "code": "DEADLINE_EXCEEDED"},
    )
    assert counted is not None and counted > 0


def test_an_answer_to_a_client_that_hung_up_is_a_warning_line(
    sidecar: RunningSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    """gRPC's own report of an answer its core would not send (the call had ended: the client
    cancelled or closed its connection between the handler's return and the send), as gRPC
    writes it, reaches the server's log as one WARNING line without a traceback."""
    import logging

    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    with caplog.at_level("WARNING"):
        try:
            raise RuntimeError('Failed "execute_batch"')
        except RuntimeError:
            grpc_log.exception(
                "ExecuteBatchError raised in core by servicer method [%s]",
                "/limelight.v1.Explainer/Explain",
            )
        grpc_log.error("Unexpected [ValueError] raised by servicer method [/x]")  # not a hang-up
    hung_up, other = caplog.records[-2:]
    assert (hung_up.levelname, hung_up.exc_info) == ("WARNING", None)
    assert hung_up.getMessage().startswith("/limelight.v1.Explainer/Explain: the answer was not")
    assert other.levelname == "ERROR"


def test_an_http_client_that_hangs_up_mid_body_is_counted_not_logged_as_an_error(
    sidecar: RunningSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    import json
    import socket
    import urllib.request

    assert sidecar.settings.model_dir is not None
    port, model = sidecar.server.metrics_port, sidecar.settings.model_dir.name
    path = f"/v1/models/{model}:explain"
    body = json.dumps({"instances": ["a gorgeous, witty, seductive movie"]}).encode()
    registry = sidecar.server.metrics.registry
    labels = {"rpc": "v1.explain", "code": "CANCELLED"}
    with caplog.at_level("WARNING"):
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
                head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                conn.sendall(head.encode() + body[: len(body) // 2])
        until = time.monotonic() + 60  # a hang guard, not a speed limit
        while (
            registry.get_sample_value("limelight_request_duration_seconds_count", labels) or 0
        ) < 3:
            assert time.monotonic() < until, "the hang-ups were not counted"
            time.sleep(0.05)
        # The port goes on serving.
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert len(json.loads(response.read())["explanations"]) == 1
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not errors, [r.getMessage() for r in errors[:3]]


def test_shutdown_keeps_one_deadline_and_ends_open_calls_unavailable(
    bert_tiny_dir: Path, tmp_path: Path
) -> None:
    from google.protobuf import struct_pb2
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from limelight.api.server import LIVENESS_SERVICE
    from limelight.settings import Settings
    from tests.conftest import SidecarThread

    grace = 3.0
    handle = SidecarThread(
        Settings(
            model_dir=bert_tiny_dir,
            port=0,
            metrics_port=0,
            jobs="sqlite",
            jobs_db=tmp_path / "jobs.db",
            grace_period_s=grace,
            method_plugins=["tests.jobs.jobs_testing_methods:BlockMethod"],
        )
    )
    running = handle.start()
    stub = _stub(running.target)
    params = struct_pb2.Struct()
    params.update({"release": str(tmp_path / "never"), "started": str(tmp_path / "started")})
    job = stub.SubmitJob(
        pb.SubmitJobRequest(text="a film", method="block", parameters=params), timeout=30
    )
    watch = stub.WatchJob(pb.GetJobRequest(id=job.id), timeout=300)
    for update in watch:  # the job runs and never finishes on its own
        if update.state == pb.JOB_STATE_RUNNING:
            break
    budgets: list[float] = []
    draining: dict[str, int] = {}
    jobs = running.server.app.service.jobs
    stop_jobs = jobs.stop

    async def spy(grace_s: float) -> None:
        budgets.append(grace_s)
        async with grpc.aio.insecure_channel(running.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", LIVENESS_SERVICE):
                request = health_pb2.HealthCheckRequest(service=service)
                draining[service] = (await health.Check(request, timeout=10)).status
        await stop_jobs(grace_s)

    jobs.stop = spy
    handle.stop()
    # Stopping the job backend got what was left of the one deadline, not a grace of its own.
    assert budgets and budgets[0] < grace
    # Draining: out of rotation, yet alive (a liveness probe must not restart it mid-drain).
    assert draining == {
        "": health_pb2.HealthCheckResponse.NOT_SERVING,
        LIVENESS_SERVICE: health_pb2.HealthCheckResponse.SERVING,
    }
    # The watch still open at the final stop ends UNAVAILABLE (retryable), not CANCELLED.
    with pytest.raises(grpc.RpcError) as err:
        for _ in watch:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sigterm_while_the_model_loads_ends_the_process(
    random_bert_dir: Path, tmp_path: Path
) -> None:
    """Loading can take minutes (the demo build, a lexicon table for a large model): a
    SIGTERM meanwhile waited for the load to end, past any grace period (the kubelet then
    kills the pod). Here the load waits on the lexicon table's build lock, held by this test
    (as by another process building it), so it never ends by itself."""
    from limelight.locks import IN_USE_SUFFIX, file_lock
    from limelight.models.fingerprint import fingerprint

    cache = tmp_path / "cache"
    log = tmp_path / "serve.log"
    env = {
        **os.environ,
        "LIMELIGHT_CACHE_DIR": str(cache),
        "LIMELIGHT_LEXICON_BUILD": "true",
        "LIMELIGHT_DEFAULT_METHOD": "auto",  # the table is built for it (the suite's is not)
        "LIMELIGHT_GRACE_PERIOD_S": "5",
    }
    lexicons = cache / "lexicons"
    with file_lock(lexicons / f".{fingerprint(random_bert_dir)}.lock"):
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "limelight.cli.main", "serve", "--model",
                 str(random_bert_dir), "--port", "0", "--metrics-port", "0", "--jobs", "off"],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            # The model is loaded once it marks its cache folders in use; then the load goes
            # on to the lexicon table and waits on the lock.
            while not (lexicons / f".{fingerprint(random_bert_dir)}{IN_USE_SUFFIX}").exists():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the sidecar never loaded its model"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            # Generous: a hang, not a duration, is what fails here.
            assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    text = log.read_text()
    assert "stopping while the model is still loading" in text and "SERVING" not in text
