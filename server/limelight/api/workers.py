"""Several sidecar processes on one port: ``limelight serve --workers N``.

One Python process serves gRPC from one event loop, so with a cheap forward pass (a small model,
a GPU) the per-request Python work of that one thread is the ceiling, whatever the cores. The
supervisor here starts N complete sidecars (gRPC, batcher, inference thread, their own copy of
the model), which bind the same gRPC port with ``SO_REUSEPORT``; the kernel hands each new
client connection to one of them. A gRPC channel is one connection and stays on its worker, so
traffic spreads over the workers only across connections (several clients, or a client with
several channels). Each worker names itself in ``GetModel`` (``instance``, with ``workers``),
so that a client can tell where its connections landed and spread them (the SDK does).

Shared between the workers: the gRPC port and the HTTP port (the kernel spreads HTTP
connections the same way); the metrics (Prometheus multiprocess mode in a private directory:
``/metrics`` on any worker adds up every worker's); the job queue, which must therefore be Redis
(or off). Not shared: each worker's
micro-batches and its drift monitor (drift gauges carry a ``pid`` label).

The supervisor builds or finds the model once, before any worker starts (N workers must not
build the demo model side by side); restarts a worker that dies, at any time (while the others
still load too), that is not serving ``worker_start_timeout_s`` after it started, or whose
event loop has shown no sign of life (a heartbeat on its ready file) for
``worker_unresponsive_s``, giving up when one fails to start three times in a row, or at once
when a worker refuses its settings (exit status 2: another start would refuse them too); on
SIGTERM or SIGINT
passes the signal on and waits for every worker's own graceful drain; and passes SIGHUP on (each
worker looks beside the model for a new head, table or graph at once). It reports SERVING once
every worker is; the port serves from the first worker that is (each binds once loaded).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import multiprocess

from limelight.errors import InvalidArgument, Unavailable
from limelight.settings import Settings, job_backend_kind
from limelight.signals import child_env, on_signals

log = logging.getLogger(__name__)

#: A worker that dies this soon after it started counts as a failed start.
FAILED_START_S = 60.0
#: Failed starts in a row after which the supervisor gives up.
MAX_FAILED_STARTS = 3
#: A worker's exit status when it refused its settings (the CLI's usage-error status).
EXIT_REFUSED = 2


def heartbeat_interval(settings: Settings) -> float:
    """How often a serving worker touches its ready file: often enough that a few missed beats
    (a busy machine) stay well inside ``worker_unresponsive_s``."""
    return min(5.0, settings.worker_unresponsive_s / 6)


def check_workers(settings: Settings) -> None:
    """Refuse settings that several workers cannot share."""
    if settings.workers > 1 and job_backend_kind(settings.jobs) == "sqlite":
        raise InvalidArgument(
            f"--workers {settings.workers} needs --jobs off or --jobs redis://HOST:PORT/DB: the "
            "embedded SQLite job backend runs in one process"
        )


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen[bytes]
    ready_file: Path
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    killed_late: bool = False
    """Killed for not serving in time (``worker_start_timeout_s``) or for no longer answering
    (``worker_unresponsive_s``); not yet reaped."""
    beat: float = 0.0
    """The ready file's last modification time seen (the worker's heartbeat) ..."""
    beat_seen: float = 0.0
    """... and when the supervisor first saw it (its own monotonic clock: a wall-clock step
    must not read as a silent worker)."""
    reload_owed: bool = False
    """A SIGHUP came while it was starting: passed on once it serves."""


class Supervisor:
    """Runs ``settings.workers`` sidecar processes on one port until SIGTERM or SIGINT."""

    def __init__(self, settings: Settings, on_ready: Callable[[int], None] | None = None) -> None:
        """``on_ready(port)`` is called once, when every worker is first SERVING."""
        check_workers(settings)
        self.settings = settings
        self._on_ready = on_ready
        self._stop = threading.Event()
        self._workers: dict[int, _Worker] = {}
        self._failed_starts = 0
        self._generation = 0
        self._run_dir = Path()
        self.port = settings.port

    @property
    def metrics_dir(self) -> Path:
        return self._run_dir / "metrics"

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers.values()]

    def request_stop(self) -> None:
        self._stop.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        if sig == signal.SIGHUP:
            self.pass_reload_on()
        else:
            self.request_stop()

    def pass_reload_on(self) -> None:
        """SIGHUP: every serving worker checks the files beside the model now. One still
        starting gets it once it serves: it may not handle SIGHUP yet (the default action ends
        a process), and it may have read the files before they changed."""
        for worker in list(self._workers.values()):
            if worker.process.poll() is not None:
                continue
            if worker.ready:
                worker.process.send_signal(signal.SIGHUP)
            else:
                worker.reload_owed = True

    def run(self) -> int:
        """Serve until asked to stop (then 0). Raises ``Unavailable`` when a worker fails to
        start, or workers keep dying; the workers print their own errors."""
        from limelight.app import resolve_model_dir

        # Handled on a thread: a handler running inside ``self._stop.wait`` must not set it.
        on_signals((signal.SIGTERM, signal.SIGINT, signal.SIGHUP), self._on_signal, "signals")
        check_ports_free(self.settings)
        model_dir = resolve_model_dir(self.settings, serving=True)  # once, not by N workers
        remove_stale_run_dirs()
        self._run_dir = Path(tempfile.mkdtemp(prefix=run_dir_prefix(os.getpid())))
        self.metrics_dir.mkdir()
        # Each worker keeps ``workers`` (it tells clients how many share the port) but is
        # started as a plain sidecar, never as another supervisor.
        self._base = self.settings.model_copy(update={"reuse_port": True, "model_dir": model_dir})
        try:
            return self._serve()
        finally:
            self._shutdown()
            shutil.rmtree(self._run_dir, ignore_errors=True)

    def _serve(self) -> int:
        # The first worker binds first: with port 0 it picks the port the others then share.
        self._spawn(0)
        serving = False
        # One loop from the first spawn on: a worker that dies while others still load (an OOM
        # kill as N copies of the model load side by side) is restarted at once, under the
        # same failed-start count as later, instead of once every other worker is ready.
        while not self._stop.wait(0.2 if serving else 0.05):
            for worker in list(self._workers.values()):
                self._check(worker)
            # Also once serving: a worker restarted then may hang while it loads.
            self._check_started_in_time()
            self._check_answering()
            if serving:
                continue
            if len(self._workers) < self.settings.workers:
                first = self._workers[0]
                if first.ready:
                    self.port = int(first.ready_file.read_text())
                    self._base = self._base.model_copy(update={"port": self.port})
                    for index in range(1, self.settings.workers):
                        self._spawn(index)
            elif all(w.ready for w in self._workers.values()):
                serving = True
                log.info(
                    "SERVING on %s:%d with %d worker processes (pids %s)",
                    self.settings.host,
                    self.port,
                    len(self._workers),
                    ", ".join(map(str, self.worker_pids())),
                )
                if self._on_ready is not None:
                    self._on_ready(self.port)
        return 0

    def _spawn(self, index: int) -> _Worker:
        self._generation += 1
        settings_file = self._run_dir / f"settings-{index}.json"
        # A file, not argv: the settings may hold a bearer token, and argv is world-readable.
        # Only what was set (flags, environment): the worker's defaults are the same, and a
        # field written out would read there as set by the user (warnings about settings that
        # do not apply to the model, say).
        settings_file.write_text(self._base.model_dump_json(exclude_unset=True))
        settings_file.chmod(0o600)
        ready_file = self._run_dir / f"ready-{index}-{self._generation}"
        env = {**child_env(), "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)}
        code = "from limelight.cli.serve import worker_main; worker_main()"
        argv = [sys.executable, "-c", code, str(settings_file), str(ready_file), str(index)]
        worker = _Worker(index, subprocess.Popen(argv, env=env), ready_file)
        self._workers[index] = worker
        log.info("worker %d started (pid %d)", index, worker.process.pid)
        return worker

    def _check_started_in_time(self) -> None:
        """Kill a worker that has not reported SERVING within ``worker_start_timeout_s`` of its
        own start (a restarted one gets the whole time again): ``_check`` then counts a failed
        start and starts it anew."""
        limit = self.settings.worker_start_timeout_s
        now = time.monotonic()
        for w in self._workers.values():
            if not w.ready and not w.killed_late and now - w.started > limit:
                log.error(
                    "worker %d (pid %d) was not serving %g s after it started; killing it",
                    w.index,
                    w.process.pid,
                    limit,
                )
                w.killed_late = True
                w.process.kill()

    def _check_answering(self) -> None:
        """Kill a serving worker whose heartbeat stopped for ``worker_unresponsive_s``: frozen,
        it would keep taking the connections the kernel hands it and answer none. ``_check``
        then starts it anew."""
        limit = self.settings.worker_unresponsive_s
        now = time.monotonic()
        for w in self._workers.values():
            if not w.ready or w.killed_late:
                continue
            try:
                beat = w.ready_file.stat().st_mtime
            except OSError:
                continue  # removed with the run folder at the stop
            if beat != w.beat:
                w.beat, w.beat_seen = beat, now
            elif now - w.beat_seen > limit:
                log.error(
                    "worker %d (pid %d) has not answered for %g s; killing it",
                    w.index,
                    w.process.pid,
                    limit,
                )
                w.killed_late = True
                w.process.kill()

    def _check(self, worker: _Worker) -> None:
        """Restart ``worker`` if it died; raise when restarts keep failing."""
        if not worker.ready and worker.ready_file.exists():
            worker.ready = True
            self._failed_starts = 0
            log.info("worker %d (pid %d) is serving", worker.index, worker.process.pid)
            if worker.reload_owed and worker.process.poll() is None:
                worker.process.send_signal(signal.SIGHUP)
        code = worker.process.poll()
        if code is None:
            return
        multiprocess.mark_process_dead(worker.process.pid, str(self.metrics_dir))
        if not worker.ready and code == EXIT_REFUSED:
            # Its settings or model were refused (the worker printed why): every start would be.
            raise InvalidArgument(refusal(worker.ready_file, worker.index))
        if not worker.ready or time.monotonic() - worker.started < FAILED_START_S:
            self._failed_starts += 1
        log.error("worker %d (pid %d) exited with %s", worker.index, worker.process.pid, code)
        if self._failed_starts >= MAX_FAILED_STARTS:
            raise Unavailable(f"{self._failed_starts} worker starts failed in a row; stopping")
        self._spawn(worker.index)

    def _shutdown(self) -> None:
        alive = [w for w in self._workers.values() if w.process.poll() is None]
        for w in alive:
            w.process.send_signal(signal.SIGTERM)  # each worker drains on its own
        end = time.monotonic() + self.settings.grace_period_s + 10.0
        for w in alive:
            try:
                w.process.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker %d did not stop in time; killing it", w.index)
                w.process.kill()
                w.process.wait()


def refusal_file(ready_file: Path) -> Path:
    """Where a worker that refused its settings leaves its one-line reason for the supervisor."""
    return ready_file.with_name(ready_file.name + ".refused")


def refusal(ready_file: Path, index: int) -> str:
    """The reason worker ``index`` gave for refusing its settings, as the supervisor's error."""
    try:
        return refusal_file(ready_file).read_text().strip()
    except OSError:
        return f"worker {index} refused its settings (its error is above)"


