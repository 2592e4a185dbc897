"""`limelight worker`: run Redis job workers in their own processes (e.g. on GPU nodes)."""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from limelight.cli.common import add_model_args, settings_from_args, setup_logging, whole
from limelight.errors import InvalidArgument
from limelight.settings import Settings, job_backend_kind
from limelight.signals import on_signals

log = logging.getLogger("limelight.worker")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "worker",
        help="run job workers that consume a Redis job queue",
        description="Start N worker processes that take explanation jobs from the Redis queue "
        "the sidecars enqueue to (`limelight serve --jobs redis://…`). A worker that dies has "
        "its job reclaimed by another one; SIGTERM lets running jobs finish (within the grace "
        "period) and hands unfinished ones back to the queue.",
    )
    add_model_args(p)
    p.add_argument("--jobs", help="queue address redis://host:port/db (or $LIMELIGHT_JOBS)")
    p.add_argument(
        "--jobs-password-file",
        type=Path,
        help="Redis password, read at each new connection (a mounted Secret: rotates without a "
        "restart)",
    )
    p.add_argument(
        "--jobs-queue",
        metavar="NAME",
        help="Redis queue name, the prefix of its keys (default limelight): one per model "
        "sharing a Redis database",
    )
    p.add_argument(
        "--workers",
        dest="job_processes",  # not Settings.workers: that one counts sidecar processes
        type=whole(1),
        help="worker processes (default: job_workers)",
    )
    p.add_argument("--lm-head", dest="lm_head_dir", type=Path, help="masked-LM head directory")
    p.add_argument("--head-mask", dest="head_mask_path", type=Path, help="LRP head mask file")
    p.add_argument("--max-tokens", type=int, help="token limit per input")
    p.add_argument(
        "--truncation",
        choices=["truncate", "reject", "window"],
        help="over-long input policy (window: the method runs on every window)",
    )
    p.add_argument("--grace-period-s", type=float, help="SIGTERM: time to finish a running job")
    p.add_argument(
        "--reclaim-idle-s",
        dest="job_reclaim_idle_s",
        type=float,
        help="take over jobs of workers silent this long (default 30)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus port of worker 0; worker i uses port+i (default 0: off)",
    )
    p.add_argument(
        "--method",
        dest="extra_methods",
        action="append",
        default=[],
        metavar="MODULE:CLASS",
        help="register an extra JobMethod class (repeatable)",
    )
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    p.set_defaults(func=run)


def _child(settings: Settings, extra_methods: list[str], metrics_port: int, parent: int) -> None:
    """One worker process: load the model, consume until SIGTERM (sent to itself when the
    ``parent`` that started it is gone: killed outright, it could not stop its children)."""
    setup_logging(settings.log_level)
    from limelight.signals import watch_parent

    watch_parent(parent)
    from limelight import tracing
    from limelight.app import load_served_model
    from limelight.jobs.redis_worker import RedisWorker
    from limelight.jobs.runner import JobRunner
    from limelight.methods.base import MethodRegistry
    from limelight.metrics import JobMetrics

    tracing.setup_tracing()  # OTEL_* variables; off by default
    metrics = JobMetrics()  # the job series only: no model serving, drift or readiness
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, registry=metrics.registry)
    # Applies settings.torch_threads: with N workers on C cores, about C / N each.
    model = load_served_model(settings, progress=False)
    runner = JobRunner(model, MethodRegistry.load(settings, plugins=extra_methods), settings)
    worker = RedisWorker(settings, runner, metrics)

    def on_term(sig: signal.Signals) -> None:
        if worker._stop.is_set():  # second signal: hand the job back now
            worker.abandon()
            return
        log.info("worker %s: stopping after the current job", worker.name)
        worker.request_stop()
        timer = threading.Timer(settings.grace_period_s, worker.abandon)
        timer.daemon = True
        timer.start()

    # On a thread: a handler running inside ``worker._stop.wait`` must not set it.
    on_signals((signal.SIGTERM, signal.SIGINT), on_term, "signals")
    log.info("worker %s ready (model %s, %s)", worker.name, model.name, model.version)
    try:
        worker.run()
    finally:
        tracing.shutdown_tracing()


