"""The out-of-process load generator of `limelight bench` against a sidecar with two worker
processes: calls spread over channels, server CPU counted over the whole process tree."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from limelight.api.ports import free_port
from limelight.api.server_process import ServerProcess, start_server_process
from limelight.evaluation.benchmark import process_cpu_seconds, process_tree_cpu_seconds, run_load

METRICS = free_port()
"""The sidecar's Prometheus port (the supervisor's, every worker's series merged)."""


@pytest.fixture(scope="module")
def two_workers(bert_tiny_dir: Path) -> Iterator[ServerProcess]:
    server = start_server_process(
        {"model_dir": bert_tiny_dir, "workers": 2, "metrics_port": METRICS}
    )
    yield server
    server.stop()


def calls(rpc: str) -> float:
    """Finished calls of ``rpc`` with status OK, from the sidecar's Prometheus exposition."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS}/metrics", timeout=10).read()
    for family in text_string_to_metric_families(text.decode()):
        if family.name == "limelight_request_duration_seconds":
            return sum(
                s.value
                for s in family.samples
                if s.name.endswith("_count") and s.labels == {"rpc": rpc, "code": "OK"}
            )
    return 0.0


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_tree_cpu_counts_the_workers(two_workers: ServerProcess) -> None:
    workers = children(two_workers.pid)
    assert len(workers) == 2
    parts = sum(process_cpu_seconds(pid) for pid in [two_workers.pid, *workers])
    tree = process_tree_cpu_seconds(two_workers.pid)
    # Read a moment later, the tree cannot have used less than its parts (up to the float
    # rounding of summing clock ticks in another order); the workers loaded a model each, so
    # it is well above the supervisor's own time.
    assert tree >= parts - 1e-9 and parts > process_cpu_seconds(two_workers.pid)


def test_load_over_several_channels(two_workers: ServerProcess) -> None:
    texts = {"short": ["a gorgeous, witty film", "flat and tedious", "a fine cast"]}
    load = run_load(two_workers.target, texts, {"short": 8}, 1.5, 0.5, two_workers.pid, channels=8)
    assert load.errors == 0 and load.count("short") > 0
    assert load.server_cpu_s > 0
    assert load.placement == "4+4"  # spread evenly over the two workers (by GetModel)
    as_placed = run_load(
        two_workers.target, texts, {"short": 2}, 0.5, 0.2, two_workers.pid, channels=3, spread=False
    )
    assert as_placed.errors == 0 and sum(map(int, as_placed.placement.split("+"))) == 3


def test_stream_load_keeps_one_stream_per_client(two_workers: ServerProcess) -> None:
    texts = {"short": ["a gorgeous, witty film", "flat and tedious", "a fine cast"]}
    unary, streams = calls("Explain"), calls("ExplainStream")
    load = run_load(
        two_workers.target, texts, {"short": 6}, 1.5, 0.5, two_workers.pid, channels=4, rpc="stream"
    )
    assert load.errors == 0 and load.count("short") > 6
    assert load.tokens["short"] > 0
    # Each client sent all its requests down one stream and closed it cleanly; the only unary
    # calls are the load generator's warm-up, one per channel.
    assert calls("ExplainStream") - streams == 6
    assert calls("Explain") - unary == 4


def test_batch_load_sends_several_texts_per_call(two_workers: ServerProcess) -> None:
    texts = {"short": ["a gorgeous, witty film", "flat and tedious", "a fine cast"]}
    batches, streams = calls("ExplainBatch"), calls("ExplainStream")
    load = run_load(
        two_workers.target,
        texts,
        {"short": 3},
        1.5,
        0.5,
        two_workers.pid,
        channels=2,
        rpc="batch",
        texts_per_call=5,
    )
    assert load.errors == 0 and load.tokens["short"] > 0
    # Every text of a call counts as a request, answered together: counts come in fives.
    assert load.count("short") >= 5 and load.count("short") % 5 == 0
    calls_made = calls("ExplainBatch") - batches
    assert calls_made >= load.count("short") // 5
    assert calls("ExplainStream") == streams


def test_http_load_posts_kserve_explain_on_one_connection_per_client(
    two_workers: ServerProcess,
) -> None:
    texts = {"short": ["a gorgeous, witty film", "flat and tedious", "a fine cast"]}
    explained, unary = calls("v1.explain"), calls("Explain")
    load = run_load(
        f"127.0.0.1:{METRICS}", texts, {"short": 5}, 1.5, 0.5, two_workers.pid, rpc="http"
    )
    assert load.errors == 0 and load.count("short") > 5 and load.tokens["short"] > 0
    assert load.server_cpu_s > 0 and load.placement == ""
    # Every request went over HTTP (five warm-up calls, then the measured and the unmeasured
    # ones at the window's edges); none over gRPC.
    assert calls("v1.explain") - explained >= 5 + load.count("short")
    assert calls("Explain") == unary


def test_an_unknown_rpc_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown rpc"):
        run_load("127.0.0.1:1", {"short": ["x"]}, {"short": 1}, 0.1, rpc="bidi")


@pytest.mark.parametrize("rpc", ["unary", "stream"])
def test_a_sidecar_that_goes_away_is_not_hammered_by_retries(bert_tiny_dir: Path, rpc: str) -> None:
    """Each failed call used to be retried at once: thousands of errors a second against a
    sidecar that went away mid-run (14,215 in 4 s), counted outside the window too. Now a
    client pauses after each failure: at most one failed call per pause in the window."""
    import threading

    from limelight.evaluation.benchmark import FAILURE_PAUSE_S

    server = start_server_process({"model_dir": bert_tiny_dir})
    killer = threading.Timer(1.0, server.process.kill)  # inside the window: after the warm-up
    killer.start()
    try:
        result = run_load(
            server.target, {"short": ["a text"]}, {"short": 2}, 2.0, warmup_s=0.5, rpc=rpc
        )
    finally:
        killer.cancel()
        server.stop()
    assert result.errors > 0
    assert result.errors <= 2 * (2.0 / FAILURE_PAUSE_S + 1), result.errors


def test_a_sidecar_that_is_down_at_the_start_is_one_clear_line() -> None:
    with pytest.raises(RuntimeError) as failed:
        run_load(f"127.0.0.1:{free_port()}", {"short": ["a"]}, {"short": 1}, 1.0, warmup_s=0)
    assert str(failed.value).startswith("the load generator failed: UNAVAILABLE: failed to conn")
