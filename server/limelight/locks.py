"""Locks between processes on a shared cache directory: an exclusive one for builds (the demo
model, the lexicon table: the first process builds, the others wait and then find it built),
and shared ones a process holds on what it uses from the cache while it runs, so that
``limelight cache prune`` leaves those alone."""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

#: The name's end of the lock a process holds on a cache folder it uses (see ``in_use_lock``).
IN_USE_SUFFIX = ".in-use.lock"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an ``fcntl`` lock on ``path`` (created, with its folder, when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def held_elsewhere(path: Path) -> bool:
    """Does another process hold the lock on ``path`` right now? (False when it does not
    exist.) For messages such as "being built": never wait on the answer, it may change."""
    if not path.exists():
        return False
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def in_use_lock(folder: Path) -> Path:
    """The lock beside ``folder`` that the processes using it hold shared (hidden, so that
    listings of the cache's folders skip it)."""
    return folder.parent / f".{folder.name}{IN_USE_SUFFIX}"


class InUse:
    """Shared locks on cache folders, held from ``hold`` until ``release`` or the process
    ends (the kernel drops a dead process's locks, so a killed sidecar holds nothing)."""

    def __init__(self) -> None:
        self._handles: list[IO[str]] = []

    def hold(self, folders: Iterable[Path]) -> InUse:
        for folder in folders:
            lock = in_use_lock(folder)
            try:
                lock.parent.mkdir(parents=True, exist_ok=True)
                handle = lock.open("a")
            except OSError as exc:  # a read-only cache: nothing can prune it either
                log.debug("not marking %s in use: %s", folder, exc)
                continue
            # Shared: any number of sidecars and workers may use one folder; prune asks for
            # the lock exclusively (without waiting) just before it removes anything.
            fcntl.flock(handle, fcntl.LOCK_SH)
            self._handles.append(handle)
        return self

    def release(self) -> None:
        for handle in self._handles:
            handle.close()
        self._handles.clear()
