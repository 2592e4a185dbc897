"""The embedded job backend: an SQLite journal (WAL) and in-process worker threads.

Every state change is committed before it is acted on, so a crash or ``kill -9`` loses nothing:
on the next ``start()`` RUNNING jobs of the dead process go back to QUEUED (their attempt count
kept; after ``job_max_attempts`` interrupted runs a job is FAILED instead, so a job that kills the
process cannot crash-loop it) and every QUEUED job runs in submission order. Finished jobs stay
readable until their ``expires_at`` (result TTL); then they are purged and reads answer NotFound.

CPU: jobs run on ``settings.job_workers`` threads (default 1). Torch's intra-op pool is shared
with the inline path, so the worker count bounds how many job forward/backward passes compete
with inline traffic at once; in addition every checkpoint of a job method waits (bounded) for
the ``InlineGate`` to be idle, so inline micro-batches run first. The journal is owned by one
process: point two sidecars at two files (or use the Redis backend to share a queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from limelight.core.jobs import JobBackend, JobCursor, JobRecord, JobSpec, JobState, scoped_key
from limelight.errors import DataLoss, NotFound, ResourceExhausted, Unavailable
from limelight.jobs.execution import (
    JobHooks,
    Outcome,
    StopReason,
    execute,
    not_found,
    queue_full,
    reuse,
    watch_changes,
)
from limelight.jobs.priority import InlineGate
from limelight.jobs.runner import JobRunner
from limelight.jobs.serialize import explanation_from_dict, spec_from_dict, spec_to_dict
from limelight.metrics import Metrics
from limelight.settings import Settings

log = logging.getLogger(__name__)

#: While the job store's disk is full, how often that is logged.
FULL_LOG_S = 30.0
#: Longest pause between a worker's tries to write a job's outcome to a full or busy store.
WRITE_RETRY_MAX_S = 5.0
#: A journal that could not be opened for want of disk space at start is tried again this often.
OPEN_RETRY_S = 5.0
#: Below this much free space, an I/O error opening the journal is taken for a full disk
#: (SQLite reports a shared-memory file it cannot grow as SQLITE_IOERR_SHMSIZE, not FULL).
NO_ROOM_BYTES = 1 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    method TEXT NOT NULL,
    state TEXT NOT NULL,
    spec TEXT NOT NULL,
    result TEXT,
    error TEXT NOT NULL DEFAULT '',
    progress REAL NOT NULL DEFAULT 0,
    message TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    idempotency_key TEXT UNIQUE,
    expires_at REAL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq);
CREATE INDEX IF NOT EXISTS jobs_expiry ON jobs(expires_at);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs(created_at, id);
"""

_COLUMNS = (
    "id, state, spec, result, error, progress, message, created_at, started_at, finished_at, "
    "attempts"
)


def _store_error(exc: sqlite3.OperationalError) -> Exception:
    """A full disk and a busy database as errors a client can act on (others unchanged)."""
    name = getattr(exc, "sqlite_errorname", "")
    if name == "SQLITE_FULL":
        return ResourceExhausted("the job store is full (no room left on its disk); retry later")
    if name in ("SQLITE_BUSY", "SQLITE_LOCKED"):
        return Unavailable("the job store is busy; retry later")
    return exc


def _no_room(exc: BaseException, directory: Path) -> bool:
    """Whether ``exc``, met opening or recovering the journal, says its disk is full."""
    if isinstance(exc, ResourceExhausted):  # SQLITE_FULL, mapped by _tx
        return True
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    name = getattr(exc, "sqlite_errorname", "")
    if name == "SQLITE_FULL":
        return True
    if not name.startswith("SQLITE_IOERR"):
        return False
    try:
        stats = os.statvfs(directory)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < NO_ROOM_BYTES


def _unreplaced_error() -> DataLoss:
    return DataLoss(
        "the job store is damaged and no new one can be opened in its place (the jobs it held "
        "are lost); the sidecar's operator must see to its disk"
    )


