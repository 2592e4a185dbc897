"""The out-of-process load generator of `limelight bench` against a sidecar with two worker
processes: calls spread over channels, server CPU counted over the whole process tree."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from limelight.api.server_process import ServerProcess, start_server_process
from limelight.evaluation.benchmark import process_cpu_seconds, process_tree_cpu_seconds, run_load


@pytest.fixture(scope="module")
def two_workers(bert_tiny_dir: Path) -> Iterator[ServerProcess]:
    server = start_server_process({"model_dir": bert_tiny_dir, "workers": 2})
    yield server
    server.stop()


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_tree_cpu_counts_the_workers(two_workers: ServerProcess) -> None:
    workers = children(two_workers.pid)
    assert len(workers) == 2
    parts = sum(process_cpu_seconds(pid) for pid in [two_workers.pid, *workers])
    tree = process_tree_cpu_seconds(two_workers.pid)
    # Read a moment later, the tree cannot have used less than its parts; the workers loaded a
    # model each, so it is well above the supervisor's own time.
    assert tree >= parts > process_cpu_seconds(two_workers.pid)


def test_load_over_several_channels(two_workers: ServerProcess) -> None:
    texts = {"short": ["a gorgeous, witty film", "flat and tedious", "a fine cast"]}
    load = run_load(two_workers.target, texts, {"short": 8}, 1.5, 0.5, two_workers.pid, channels=8)
    assert load.errors == 0 and load.count("short") > 0
    assert load.server_cpu_s > 0
