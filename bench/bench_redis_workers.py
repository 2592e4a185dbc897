"""Jobs per second of the Redis worker pool with 1 and 2 `limelight worker` processes.

    .venv/bin/python bench/bench_redis_workers.py [--demo bert-tiny] [--jobs 48] [--method M]

Starts a real redis-server on a free loopback port, enqueues the same jobs through the
sidecar-side backend, and times how fast the pool drains them. Baseline, same run: the same
jobs run one after another in this process with JobRunner.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from limelight.core.jobs import JobSpec, JobState
from limelight.demo.build import ensure_demo_model
from limelight.demo.datasets import rotten_tomatoes
from limelight.evaluation.benchmark import machine, markdown_table
from limelight.jobs.redis_backend import RedisJobBackend
from limelight.jobs.runner import JobRunner
from limelight.methods.base import MethodRegistry
from limelight.models.loaded import load_model
from limelight.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def drain(url: str, model_dir: Path, specs: list[JobSpec], workers: int) -> float:
    settings = Settings(jobs=url, model_dir=model_dir)
    backend = RedisJobBackend(settings)
    await backend.start()
    env = {**os.environ, "LIMELIGHT_TORCH_THREADS": "1"}
    pool = subprocess.Popen(
        [sys.executable, "-m", "limelight.cli.main", "worker", "--jobs", url,
         "--model", str(model_dir), "--workers", str(workers)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        # Wait until the workers are up: one warm-up job.
        warm = await backend.submit(specs[0])
        while not (await backend.get(warm.id)).state.terminal:
            await asyncio.sleep(0.05)
        start = time.perf_counter()
        ids = [(await backend.submit(s)).id for s in specs]
        pending = set(ids)
        while pending:
            for job_id in list(pending):
                if (await backend.get(job_id)).state.terminal:
                    pending.discard(job_id)
            await asyncio.sleep(0.02)
        elapsed = time.perf_counter() - start
        states = {(await backend.get(i)).state for i in ids}
        assert states == {JobState.SUCCEEDED}, states
        return len(ids) / elapsed
    finally:
        pool.terminate()
        pool.wait(60)
        await backend.stop(1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--demo", default="bert-tiny", choices=["bert-tiny", "minilm"])
    parser.add_argument("--jobs", type=int, default=48)
    parser.add_argument("--method", default="grad_x_input")
    args = parser.parse_args()
    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    texts = [e.text for e in rotten_tomatoes("test")[: args.jobs]]
    # Distinct idempotency keys per run so nothing is deduplicated.
    stamp = str(time.time())
    rows: list[list[object]] = []
    model = load_model(model_dir)
    runner = JobRunner(model, MethodRegistry.load(Settings(jobs="off")), Settings(jobs="off"))
    start = time.perf_counter()
    for text in texts:
        runner.run(JobSpec(method=args.method, text=text))
    rows.append(["in-process JobRunner (baseline)", len(texts) / (time.perf_counter() - start)])
    workdir = Path(tempfile.mkdtemp(prefix="limelight-redis-bench-"))
    port = free_port()
    redis = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--save", "",
         "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(0.5)
        for workers in (1, 2):
            specs = [
                JobSpec(method=args.method, text=t, idempotency_key=f"{stamp}-{workers}-{i}")
                for i, t in enumerate(texts)
            ]
            url = f"redis://127.0.0.1:{port}/0"
            rate = asyncio.run(drain(url, model_dir, specs, workers))
            rows.append([f"redis pool, {workers} worker process(es)", rate])
    finally:
        redis.terminate()
        redis.wait(10)
    base = float(rows[0][1])  # type: ignore[arg-type]
    print(f"model: {model_dir.name}, method: {args.method}, {len(texts)} jobs")
    print(f"machine: {machine()}\n")
    print(
        markdown_table(
            ["runner", "jobs/s", "vs baseline"], [[*r, float(r[1]) / base] for r in rows]
        )
    )  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