#: A supervisor's run folder (workers' settings, ready files, metrics) in the temp folder:
#: ``limelight-workers-<supervisor pid>-<its start time>-<random>``.
RUN_DIR_PREFIX = "limelight-workers-"


def run_dir_prefix(pid: int) -> str:
    """The start of the run folder's name of supervisor ``pid``. The start time tells a
    restarted container's supervisor from the one before it: both are PID 1, and the memory-
    backed temp folder outlives the restart."""
    return f"{RUN_DIR_PREFIX}{pid}-{_start_time(pid) or 0}-"


def remove_stale_run_dirs(temp: Path | None = None) -> list[Path]:
    """Remove the run folders of supervisors that are gone: one killed outright (SIGKILL, an
    OOM kill) had no chance to, and each left its workers' metrics files behind."""
    removed = []
    for folder in Path(temp or tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*-*"):
        pid, _, rest = folder.name.removeprefix(RUN_DIR_PREFIX).partition("-")
        if not pid.isdigit():
            continue
        started, _, random = rest.partition("-")
        if _alive(int(pid)):
            # Alive: the same process only if it started when the name says (a name without
            # a start time comes from an older version, which cannot say).
            if not random or not started.isdigit() or int(started) == 0:
                continue
            if _start_time(int(pid)) in (None, int(started)):
                continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count after its end.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])  # field 22, the start time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def check_ports_free(settings: Settings) -> None:
    """Refuse ports another process listens on. The workers bind with ``SO_REUSEPORT``, which
    lets a second supervisor's workers join a port the first one's hold: the kernel then
    splits the traffic, and the scrapes, between two unrelated sidecars without a word. A
    bind without it (``SO_REUSEADDR`` only, which a port just closed does not block) fails
    where anyone listens."""
    for name, port in (
        ("port", settings.port),
        ("metrics port", settings.metrics_port),
        ("health port", settings.health_port),
    ):
        if not port:  # 0: the first worker picks one (gRPC), or none is served
            continue
        try:
            found = socket.getaddrinfo(
                settings.host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except socket.gaierror:
            continue  # the workers' own bind reports an address that does not resolve
        family, kind, proto, _, address = found[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    continue  # not ours to judge (an address not on this host, …)
                raise Unavailable(
                    f"cannot listen on {settings.host}:{port} (the {name}): another process "
                    "listens there (another sidecar?); pick another port"
                ) from None