class RestartBackoff:
    """When to start worker slot ``i`` again after its process died: at once after a worker
    that ran for a while, after 2, 4, 8, … ``max_s`` seconds while each start dies within
    ``healthy_s``."""

    def __init__(self, count: int, *, healthy_s: float = 30.0, max_s: float = 60.0) -> None:
        self.healthy_s = healthy_s
        self.max_s = max_s
        self.started_at = [time.monotonic()] * count
        self.quick_deaths = [0] * count
        self.due: list[float | None] = [None] * count
        """When a dead slot is started again; None while its process runs."""

    def died(self, i: int) -> float:
        """Note slot ``i``'s death; the delay before its restart."""
        now = time.monotonic()
        lived = now - self.started_at[i]
        self.quick_deaths[i] = self.quick_deaths[i] + 1 if lived < self.healthy_s else 0
        n = self.quick_deaths[i]
        delay = min(self.max_s, 2.0**n) if n else 0.0
        self.due[i] = now + delay
        return delay

    def ready(self, i: int) -> bool:
        due = self.due[i]
        return due is not None and time.monotonic() >= due

    def started(self, i: int) -> None:
        self.started_at[i] = time.monotonic()
        self.due[i] = None


def _check_queue(settings: Settings) -> None:
    """Raise (one clear line, no credentials) when the queue refuses this worker's credentials
    or ACL, or cannot hold the queue; an unreachable queue is fine (the workers wait for it)."""
    import redis

    from limelight.errors import FailedPrecondition, Unavailable, redact_credentials
    from limelight.jobs.redis_store import (
        CONNECTION_ERRORS,
        REFUSED_ERRORS,
        check_access,
        refusal,
    )

    where = redact_credentials(settings.jobs)
    try:
        check_access(settings)
    except REFUSED_ERRORS as exc:
        raise Unavailable(f"the job queue at {where}: {refusal(exc)}") from exc
    except CONNECTION_ERRORS as exc:
        log.warning("the job queue at %s is not reachable yet (%s); workers wait", where, exc)
    except redis.RedisError as exc:  # e.g. WRONGTYPE: the stream key holds something else
        raise FailedPrecondition(f"the job queue at {where} cannot be used: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    setup_logging(settings.log_level)
    if job_backend_kind(settings.jobs) != "redis":
        raise InvalidArgument(
            f"workers take their jobs from a Redis queue, not {settings.jobs.strip() or 'off'!r}: "
            "give --jobs redis://host:port/db or LIMELIGHT_JOBS (the embedded sqlite backend "
            "runs jobs in the sidecar's own process)"
        )
    _check_queue(settings)  # before the workers load their model
    count = max(1, args.job_processes or settings.job_workers)
    # spawn, not fork: forking a process that has touched torch threads can deadlock.
    ctx = mp.get_context("spawn")
    slots: list[Any] = [None] * count
    stopping = threading.Event()

    def start(i: int) -> None:
        port = args.metrics_port + i if args.metrics_port else 0
        proc = ctx.Process(
            target=_child,
            args=(settings, list(args.extra_methods), port, os.getpid()),
            name=f"limelight-worker-{i}",
        )
        proc.start()
        slots[i] = proc
        log.info("started worker process %d (pid %s)", i, proc.pid)

    def on_term(sig: signal.Signals) -> None:
        stopping.set()
        for proc in slots:
            if proc is not None and proc.is_alive() and proc.pid:
                os.kill(proc.pid, signal.SIGTERM)

    on_signals((signal.SIGTERM, signal.SIGINT), on_term, "signals")  # not inside stopping.wait
    for i in range(count):
        start(i)
    # Supervise: a worker that dies (OOM kill, crash inside a method) is replaced; its job is
    # reclaimed from the queue by whichever worker sees it idle first. One that keeps dying
    # soon after its start (a broken model directory) waits longer each time.
    backoff = RestartBackoff(count)
    while not stopping.is_set():
        for i, proc in enumerate(slots):
            if proc is None or proc.is_alive() or stopping.is_set():
                continue
            if backoff.due[i] is None:
                delay = backoff.died(i)
                log.warning(
                    "worker process %d (pid %s) exited with %s; %s",
                    i,
                    proc.pid,
                    proc.exitcode,
                    f"restarting it in {delay:.0f} s" if delay else "restarting it",
                )
            if backoff.ready(i):
                start(i)
                backoff.started(i)
        stopping.wait(0.2)
    for proc in slots:
        if proc is not None:
            proc.join()
    return 0
