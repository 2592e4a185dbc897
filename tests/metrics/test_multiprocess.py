"""Several sidecar processes (``--workers N``) share one /metrics: the gauges that every process
reads from the same job queue show the latest read, not the largest stale one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from limelight.metrics import Metrics

# One sidecar process's refresh of the queue gauges, as the Redis backend does it.
_REFRESH = """
import sys
from pathlib import Path
from limelight.metrics import Metrics

metrics = Metrics(multiprocess_dir=Path(sys.argv[1]))
metrics.job_queue_depth.labels(method="lrp").set(float(sys.argv[2]))
metrics.job_workers.labels(backend="redis").set(float(sys.argv[3]))
"""


def _refresh(folder: Path, depth: int, workers: int) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    argv = [sys.executable, "-c", _REFRESH, str(folder), str(depth), str(workers)]
    subprocess.run(argv, env=env, check=True, timeout=120)


def test_queue_gauges_show_the_latest_read_of_any_process(tmp_path: Path) -> None:
    # Process 1 saw 7 queued jobs and 2 workers; process 2 read the queue after they ran.
    _refresh(tmp_path, depth=7, workers=2)
    _refresh(tmp_path, depth=0, workers=1)
    exposition = Metrics(CollectorRegistry(), multiprocess_dir=tmp_path).exposition().decode()
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(exposition)
        for s in f.samples
    }
    assert values[("limelight_job_queue_depth", (("method", "lrp"),))] == 0.0
    assert values[("limelight_job_workers", (("backend", "redis"),))] == 1.0