def _is_corrupt(exc: sqlite3.DatabaseError) -> bool:
    """SQLite's verdict on a file that is not, or no longer, a readable database."""
    name = getattr(exc, "sqlite_errorname", "")  # Python 3.11+
    if name in ("SQLITE_NOTADB", "SQLITE_CORRUPT"):
        return True
    text = str(exc)
    return "file is not a database" in text or "database disk image is malformed" in text


@dataclass
class _Control:
    """Set when a client cancels a running job; read by its worker thread at checkpoints."""

    cancelled: bool = False


class SqliteJobBackend(JobBackend):
    """Embedded, journalled job backend. ``runner=None`` opens the journal without workers."""

    def __init__(
        self,
        settings: Settings,
        runner: JobRunner | None,
        metrics: Metrics | None = None,
        gate: InlineGate | None = None,
        *,
        yield_timeout_s: float = 1.0,
        idle_poll_s: float = 1.0,
        open_retry_s: float = OPEN_RETRY_S,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.metrics = metrics
        self.gate = gate
        self.path = settings.resolved_jobs_db()
        self._yield_timeout_s = yield_timeout_s
        """Longest a job waits for inline traffic at one checkpoint (no starvation)."""
        self._idle_poll_s = idle_poll_s
        self._open_retry_s = open_retry_s
        # Set while the journal waits for room on its disk to open (a start on a full disk).
        self._waiting_for_room: threading.Thread | None = None
        self._db: sqlite3.Connection | None = None
        # Set while a damaged journal was moved aside and none could be opened in its place.
        self._unreplaced = False
        self._replaced_at: float | None = None
        """When a journal found damaged while served was last replaced (Unix time)."""
        self._lock = threading.RLock()
        self._work = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._running: dict[str, _Control] = {}
        self._stopping = threading.Event()
        self._abandon = threading.Event()
        self._watch_lock = threading.Lock()
        self._watchers: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._depth_methods: set[str] = set()
        self._full_logged = -FULL_LOG_S

    def describe(self) -> str:
        threads = max(1, self.settings.job_workers)
        return (
            f"journalled in SQLite at {self.settings.resolved_jobs_db()}, run here on {threads} "
            f"thread{'s' if threads > 1 else ''}"
        )

    # --- storage -------------------------------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._db is None and self._unreplaced:
                self._open_replacement()
            if self._db is None:
                if self._waiting_for_room is not None:
                    raise ResourceExhausted(
                        "the job store cannot be opened (no room left on its disk); retry later"
                    )
                raise Unavailable("job store is not open")
            db = self._db
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    changes = db.total_changes
                    yield db
                    db.execute("COMMIT")
                    if db.total_changes != changes:  # a write went through: room on the disk
                        self._queue_up(True)
                except BaseException:
                    if db.in_transaction:  # SQLite may have rolled back already (a full disk)
                        db.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as exc:
                error = _store_error(exc)
                if error is exc:
                    raise
                if isinstance(error, ResourceExhausted):
                    self._log_full(exc)
                raise error from exc
            except sqlite3.DatabaseError as exc:
                if not _is_corrupt(exc):
                    raise
                raise self._damaged(exc) from exc

    def _queue_up(self, up: bool) -> None:
        if self.metrics is not None:
            self.metrics.job_queue_up.labels(backend="sqlite").set(1 if up else 0)

    def _log_full(self, exc: BaseException) -> None:
        """One error line per ``FULL_LOG_S`` while the disk is full (every write fails alike)."""
        self._queue_up(False)
        now = time.monotonic()
        if now - self._full_logged >= FULL_LOG_S:
            self._full_logged = now
            log.error("the job store %s cannot be written: %s", self.path, exc)

    def _damaged(self, exc: sqlite3.DatabaseError) -> DataLoss:
        """The journal went bad while open (a disk fault, a file overwritten under the
        sidecar): it is moved aside and an empty one opened in its place, as a start does with
        a journal it cannot read, so that jobs run again without a restart. The call that found
        it fails ``DATA_LOSS``. When no new journal can be opened either, job calls fail so,
        each trying again, until one can. Called holding ``_lock``."""
        try:
            aside = self._replace_damaged()
        except Exception as reopen_exc:
            self._queue_up(False)
            self._unreplaced = True
            log.error(
                "the job journal %s is damaged (%s) and no new journal can be opened in its "
                "place (%s): job calls fail DATA_LOSS, each trying again",
                self.path,
                exc,
                reopen_exc,
            )
            return _unreplaced_error()
        log.error(
            "the job journal %s went bad while served (%s): moved aside to %s (try `sqlite3 %s "
            ".recover`); an empty journal takes jobs from now on, the jobs it held are lost",
            self.path,
            exc,
            aside,
            aside,
        )
        return DataLoss(
            "the job store was found damaged and replaced by an empty one: the jobs it held "
            "are lost; submit them again"
        )

    def _open_replacement(self) -> None:
        """Try again to open a journal in the damaged one's place; DATA_LOSS while it fails."""
        try:
            self._db = self._connect()
        except Exception:
            raise _unreplaced_error() from None
        self._unreplaced = False
        self._queue_up(True)
        log.info("a new job journal is open at %s: taking jobs again", self.path)

    def _replace_damaged(self) -> Path:
        damaged, self._db = self._db, None
        if damaged is not None:
            with contextlib.suppress(sqlite3.Error):
                damaged.close()
        aside = self._move_aside()
        self._db = self._connect()
        self._replaced_at = time.time()
        self._queue_up(True)
        self._refresh_depth()  # what the damaged journal held is gone
        return aside

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = self._connect()
        except sqlite3.DatabaseError as exc:
            if not _is_corrupt(exc):
                raise
            # A journal SQLite cannot read (a disk fault, a partial copy) must not keep the
            # sidecar, and the classifier in its pod, down: keep it for recovery, start afresh.
            aside = self._move_aside()
            log.error(
                "the job journal %s is unreadable (%s): moved aside to %s (try `sqlite3 %s "
                ".recover`); starting an empty journal, the jobs it held are lost",
                self.path,
                exc,
                aside,
                aside,
            )
            self._db = self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            # WAL + NORMAL: a committed transaction survives a process crash (kill -9); only an
            # OS crash or power loss may drop the last commits.
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=5000")
            verdict = db.execute("PRAGMA quick_check(1)").fetchone()[0]
            if verdict != "ok":
                raise sqlite3.DatabaseError(f"database disk image is malformed: {verdict}")
            db.executescript(_SCHEMA)
            columns = {row["name"] for row in db.execute("PRAGMA table_info(jobs)")}
            if "owner" not in columns:  # a journal from before job ownership: unowned jobs
                db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
            # After the column (journals from before it have none): per-owner counts and trims.
            db.execute("CREATE INDEX IF NOT EXISTS jobs_owner ON jobs(owner, state, created_at)")
        except BaseException:
            db.close()
            raise
        return db

    def _move_aside(self) -> Path:
        """Rename the journal (and its WAL files) to ``<name>.corrupt-<UTC time>``."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():  # twice in one second: never over an earlier one
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}.{n}")
            n += 1
        for suffix in ("", "-wal", "-shm"):
            source = self.path.with_name(self.path.name + suffix)
            if source.exists():
                source.rename(aside.with_name(aside.name + suffix))
        return aside

    def _record(self, row: sqlite3.Row, with_result: bool = True) -> JobRecord:
        result = None
        if with_result and row["result"]:
            result = explanation_from_dict(json.loads(row["result"]))
        return JobRecord(
            id=row["id"],
            state=JobState(row["state"]),
            spec=spec_from_dict(json.loads(row["spec"])),
            created_at=row["created_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            progress=row["progress"],
            message=row["message"],
            attempts=row["attempts"],
            result=result,
            error=row["error"],
        )

    def _purge(self, db: sqlite3.Connection) -> None:
        db.execute(
            "DELETE FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ?", (time.time(),)
        )

    def _refresh_depth(self) -> None:
        if self.metrics is None:
            return
        with self._lock:
            if self._db is None:
                return
            try:
                rows = self._db.execute(
                    "SELECT method, COUNT(*) FROM jobs WHERE state = 'queued' GROUP BY method"
                ).fetchall()
            except sqlite3.DatabaseError as exc:
                if not _is_corrupt(exc):
                    raise
                self._damaged(exc)  # a gauge is not worth failing the call that moved it
                return
        counts = {m: n for m, n in rows}
        self._depth_methods |= set(counts)
        for method in self._depth_methods:
            self.metrics.job_queue_depth.labels(method=method).set(counts.get(method, 0))

    # --- watchers ------------------------------------------------------------------------------

    def _notify(self, job_id: str) -> None:
        """Wake every watcher of ``job_id``; safe from any thread."""
        with self._watch_lock:
            targets = list(self._watchers.get(job_id, ()))
        for loop, event in targets:
            with contextlib.suppress(RuntimeError):  # that watcher's loop is closed
                loop.call_soon_threadsafe(event.set)

    # --- JobBackend ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the journal, re-queue what a previous run left running and start the workers.
        A disk too full to open or recover the journal does not stop the sidecar: inline
        explanations do not need it, so it serves them while job calls are
        ``RESOURCE_EXHAUSTED``, and opens the journal once there is room."""
        self._stopping.clear()
        self._abandon.clear()
        try:
            await asyncio.to_thread(self._open_and_recover)
        except Exception as exc:
            if not _no_room(exc, self.path.parent):
                raise
            self._close_db()
            self._queue_up(False)
            log.error(
                "the job journal %s cannot be opened: its disk is full (%s); serving without "
                "jobs (job calls fail RESOURCE_EXHAUSTED) and trying again every %.0f s",
                self.path,
                exc,
                self._open_retry_s,
            )
            self._waiting_for_room = threading.Thread(
                target=self._open_when_room, name="limelight-jobs-open", daemon=True
            )
            self._waiting_for_room.start()
            return
        self._start_workers()

    def _open_when_room(self) -> None:
        while not self._stopping.wait(self._open_retry_s):
            try:
                self._open_and_recover()
            except Exception as exc:
                self._close_db()
                self._queue_up(False)  # it may have opened before the recovery failed
                if not _no_room(exc, self.path.parent):
                    log.exception("the job journal %s still cannot be opened", self.path)
                continue
            with self._lock:
                if self._stopping.is_set():  # stop() came meanwhile: it closes what is open
                    return
                self._waiting_for_room = None
            log.info("the job journal %s is open: taking jobs", self.path)
            self._start_workers()
            return

    def _close_db(self) -> None:
        with self._lock:
            if self._db is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._db.close()
                self._db = None

    def _open_and_recover(self) -> None:
        self._open()
        self._queue_up(True)
        now = time.time()
        with self._tx() as db:
            self._purge(db)
            cancelled = db.execute(
                "UPDATE jobs SET state='cancelled', finished_at=?, expires_at=?, "
                "message='cancelled' WHERE state='running' AND cancel_requested=1",
                (now, now + self.settings.job_result_ttl_s),
            ).rowcount
            # A job that was running each time the server died may be what kills it (e.g. an
            # OOM): after job_max_attempts it fails instead of crash-looping the sidecar.
            poisoned = db.execute(
                "UPDATE jobs SET state='failed', finished_at=?, expires_at=?, "
                "error='server died while running it ' || attempts || ' times', "
                "message='failed' WHERE state='running' AND attempts >= ?",
                (now, now + self.settings.job_result_ttl_s, self.settings.job_max_attempts),
            ).rowcount
            resumed = db.execute(
                "UPDATE jobs SET state='queued', progress=0, "
                "message='re-queued after a restart' WHERE state='running'"
            ).rowcount
            queued = db.execute("SELECT COUNT(*) FROM jobs WHERE state='queued'").fetchone()[0]
        if resumed or cancelled or queued or poisoned:
            log.info(
                "job journal %s: %d interrupted job(s) re-queued, %d cancelled, %d failed "
                "after %d attempts, %d queued",
                self.path,
                resumed,
                cancelled,
                poisoned,
                self.settings.job_max_attempts,
                queued,
            )
        self._refresh_depth()

    def _start_workers(self) -> None:
        if self.runner is not None:
            for i in range(max(1, self.settings.job_workers)):
                thread = threading.Thread(
                    target=self._worker_loop, name=f"limelight-job-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
            if self.metrics is not None:
                self.metrics.job_workers.labels(backend="sqlite").set(len(self._threads))

    async def stop(self, grace_s: float) -> None:
        self._stopping.set()
        with self._work:
            self._work.notify_all()
        opening = self._waiting_for_room
        if opening is not None:  # it looks at _stopping between tries
            await asyncio.to_thread(opening.join, grace_s)
            self._waiting_for_room = None
        deadline = time.monotonic() + grace_s
        # Within grace_s in all: running jobs may finish in the first part; in the rest they
        # stop at their next checkpoint and go back to QUEUED; one stuck between checkpoints
        # stays RUNNING in the journal and is re-queued by the next start().
        hand_back = min(grace_s / 2, self._yield_timeout_s * 2)
        await asyncio.to_thread(self._join, max(0.0, grace_s - hand_back))
        if any(t.is_alive() for t in self._threads):
            self._abandon.set()
            # At least a short window for the hand-back itself (one checkpoint).
            window = max(deadline - time.monotonic(), min(0.5, self._yield_timeout_s))
            await asyncio.to_thread(self._join, window)
        self._threads = [t for t in self._threads if t.is_alive()]
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    async def submit(self, spec: JobSpec) -> JobRecord:
        if self._stopping.is_set():
            raise Unavailable("the server is shutting down")
        if self.runner is not None:
            spec = replace(spec, params=self.runner.validate(spec))
        now = time.time()
        job_id = uuid.uuid4().hex
        with self._tx() as db:
            self._purge(db)
            key = scoped_key(spec.owner, spec.idempotency_key)
            if key:
                row = db.execute(
                    f"SELECT {_COLUMNS} FROM jobs WHERE idempotency_key = ?", (key,)
                ).fetchone()
                if row is not None:
                    return reuse(self._record(row), spec)
            queued = db.execute("SELECT COUNT(*) FROM jobs WHERE state='queued'").fetchone()[0]
            if queued >= self.settings.job_queue_max:
                raise queue_full(self.settings, queued, per_owner=False)
            per_owner = self.settings.job_queue_max_per_owner
            if per_owner is not None:
                mine = db.execute(
                    "SELECT COUNT(*) FROM jobs WHERE owner = ? AND state = 'queued'", (spec.owner,)
                ).fetchone()[0]
                if mine >= per_owner:
                    raise queue_full(self.settings, mine, per_owner=True)
            db.execute(
                "INSERT INTO jobs (id, method, state, spec, created_at, idempotency_key, message, "
                "owner) VALUES (?, ?, 'queued', ?, ?, ?, 'queued', ?)",
                (
                    job_id,
                    spec.method,
                    json.dumps(spec_to_dict(spec)),
                    now,
                    key or None,
                    spec.owner,
                ),
            )
            row = db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
            self._trim_owner(db, spec.owner)
        self._refresh_depth()
        with self._work:
            self._work.notify()
        return self._record(row)

    def _trim_owner(self, db: sqlite3.Connection, owner: str) -> None:
        """Past ``job_retain_max`` jobs of ``owner``: drop its oldest finished ones."""
        kept = db.execute("SELECT COUNT(*) FROM jobs WHERE owner = ?", (owner,)).fetchone()[0]
        over = kept - self.settings.job_retain_max
        if over > 0:
            db.execute(
                "DELETE FROM jobs WHERE seq IN (SELECT seq FROM jobs WHERE owner = ? AND state "
                "IN ('succeeded', 'failed', 'cancelled') ORDER BY created_at, seq LIMIT ?)",
                (owner, over),
            )

    def _get_row(
        self, db: sqlite3.Connection, job_id: str, owner: str | None = None
    ) -> sqlite3.Row:
        self._purge(db)
        row = db.execute(f"SELECT {_COLUMNS}, owner FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None or (owner is not None and row["owner"] != owner):
            if self._replaced_at is None:
                raise not_found(job_id)
            # A job worker's poll may have been the call that found the damage: whoever asks for
            # a job the damaged journal held learns where it went, not just "unknown".
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self._replaced_at))
            raise NotFound(
                f"job {job_id[:64]!r} not found: unknown, expired, or held by the job store that "
                f"was found damaged and replaced by an empty one at {when} (its jobs are lost: "
                "submit them again)"
            )
        return row

    async def get(self, job_id: str, owner: str | None = None) -> JobRecord:
        with self._tx() as db:
            row = self._get_row(db, job_id, owner)
        return self._record(row)

    async def cancel(self, job_id: str, owner: str | None = None) -> JobRecord:
        now = time.time()
        with self._tx() as db:
            row = self._get_row(db, job_id, owner)
            state = JobState(row["state"])
            if state is JobState.QUEUED:
                db.execute(
                    "UPDATE jobs SET state='cancelled', finished_at=?, expires_at=?, "
                    "message='cancelled' WHERE id=?",
                    (now, now + self.settings.job_result_ttl_s, job_id),
                )
                if self.metrics is not None:
                    self.metrics.job_outcomes.labels(row_method(row), "cancelled").inc()
            elif state is JobState.RUNNING:
                db.execute(
                    "UPDATE jobs SET cancel_requested=1, message='cancelling' WHERE id=?",
                    (job_id,),
                )
                control = self._running.get(job_id)
                if control is not None:
                    control.cancelled = True
            row = self._get_row(db, job_id)
        self._refresh_depth()
        self._notify(job_id)
        return self._record(row)

    async def list(
        self,
        states: list[JobState] | None,
        limit: int,
        owner: str | None = None,
        after: JobCursor | None = None,
    ) -> list[JobRecord]:
        """Newest first; results are left out (read one job with ``get``)."""
        where: list[str] = ["1=1"]
        args: list[Any] = []
        if states:
            where.append(f"state IN ({','.join('?' for _ in states)})")
            args += [s.value for s in states]
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if after is not None:
            where.append("(created_at < ? OR (created_at = ? AND id < ?))")
            args += [after.created_at, after.created_at, after.id]
        with self._tx() as db:
            self._purge(db)
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM jobs WHERE {' AND '.join(where)} "
                "ORDER BY created_at DESC, id DESC LIMIT ?",
                (*args, max(1, limit)),
            ).fetchall()
        return [self._record(r, with_result=False) for r in rows]

    async def watch(self, job_id: str, owner: str | None = None) -> AsyncIterator[JobRecord]:
        await self.get(job_id, owner)  # NotFound before subscribing
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        key = (loop, event)
        with self._watch_lock:
            self._watchers.setdefault(job_id, set()).add(key)

        async def wait_change(timeout: float) -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=timeout)
            event.clear()

        try:
            async for record in watch_changes(lambda: self.get(job_id, owner), wait_change):
                yield record
        finally:
            with self._watch_lock:
                watchers = self._watchers.get(job_id)
                if watchers is not None:
                    watchers.discard(key)
                    if not watchers:
                        del self._watchers[job_id]

    # --- workers -------------------------------------------------------------------------------

    def _worker_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                claimed = self._claim()
            except Unavailable:
                return
            except (ResourceExhausted, DataLoss):  # logged by _tx; try again after the poll
                claimed = None
            except Exception:
                log.exception("job worker: claiming a job failed")
                claimed = None
            if claimed is None:
                with self._work:
                    if not self._stopping.is_set():
                        self._work.wait(self._idle_poll_s)
                continue
            try:
                self._execute(*claimed)
            except Exception:  # this thread must live on: it is one of the few job workers
                log.exception("job worker: job %s failed outside its method", claimed[0])

    def _claim(self) -> tuple[str, JobSpec, float, _Control] | None:
        now = time.time()
        with self._tx() as db:
            self._purge(db)
            row = db.execute(
                "SELECT id, spec, created_at FROM jobs WHERE state='queued' ORDER BY seq LIMIT 1"
            ).fetchone()
            if row is None:
                return None
            db.execute(
                "UPDATE jobs SET state='running', started_at=?, attempts=attempts+1, "
                "progress=0, message='running' WHERE id=?",
                (now, row["id"]),
            )
            spec = spec_from_dict(json.loads(row["spec"]))
            control = _Control()
            self._running[row["id"]] = control
        if self.metrics is not None:
            self.metrics.job_wait.labels(spec.method).observe(max(0.0, now - row["created_at"]))
        self._refresh_depth()
        self._notify(row["id"])
        return row["id"], spec, now - row["created_at"], control

    def _update(self, job_id: str, sql: str, args: tuple[Any, ...], *, wait: bool = True) -> bool:
        """Journal a change from a worker; False when the store is closed (after stop): the
        job is still RUNNING in the journal then and the next start() re-queues it. While the
        disk is full or the database busy it tries again (``wait``) until it can or the job is
        abandoned; a progress report (not ``wait``) is skipped instead."""
        delay = 0.1
        while True:
            try:
                with self._tx() as db:
                    db.execute(sql, (*args, job_id))
            except DataLoss:  # logged by _tx; the journal cannot take this job's outcome
                return False
            except (ResourceExhausted, Unavailable):
                if self._db is None or not wait or self._abandon.is_set():
                    return False
                self._abandon.wait(delay)
                delay = min(WRITE_RETRY_MAX_S, delay * 2)
                continue
            self._notify(job_id)
            return True

    def _execute(self, job_id: str, spec: JobSpec, waited: float, control: _Control) -> None:
        assert self.runner is not None

        def check() -> StopReason | None:
            if self.gate is not None:
                self.gate.wait_idle(self._yield_timeout_s)
            if control.cancelled:
                return StopReason.CANCELLED
            return StopReason.RELEASE if self._abandon.is_set() else None

        def write_progress(fraction: float, message: str) -> None:
            # After a cancel request the message stays 'cancelling' (as in the Redis backend).
            self._update(
                job_id,
                "UPDATE jobs SET progress=?, "
                "message=CASE WHEN cancel_requested=1 THEN message ELSE ? END WHERE id=?",
                (fraction, message),
                wait=False,  # progress can be skipped; the outcome cannot
            )

        def settle(outcome: Outcome) -> bool:
            if outcome.state is JobState.QUEUED:
                # A voluntary hand-back is not a failed attempt. A cancel that came after the
                # job's last look at it wins: queued again, the next claim would run it anew.
                now = time.time()
                return self._update(
                    job_id,
                    "UPDATE jobs SET progress=0, attempts=attempts-1, "
                    "state=CASE WHEN cancel_requested=1 THEN 'cancelled' ELSE 'queued' END, "
                    "finished_at=CASE WHEN cancel_requested=1 THEN ? ELSE finished_at END, "
                    "expires_at=CASE WHEN cancel_requested=1 THEN ? ELSE expires_at END, "
                    "message=CASE WHEN cancel_requested=1 THEN 'cancelled' ELSE ? END WHERE id=?",
                    (now, now + self.settings.job_result_ttl_s, outcome.message),
                )
            assert outcome.state is not None
            return self._finish(
                job_id,
                outcome.state,
                message=outcome.message,
                error=outcome.error,
                result=outcome.result or None,
                progress=1.0 if outcome.state is JobState.SUCCEEDED else None,
            )

        try:
            execute(
                self.runner,
                self.settings,
                job_id,
                spec,
                JobHooks(check, write_progress, settle, where="server"),
                waited=waited,
                metrics=self.metrics,
            )
        finally:
            with self._lock:
                self._running.pop(job_id, None)
        self._refresh_depth()

    def _finish(
        self,
        job_id: str,
        state: JobState,
        *,
        message: str,
        error: str = "",
        result: str | None = None,
        progress: float | None = None,
    ) -> bool:
        now = time.time()
        return self._update(
            job_id,
            "UPDATE jobs SET state=?, finished_at=?, expires_at=?, error=?, message=?, "
            "result=?, progress=COALESCE(?, progress) WHERE id=?",
            (
                state.value,
                now,
                now + self.settings.job_result_ttl_s,
                error,
                message,
                result,
                progress,
            ),
        )


def row_method(row: sqlite3.Row) -> str:
    return str(json.loads(row["spec"])["method"])
